package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// The lifecycle matrix (README, "Lock lifecycle"): every way an attempt
// ends in asynq v0.26.0, against every policy, on both enqueue paths. Each
// cell enqueues a task, lets asynq end it that way, and then asserts what a
// second enqueue of the same key gets, who holds the key after it, and that
// the key never had two live tasks or two overlapping runs where the policy
// promises one. A worker killed by SIGKILL is not a row here (it needs a
// process per worker): TestFaultWorkerKilled, TestDeferFollowUpSurvivesDeadWorker
// and TestPromiseNewestPayloadRunsLastAfterWorkerDeath cover it.

// lcPolicy is one column: a rule for the cell's own task type.
type lcPolicy struct {
	name string
	rule Rule
}

var lcPolicies = []lcPolicy{
	{"Reject", Rule{}},
	{"Replace", Rule{OnConflict: Replace}},
	{"Merge", Rule{OnConflict: Merge, MergeFunc: addMerge}},
	{"RunningAllow", Rule{OnRunning: RunningAllow}},
	{"RunningDefer", Rule{OnConflict: Replace, OnRunning: RunningDefer}},
	{"MaxPending", Rule{MaxPending: 1}},
	{"Cooldown", Rule{Cooldown: time.Hour}},
	{"Debounce", Rule{OnConflict: Replace, Debounce: 2 * time.Second}}, // overrides the rows' ProcessIn: due in 2 s
	{"Period", Rule{Period: 24 * time.Hour}},
	{"FailHold", Rule{OnFailure: FailHold, FailHoldFor: time.Hour}},
}

// lcClass is where an ending leaves the first task.
type lcClass int

const (
	lcAgain          lcClass = iota // asynq will run it again (a retry, or back in the queue)
	lcWaiting                       // it waits and never started (a paused queue)
	lcOver                          // it ran and ended for good (completed, deleted or archived)
	lcRemoved                       // the Inspector deleted it while it waited
	lcArchivedByHand                // the Inspector archived it while it waited (no failure)
)

// lcEnding is one row.
type lcEnding struct {
	name    string
	opts    func() []asynq.Option // for the first enqueue
	handler func(ctx context.Context, release <-chan struct{}) error
	tweak   func(*asynq.Config)
	drive   func(t *testing.T, w *lcWorld) // after the first enqueues: make asynq end them
	class   lcClass
	success bool // the handler's success ends the task (Cooldown keeps the key)
	archive bool // asynq archives the task after it failed (FailHold keeps the key)
}

var errLifecycle = errors.New("lifecycle: handler failed")

func lcOpts(o ...asynq.Option) func() []asynq.Option { return func() []asynq.Option { return o } }

func lcReturn(err error) func(context.Context, <-chan struct{}) error {
	return func(context.Context, <-chan struct{}) error { return err }
}

// lcLate ignores its context and returns err once released.
func lcLate(err error) func(context.Context, <-chan struct{}) error {
	return func(_ context.Context, release <-chan struct{}) error { <-release; return err }
}

var lcEndings = []lcEnding{
	{name: "success", handler: lcReturn(nil), drive: lcSettle, class: lcOver, success: true},
	{name: "error with retries left", handler: lcReturn(errLifecycle), drive: lcSettle, class: lcAgain},
	{name: "error on the last retry", opts: lcOpts(asynq.MaxRetry(0)), handler: lcReturn(errLifecycle), drive: lcSettle, class: lcOver, archive: true},
	{name: "SkipRetry", handler: lcReturn(fmt.Errorf("give up: %w", asynq.SkipRetry)), drive: lcSettle, class: lcOver, archive: true},
	{name: "RevokeTask", handler: lcReturn(asynq.RevokeTask), drive: lcSettle, class: lcOver},
	{name: "panic", handler: func(context.Context, <-chan struct{}) error { panic("lifecycle") }, drive: lcSettle, class: lcAgain},
	{name: "Timeout passed, handler returns nil", opts: lcOpts(asynq.Timeout(time.Second)), handler: lcLate(nil),
		drive: lcLateUntil(asynq.TaskStateRetry, nil), class: lcAgain},
	// (The deadline leaves the Debounce cell's task, due 2 s after its
	// enqueue rounded up to asynq's whole seconds, time to start.)
	{name: "Deadline passed, handler returns an error", opts: func() []asynq.Option { return []asynq.Option{asynq.Deadline(time.Now().Add(5 * time.Second))} }, handler: lcLate(errLifecycle),
		drive: lcLateUntil(asynq.TaskStateRetry, nil), class: lcAgain},
	{name: "CancelProcessing", handler: lcLate(nil), class: lcAgain,
		drive: lcLateUntil(asynq.TaskStateRetry, func(w *lcWorld, id string) { _ = w.h.insp.CancelProcessing(id) })},
	{name: "shutdown outlived", handler: lcLate(nil), class: lcAgain,
		tweak: func(c *asynq.Config) { c.ShutdownTimeout = 100 * time.Millisecond }, drive: lcShutdown},
	{name: "Inspector archives the waiting task", opts: lcOpts(asynq.ProcessIn(time.Hour)), handler: lcReturn(nil), class: lcArchivedByHand,
		drive: lcInspect(func(w *lcWorld, id string) error { return w.h.insp.ArchiveTask(w.h.queue, id) })},
	{name: "Inspector deletes the waiting task", opts: lcOpts(asynq.ProcessIn(time.Hour)), handler: lcReturn(nil), class: lcRemoved,
		drive: lcInspect(func(w *lcWorld, id string) error { return w.h.insp.DeleteTask(w.h.queue, id) })},
	{name: "Inspector runs the scheduled task", opts: lcOpts(asynq.ProcessIn(time.Hour)), handler: lcReturn(nil), class: lcOver, success: true,
		drive: func(t *testing.T, w *lcWorld) {
			lcInspect(func(w *lcWorld, id string) error { return w.h.insp.RunTask(w.h.queue, id) })(t, w)
			lcSettle(t, w)
		}},
	{name: "paused queue", handler: lcReturn(nil), class: lcWaiting, drive: func(*testing.T, *lcWorld) {}},
	{name: "IsFailure false on the last retry", opts: lcOpts(asynq.MaxRetry(0)), handler: lcReturn(errLifecycle),
		tweak: func(c *asynq.Config) { c.IsFailure = func(error) bool { return false } }, drive: lcSettle, class: lcOver, archive: true},
}

// lcCell is one policy on one enqueue path, with a task type of its own.
type lcCell struct {
	pol    lcPolicy
	direct bool
	typ    string
	client *Client
	first  *asynq.TaskInfo
}

func (c *lcCell) task(seq int) *asynq.Task {
	b, _ := json.Marshal(counterPayload{Key: "k", N: 1, Seq: seq})
	return asynq.NewTask(c.typ, b)
}

// lcWorld is one row's world: a harness, a server, and what the handler saw.
type lcWorld struct {
	h       *harness
	srv     *asynq.Server
	cells   []*lcCell
	release chan struct{}
	started chan string // task IDs whose handler began
	settled chan string // task IDs whose middleware returned

	mu       sync.Mutex
	running  map[string]int  // task type → handlers running now
	ended    map[string]bool // task IDs whose handler has returned
	overlaps []string
}

func TestLifecycleMatrix(t *testing.T) {
	needRealRedis(t)
	for _, e := range lcEndings {
		t.Run(e.name, func(t *testing.T) {
			t.Parallel()
			w := newLCWorld(t, &e)
			e.drive(t, w)
			for _, c := range w.cells {
				w.checkSecond(t, &e, c)
			}
			w.checkLive(t)
		})
	}
}

func newLCWorld(t *testing.T, e *lcEnding) *lcWorld {
	rules := map[string]Rule{}
	w := &lcWorld{release: make(chan struct{}), started: make(chan string, 64), settled: make(chan string, 64), running: map[string]int{}, ended: map[string]bool{}}
	for _, p := range lcPolicies {
		for _, direct := range []bool{false, true} {
			c := &lcCell{pol: p, direct: direct, typ: fmt.Sprintf("lc:%s:%v", p.name, direct)}
			r := p.rule
			r.Fields = []string{"key"}
			rules[c.typ] = r
			w.cells = append(w.cells, c)
		}
	}
	w.h = newHarness(t, Config{Rules: rules})
	t.Cleanup(func() { lcOpen(w.release) })
	if e.class == lcWaiting {
		if err := w.h.insp.PauseQueue(w.h.queue); err != nil {
			t.Fatal(err)
		}
	}
	w.serve(t, e)
	for _, c := range w.cells {
		c.client = w.h.client
		if c.direct {
			c.client = w.h.d.NewClient()
		}
		opts := []asynq.Option{asynq.Queue(w.h.queue)}
		if e.opts != nil {
			opts = append(opts, e.opts()...)
		}
		info, err := c.client.Enqueue(c.task(1), opts...)
		if err != nil {
			t.Fatalf("%s: first enqueue: %v", c.typ, err)
		}
		c.first = info
	}
	return w
}

// serve runs the row's server: the middleware between an outer wrapper that
// reports when it returned and an inner handler that tracks overlaps.
func (w *lcWorld) serve(t *testing.T, e *lcEnding) {
	inner := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		w.enter(task.Type())
		id, _ := asynq.GetTaskID(ctx)
		defer w.leave(task.Type(), id)
		w.started <- id
		return e.handler(ctx, w.release)
	})
	mw := w.h.d.Middleware()(inner)
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		defer func() { w.settled <- id }() // also after a panic, which goes on to asynq
		return mw.ProcessTask(ctx, task)
	})
	cfg := asynq.Config{
		Concurrency: 2 * len(w.cells), Queues: map[string]int{w.h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: IsFailure,
	}
	retryInAnHour(&cfg)
	if e.tweak != nil {
		e.tweak(&cfg)
	}
	w.srv = asynq.NewServerFromRedisClient(w.h.rdb, cfg)
	if err := w.srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(w.srv.Shutdown) }
	t.Cleanup(func() { lcOpen(w.release); stop() })
}

func (w *lcWorld) enter(typ string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.running[typ]++
	if w.running[typ] > 1 {
		w.overlaps = append(w.overlaps, typ)
	}
}

func (w *lcWorld) leave(typ, id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.running[typ]--
	w.ended[id] = true
}

func lcOpen(ch chan struct{}) {
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// waitIDs waits until every first task's ID came through ch.
func (w *lcWorld) waitIDs(t *testing.T, ch <-chan string, what string) {
	t.Helper()
	want := map[string]bool{}
	for _, c := range w.cells {
		want[c.first.ID] = true
	}
	for len(want) > 0 {
		delete(want, waitFor(t, ch, what))
	}
}

// lcSettle waits until every first attempt has ended, its lock settled, and
// asynq has moved its task on (the middleware settles the lock just before
// asynq writes the task's fate).
func lcSettle(t *testing.T, w *lcWorld) {
	w.waitIDs(t, w.settled, "attempt settled")
	for _, c := range w.cells {
		eventually(t, "asynq moves "+c.typ+" on", func() bool { return w.h.taskState(c.first.ID) != asynq.TaskStateActive })
	}
}

// lcLateUntil lets asynq give every attempt up (nudge, if given, is sent
// until it does) while the handlers ignore their contexts, then lets the
// handlers return and waits until the middleware settled them.
func lcLateUntil(state asynq.TaskState, nudge func(w *lcWorld, id string)) func(*testing.T, *lcWorld) {
	return func(t *testing.T, w *lcWorld) {
		w.waitIDs(t, w.started, "handler started")
		for _, c := range w.cells {
			eventually(t, "asynq moves "+c.typ+" on", func() bool {
				if nudge != nil {
					nudge(w, c.first.ID)
				}
				return w.h.taskState(c.first.ID) == state
			})
		}
		close(w.release)
		lcSettle(t, w)
	}
}

// lcShutdown shuts the server down while every handler outlives
// ShutdownTimeout: asynq puts the tasks back in the queue.
func lcShutdown(t *testing.T, w *lcWorld) {
	w.waitIDs(t, w.started, "handler started")
	w.srv.Shutdown()
	for _, c := range w.cells {
		if st := w.h.taskState(c.first.ID); st != asynq.TaskStatePending {
			t.Fatalf("%s after shutdown: %v, want pending", c.typ, st)
		}
	}
	close(w.release)
	lcSettle(t, w)
}

func lcInspect(op func(w *lcWorld, id string) error) func(*testing.T, *lcWorld) {
	return func(t *testing.T, w *lcWorld) {
		for _, c := range w.cells {
			if err := op(w, c.first.ID); err != nil {
				t.Fatalf("%s: %v", c.typ, err)
			}
		}
	}
}

// cools reports whether the ending leaves the key cooling down.
func (c *lcCell) cools(e *lcEnding) bool {
	return e.success && (c.pol.rule.Cooldown > 0 || c.pol.rule.Period > 0)
}

// failHeld reports whether the ending leaves the key held as failed: a
// task asynq archived after it failed, under FailHold.
func (c *lcCell) failHeld(e *lcEnding) bool {
	return e.archive && c.pol.rule.OnFailure == FailHold
}

// expect is the matrix's cell: what a second enqueue of the key gets after
// the ending (0 for a duplicate), and whether the first task still holds the
// key.
func (c *lcCell) expect(e *lcEnding) (Outcome, bool) {
	class := e.class
	switch {
	case c.cools(e):
		return 0, true // the key cools down, held by the task that succeeded
	case c.failHeld(e):
		return 0, true // held after the failure
	case class == lcOver, class == lcArchivedByHand, class == lcRemoved && c.direct:
		return Created, false // the key is free (archived: healed at once; a direct lock has no enqueue gap to wait out)
	case class == lcRemoved:
		return 0, true // a lock taken before its task was stored waits out HealGrace when its task is missing
	case class == lcAgain && c.pol.rule.OnRunning == RunningAllow:
		return Created, false // the key was freed when the task started
	case c.pol.rule.OnConflict == Replace: // (Debounce too)
		return Replaced, true
	case c.pol.rule.OnConflict == Merge:
		return Merged, true
	}
	return 0, true
}

func (w *lcWorld) checkSecond(t *testing.T, e *lcEnding, c *lcCell) {
	t.Helper()
	want, firstHolds := c.expect(e)
	res, err := c.client.Submit(context.Background(), c.task(2), asynq.Queue(w.h.queue))
	var dup *DuplicateTaskError
	switch {
	case want == 0 && (!errors.As(err, &dup) || dup.Holder != c.first.ID):
		t.Errorf("%s: second enqueue: %+v, %v; want a duplicate of %s", c.typ, res, err, c.first.ID)
	case want == 0 && dup.CoolingDown != c.cools(e):
		t.Errorf("%s: duplicate's CoolingDown is %v", c.typ, dup.CoolingDown)
	case want == 0 && dup.FailHeld != c.failHeld(e):
		t.Errorf("%s: duplicate's Failed is %v", c.typ, dup.FailHeld)
	case want != 0 && (err != nil || res.Outcome != want):
		t.Errorf("%s: second enqueue: %+v, %v; want outcome %v", c.typ, res, err, want)
	case want != 0 && firstHolds && res.TaskID != c.first.ID:
		t.Errorf("%s: folded into %s, want the first task %s", c.typ, res.TaskID, c.first.ID)
	}
	owner := w.h.lockOwner(w.h.keyOf(c.task(2), w.h.queue))
	switch {
	case firstHolds && owner != c.first.ID:
		t.Errorf("%s: key held by %q, want the first task %s", c.typ, owner, c.first.ID)
	case !firstHolds && want == Created && err == nil && owner != res.TaskID &&
		!(owner == "" && (c.pol.rule.OnRunning == RunningAllow || w.ranOut(res.TaskID))): // the new task may have started (freeing the key under RunningAllow), or even finished
		t.Errorf("%s: key held by %q, want the new task %s", c.typ, owner, res.TaskID)
	}
}

// done reports whether task id has run to its end (completed, or deleted
// after success): the server runs the second task too, and releases its key.
func (w *lcWorld) done(id string) bool {
	st := w.h.taskState(id)
	return st == 0 || st == asynq.TaskStateCompleted
}

// ranOut reports whether task id is done (completed, or deleted after
// success) or its handler has returned: the middleware frees the key after
// the handler and before asynq marks the task done.
func (w *lcWorld) ranOut(id string) bool {
	w.mu.Lock()
	ended := w.ended[id]
	w.mu.Unlock()
	return ended || w.done(id)
}

// checkLive: no handlers of one key ever overlapped, and no key has two
// live tasks in asynq, except under RunningAllow, which promises neither.
func (w *lcWorld) checkLive(t *testing.T) {
	t.Helper()
	allow := func(typ string) bool { return w.h.d.rules[typ].running == RunningAllow }
	w.mu.Lock()
	for _, typ := range w.overlaps {
		if !allow(typ) {
			t.Errorf("%s: two handlers of one key ran at once", typ)
		}
	}
	w.mu.Unlock()
	live := map[string]map[string]bool{} // type → IDs (a task moving between lists while they are read counts once)
	for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){
		w.h.insp.ListPendingTasks, w.h.insp.ListScheduledTasks, w.h.insp.ListRetryTasks, w.h.insp.ListActiveTasks,
	} {
		infos, err := list(w.h.queue, asynq.PageSize(1000))
		if err != nil {
			t.Fatal(err)
		}
		for _, ti := range infos {
			if live[ti.Type] == nil {
				live[ti.Type] = map[string]bool{}
			}
			live[ti.Type][ti.ID] = true
		}
	}
	for typ, ids := range live {
		if len(ids) > 1 && !allow(typ) {
			t.Errorf("%s: live tasks of one key: %v", typ, ids)
		}
	}
}
