package dedup

// The model and the invariants of TestOptionSpace (optionspace_test.go):
// what the test knows about every task, run and accepted payload, the
// handler that reports each run and waits to be told how to end, the wait
// for quiescence after each step, and the checks against asynq's record.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// osPayload is every task's payload: the key field k (absent in a few
// payloads, to draw ErrInvalidPayload), the key the test filed it under
// (kid: the lock's fingerprint, so a run tells its key from its payload),
// the sequence number of the enqueue that made it (s: for Merge, of the
// newest payload merged in) and the set of merge units it carries (u).
type osPayload struct {
	K   *string `json:"k,omitempty"`
	Kid string  `json:"kid"`
	S   int     `json:"s"`
	U   []int   `json:"u"`
}

func (p osPayload) bytes() []byte {
	b, err := json.Marshal(p)
	if err != nil {
		panic(err)
	}
	return b
}

func decodeOS(b []byte) (osPayload, bool) {
	var p osPayload
	err := json.Unmarshal(b, &p)
	return p, err == nil
}

// osMerge is every Merge's function: the union of the unit sets, the
// newer payload's sequence number, the older one's key.
func osMerge(old, new []byte) ([]byte, error) {
	a, ok1 := decodeOS(old)
	b, ok2 := decodeOS(new)
	if !ok1 || !ok2 {
		return nil, errors.New("optionspace: merge of a payload that is not the test's")
	}
	u := append(slices.Clone(a.U), b.U...)
	slices.Sort(u)
	a.U, a.S = slices.Compact(u), b.S
	return json.Marshal(a)
}

// osOrigin is how a task came to be.
type osOrigin int

const (
	osAccepted osOrigin = iota // created by a successful Submit (or a Defer's follow-up)
	osLibrary                  // a dd- task the test did not create: made by the middleware (BusyFold)
	osLockless                 // enqueued by asynq's own client, or the middleware's da- copy of one
	osUnlocked                 // enqueued with dedup.Skip: no key
)

func (o osOrigin) String() string {
	return [...]string{"accepted", "library-made", "lockless", "skipped"}[o]
}

// osKey is one lock: the queue the task lives in and the fingerprint.
type osKey struct{ queue, kid string }

func (k osKey) String() string { return qn(k.queue) + "/" + short(k.kid) }

// qn names one of the run's queues by its last part: q-0, q-1, q-2.
func qn(q string) string { return "q" + q[strings.LastIndex(q, "-"):] }

func short(s string) string {
	if len(s) > 6 {
		return s[:6]
	}
	return s
}

// osTask is one task record (one generation of a task ID in a queue).
type osTask struct {
	label      string
	id, queue  string
	typ, kid   string
	origin     osOrigin
	followUp   bool
	started    bool // its handler has run at least once (it took the lock)
	allowCopy  bool // a busy last attempt's copy of a started RunningAllow task: its next attempt, as exempt as it
	released   bool // the operator released its lock, and it has not taken the key again
	guarded    bool // moved by the enqueuer and taken by a worker before the call could move it back: it meets its key as the execution-time guard's (relocate.go)
	wasRelease bool // ever released by the operator
	removed    string
	failed     bool // archived by asynq after a run that failed
	done       bool // ran to success (asynq deleted or completed it)
	units      map[int]bool
	lastArrive int64 // event of its last entry into the middleware
	found      int64 // event at which the test learned of it from asynq (0: from the call that made it)
	foldedInto bool  // an accepted payload was folded into it
	s          int   // the payload's s when the test last knew it
}

func (t *osTask) key() osKey { return osKey{t.queue, t.kid} }

// counts: the task holds (or waits with) a lock the library gave it.
func (t *osTask) counts() bool {
	return (t.origin == osAccepted || t.origin == osLibrary) && !t.released && !t.guarded && t.removed == "" && t.kid != ""
}

// osEnd is how the test tells a handler to end.
type osEnd int

const (
	endSuccess osEnd = iota
	endError
	endPanic
	endSkipRetry
	endRevoke
)

func (e osEnd) String() string {
	return [...]string{"success", "error", "panic", "SkipRetry", "RevokeTask"}[e]
}

var errOptionSpace = errors.New("optionspace: handler failed")

// osRun is one handler run.
type osRun struct {
	label           string
	task            *osTask
	queue, typ, kid string
	p               osPayload
	retried, max    int
	ctx             context.Context
	reply           chan osEnd
	done            chan struct{} // closed when the middleware call that ran it has returned
	start           int64
	zombie          bool // asynq gave the attempt up (Timeout, shutdown) while it ran
	ended           bool
	end             osEnd
	endedZombie     bool
	releasedRunning bool // its lock was released by the operator while it ran
	verify          bool // returned nil while asynq still waited for it: success is read from the record
	checked         bool // its end was checked against asynq's record
	success         bool
}

func (r *osRun) live() bool { return !r.ended && r.ctx.Err() == nil }

// zombieRuns reports whether a handler of t that asynq gave up still runs;
// m.mu is held.
func (m *osModel) zombieRuns(t *osTask) bool {
	for _, r := range m.runs {
		if r.task == t && r.zombie && !r.ended {
			return true
		}
	}
	return false
}

// osCall marks one middleware call, so the outer wrapper learns whether
// the handler ran.
type osCall struct{ run *osRun }

type osCallKey struct{}

// osSubmit is one enqueue the test made through the library.
type osSubmit struct {
	n, seq     int
	typ, kid   string
	client     string
	opts       string
	start, end int64
	ctxDone    bool // the call's context had ended when it returned
	res        Result
	err        error
	carrier    *osTask
}

// osKeyInfo is what the test knows about one key.
type osKeyInfo struct {
	newest  *osSubmit // newest accepted payload
	allow   bool      // a RunningAllow type took part: newest-runs-last is not promised
	lastRun *osRun    // last run of a task the library accepted (not released)
}

// osProbe is how to build a task of a lock key again (for the orphan probe).
type osProbe struct {
	typ, k  string
	keyOpts []asynq.Option
	keyDesc string
	queue   string
}

// osDecision is a Config.OnDecision call, with the event it came at.
type osDecision struct {
	Decision
	ev int64
}

// osModel is the test's record, shared with the handlers.
type osModel struct {
	mu         sync.Mutex
	ev         int64
	log        []string
	violations []string
	tasks      map[string]*osTask // queue/id → current generation
	labels     int
	runs       []*osRun
	inFlight   int // middleware calls in progress
	blocked    map[*osRun]bool
	keys       map[osKey]*osKeyInfo
	units      map[int]*osTask   // accepted merge unit → task that carries it (nil: discharged)
	mergeUnits map[int]bool      // the units accepted by a Merge call: each owed exactly once (invariant 6)
	unitExempt map[int]string    // unit → why it need not run
	unitRuns   map[int]int       // unit → successful runs that carried it
	unitTasks  map[int][]*osTask // unit → every task seen carrying it
	refused    map[int]string    // sequence numbers of refused enqueues
	lockless   map[int]*osTask   // sequence numbers of lockless payloads
	carrier    map[int]*osTask   // sequence number → the task that first carried it
	decisions  []osDecision
	srvErrors  []string
}

func newOSModel() *osModel {
	return &osModel{tasks: map[string]*osTask{}, blocked: map[*osRun]bool{}, keys: map[osKey]*osKeyInfo{},
		units: map[int]*osTask{}, mergeUnits: map[int]bool{}, unitTasks: map[int][]*osTask{}, unitExempt: map[int]string{}, unitRuns: map[int]int{}, refused: map[int]string{},
		lockless: map[int]*osTask{}, carrier: map[int]*osTask{}}
}

// next returns a new event number; m.mu is held.
func (m *osModel) next() int64 { m.ev++; return m.ev }

func (m *osModel) logf(format string, args ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.log = append(m.log, fmt.Sprintf(format, args...))
}

// violate records a violation; m.mu is held.
func (m *osModel) violate(inv, format string, args ...any) {
	v := "invariant " + inv + ": " + fmt.Sprintf(format, args...)
	m.violations = append(m.violations, v)
	m.log = append(m.log, "  !! "+v)
}

func (m *osModel) keyInfo(k osKey) *osKeyInfo {
	ki := m.keys[k]
	if ki == nil {
		ki = &osKeyInfo{}
		m.keys[k] = ki
	}
	return ki
}

// task returns the task queue/id, recording an unknown one (made by the
// middleware) from its type and payload; m.mu is held. A task known to have
// succeeded whose ID now runs another type's or key's payload is a new
// generation of a caller-chosen ID, met before the call that made it
// returned (newTask adopts it then).
func (m *osModel) task(w *osWorld, queue, id, typ string, payload []byte) *osTask {
	p, _ := decodeOS(payload)
	if t := m.tasks[queue+"/"+id]; t != nil && !(t.done && (t.typ != typ || t.kid != p.Kid)) {
		return t
	}
	origin := osLockless
	if k := store.KindOf(id); k != store.IDOther && k != store.IDAgain {
		origin = osLibrary
	}
	t := m.newTask(w, queue, id, typ, p.Kid, origin, 0)
	t.s, t.found = p.S, m.next()
	if store.KindOf(id) == store.IDKept {
		// A busy task's last-attempt copy keeps its standing (its message,
		// its dedup-lost header included): a copy of a task whose lock an
		// operator released is as released.
		for _, o := range m.tasks {
			if o != t && o.s == p.S && o.typ == typ && o.released {
				t.released, t.wasRelease = true, true
			}
			if o != t && o.s == p.S && o.typ == typ && o.started && w.rules[typ].OnRunning == RunningAllow {
				t.allowCopy = true
			}
		}
	}
	for _, u := range p.U {
		if _, ok := m.units[u]; ok {
			m.unitTasks[u] = append(m.unitTasks[u], t) // (a copy the middleware made, a fold's new task)
		}
	}
	if origin == osLockless {
		m.lockless[p.S] = t
		if m.carrier[p.S] == nil {
			m.carrier[p.S] = t
		}
	}
	m.log = append(m.log, fmt.Sprintf("  · found %s task %s (%s, %s, key %s, s=%d)", origin, t.label, id, typ, t.key(), p.S))
	return t
}

// newTask files a new generation of queue/id; m.mu is held. A task the
// handler met before the call that made it returned is that call's: it is
// adopted.
func (m *osModel) newTask(w *osWorld, queue, id, typ, kid string, origin osOrigin, since int64) *osTask {
	if t := m.tasks[queue+"/"+id]; t != nil && since > 0 && t.found > since {
		t.origin, t.typ, t.kid, t.found = origin, typ, kid, 0
		if origin != osLockless {
			delete(m.lockless, t.s)
			delete(m.carrier, t.s)
		}
		m.log = append(m.log, fmt.Sprintf("  · %s is the task this call made", t.label))
		return t
	}
	m.labels++
	prefix := map[osOrigin]string{osAccepted: "T", osLibrary: "X", osLockless: "L", osUnlocked: "U"}[origin]
	t := &osTask{label: fmt.Sprintf("%s%d", prefix, m.labels), id: id, queue: queue, typ: typ, kid: kid, origin: origin, units: map[int]bool{}}
	m.tasks[queue+"/"+id] = t
	if kid != "" && w.rules[typ].OnRunning == RunningAllow {
		m.keyInfo(t.key()).allow = true
	}
	return t
}

// The handler: an outer wrapper that counts middleware calls around the
// middleware, and an inner handler that reports each run and blocks until
// the test tells it how to end.

func (w *osWorld) handler() asynq.Handler {
	mw := w.h.d.Middleware()(asynq.HandlerFunc(w.inner))
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) (err error) {
		id, _ := asynq.GetTaskID(ctx)
		q, _ := asynq.GetQueueName(ctx)
		call := &osCall{}
		m := w.m
		m.mu.Lock()
		m.inFlight++
		task := m.task(w, q, id, t.Type(), t.Payload())
		task.lastArrive = m.next()
		seen := len(m.decisions)
		m.mu.Unlock()
		defer func() {
			rec := recover()
			m.mu.Lock()
			m.inFlight--
			if call.run != nil {
				close(call.run.done)
			} else {
				what := "returned nil without running"
				if err != nil {
					what = "returned " + err.Error()
					if lastRetry(ctx) && !task.failed && task.removed == "" {
						task.failed = true // (asynq archives it: its payload is not owed any more)
						what += "; on its last retry, asynq archives it (failed for good)"
					}
				} else if into := m.foldedBusy(task, m.decisions[seen:]); into != nil {
					what += ", folded into " + into.label
				}
				m.log = append(m.log, fmt.Sprintf("  · middleware, %s (%s): %s", task.label, id, what))
			}
			m.mu.Unlock()
			if rec != nil {
				panic(rec)
			}
		}()
		return mw.ProcessTask(context.WithValue(ctx, osCallKey{}, call), t)
	})
}

// lastRetry reports whether the attempt of ctx is its task's last: asynq
// archives a task whose last attempt returns an error.
func lastRetry(ctx context.Context) bool {
	n, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	return n >= maxRetry
}

func (w *osWorld) inner(ctx context.Context, t *asynq.Task) error {
	id, _ := asynq.GetTaskID(ctx)
	q, _ := asynq.GetQueueName(ctx)
	n, _ := asynq.GetRetryCount(ctx)
	mx, _ := asynq.GetMaxRetry(ctx)
	p, _ := decodeOS(t.Payload())
	r := &osRun{queue: q, typ: t.Type(), kid: p.Kid, p: p, retried: n, max: mx, ctx: ctx, reply: make(chan osEnd, 1), done: make(chan struct{})}
	w.runStarts(r, id, t)
	if call, ok := ctx.Value(osCallKey{}).(*osCall); ok {
		call.run = r
	}
	var end osEnd
	select {
	case end = <-r.reply:
	case <-w.stop:
		end = endSuccess
	case <-ctx.Done():
		w.m.mu.Lock()
		r.zombie = true
		w.m.log = append(w.m.log, fmt.Sprintf("  · %s: asynq gave the attempt up (%v); the handler goes on", r.label, context.Cause(ctx)))
		w.m.mu.Unlock()
		select {
		case end = <-r.reply:
		case <-w.stop:
		}
	}
	w.runEnds(r, end)
	switch end {
	case endError:
		return errOptionSpace
	case endPanic:
		panic("optionspace: handler panics")
	case endSkipRetry:
		return fmt.Errorf("optionspace: give up: %w", asynq.SkipRetry)
	case endRevoke:
		return asynq.RevokeTask
	}
	return nil
}

// runStarts records a run and checks that no other live run holds its key
// (invariant 1, second half).
func (w *osWorld) runStarts(r *osRun, id string, t *asynq.Task) {
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	r.task = m.task(w, r.queue, id, t.Type(), t.Payload())
	r.start = m.next()
	r.task.started, r.task.released = true, false
	attempts := 0
	for _, o := range m.runs {
		if o.task == r.task {
			attempts++
		}
	}
	r.label = fmt.Sprintf("%s#%d", r.task.label, attempts+1)
	for _, u := range r.p.U {
		if _, ok := m.units[u]; ok && !slices.Contains(m.unitTasks[u], r.task) {
			m.unitTasks[u] = append(m.unitTasks[u], r.task)
		}
	}
	m.runs = append(m.runs, r)
	m.blocked[r] = true
	m.log = append(m.log, fmt.Sprintf("  · %s runs (%s, %s, key %s, s=%d, u=%v, retried %d/%d)", r.label, qn(r.queue), r.typ, osKey{r.queue, r.kid}, r.p.S, r.p.U, r.retried, r.max))
	if why, ok := m.refused[r.p.S]; ok {
		m.violate("5", "%s runs the payload s=%d of an enqueue that was refused (%s): a refused call enqueued it", r.label, r.p.S, why)
	}
	if r.task.kid != "" && r.kid != r.task.kid && r.task.origin != osLockless {
		m.violate("2", "%s (key %s) runs a payload of another key (%s, s=%d): a fold landed in another key's task", r.label, r.task.key(), osKey{r.queue, r.kid}, r.p.S)
	}
	if r.kid == "" {
		return
	}
	for o := range m.blocked {
		if o == r || o.kid != r.kid || o.queue != r.queue || !o.live() || o.releasedRunning {
			continue
		}
		if w.rules[o.typ].OnRunning == RunningAllow {
			continue // its key was freed when it started
		}
		m.violate("1", "two handlers of key %s run at once: %s (%s) started while %s (%s) runs", osKey{r.queue, r.kid}, r.label, r.typ, o.label, o.typ)
	}
	// The last run of a key, for invariant 2: runs of tasks the library
	// accepted, and runs of lockless tasks that carry a payload it
	// accepted (folded into them) or that ever held one; a lockless task
	// running its own payload runs whenever it arrives.
	_, accepted := m.units[r.p.S]
	if !r.task.wasRelease && (r.task.origin != osLockless || accepted || r.task.foldedInto) {
		m.keyInfo(osKey{r.queue, r.kid}).lastRun = r
	}
}

// ranBeforeAccepted makes a run of t carrying payload seq that started
// before the call that made t answered (a worker took the relocating
// WrapClient's task from the queue it first landed in) the last run of key
// k, as it would have been had the call answered first (invariant 2).
func (m *osModel) ranBeforeAccepted(k osKey, t *osTask, seq int) {
	ki := m.keyInfo(k)
	for _, r := range m.runs {
		if r.task == t && r.p.S == seq && !t.wasRelease && (ki.lastRun == nil || ki.lastRun.start < r.start) {
			ki.lastRun = r
		}
	}
}

func (w *osWorld) runEnds(r *osRun, end osEnd) {
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.blocked, r)
	r.ended, r.end = true, end
	r.endedZombie = r.zombie || r.ctx.Err() != nil
	r.verify = end == endSuccess && !r.endedZombie
	if end == endRevoke && !r.endedZombie {
		r.task.failed = true // revoked: asynq deletes it, its payload is not owed any more
	}
}

// foldedBusy finds, among the decisions made while task went through the
// middleware, a busy fold of it (BusyFold) into another task, and hands
// that task the merge units task carried; m.mu is held.
func (m *osModel) foldedBusy(task *osTask, ds []osDecision) *osTask {
	for _, d := range ds {
		if d.Event != eventNames[evBusy] || d.Dropped || d.Type != task.typ || task.kid == "" || !strings.Contains(d.Key, "}:u:"+task.kid) {
			continue
		}
		into := m.tasks[d.Queue+"/"+d.TaskID]
		if into == nil || into == task {
			continue
		}
		for u := range task.units {
			into.units[u] = true
			m.unitTasks[u] = append(m.unitTasks[u], into)
		}
		into.foldedInto = true
		return into
	}
	return nil
}

// decide is Config.OnDecision: a busy arrival folded with Replace into a
// task discharges the merge units that task carried (they are replaced).
func (w *osWorld) decide(d Decision) {
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	m.decisions = append(m.decisions, osDecision{d, m.next()})
	if d.Event != eventNames[evBusy] || d.Dropped {
		return
	}
	r := w.rules[d.Type]
	if r.OnBusy != BusyFold || r.OnConflict == Merge {
		return
	}
	for _, t := range m.tasks {
		if t.id != d.TaskID || t.queue != d.Queue {
			continue
		}
		for u := range t.units {
			if _, ok := m.unitExempt[u]; !ok {
				m.unitExempt[u] = "a busy arrival of " + d.Type + " may have replaced the payload of " + t.label
			}
		}
	}
}

// Quiescence: every middleware call is parked in the handler, asynq's
// active lists hold exactly the runs it still waits for, and nothing is
// pending that a free worker could take.

func (w *osWorld) quiesce(what string) {
	deadline := time.Now().Add(20 * time.Second)
	for {
		if w.quiet() {
			break
		}
		if time.Now().After(deadline) {
			w.fail(fmt.Sprintf("the server did not settle after %s in 20 s", what))
		}
		time.Sleep(5 * time.Millisecond)
	}
	w.verifyRuns()
}

func (w *osWorld) quiet() bool {
	m := w.m
	m.mu.Lock()
	parked := 0
	live := map[string]bool{}
	for r := range m.blocked {
		parked++
		if r.ctx.Err() == nil {
			live[r.queue+"/"+r.task.id] = true
		}
	}
	inFlight := m.inFlight
	m.mu.Unlock()
	if inFlight != parked {
		return false
	}
	ctx := context.Background()
	active := map[string]*redis.StringSliceCmd{}
	pending := map[string]*redis.IntCmd{}
	_, err := w.h.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, q := range w.queues {
			active[q] = p.LRange(ctx, store.ActiveKey(q), 0, -1)
			pending[q] = p.LLen(ctx, store.PendingKey(q))
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		w.fail("read asynq's lists: " + err.Error())
	}
	n, waiting := 0, int64(0)
	for _, q := range w.queues {
		for _, id := range active[q].Val() {
			if !live[q+"/"+id] {
				return false
			}
			n++
		}
		waiting += pending[q].Val()
	}
	return n == len(live) && (waiting == 0 || n >= osConcurrency)
}

// verifyRuns reads, for each run that returned nil while asynq waited for
// it, whether asynq counted it a success (deleted or completed the task),
// and checks the merge units it carried (invariant 6: at most once).
func (w *osWorld) verifyRuns() {
	m := w.m
	m.mu.Lock()
	var check []*osRun
	for _, r := range m.runs {
		if r.ended && !r.checked {
			check = append(check, r)
		}
	}
	m.mu.Unlock()
	for _, r := range check {
		st := w.state(r.queue, r.task.id)
		m.mu.Lock()
		r.checked = true
		switch {
		case r.verify:
			r.verify = false
			if st == "" || st == "completed" {
				r.success, r.task.done = true, true
				for _, u := range r.p.U {
					if _, accepted := m.units[u]; !accepted {
						continue
					}
					m.unitRuns[u]++
					if m.unitRuns[u] > 1 {
						m.violate("6", "merge unit %d ran successfully %d times (last in %s)", u, m.unitRuns[u], r.label)
					}
				}
			} else {
				m.log = append(m.log, fmt.Sprintf("  · %s returned nil but asynq has the task %s: not a success", r.label, st))
			}
		case st == "archived" && !r.task.failed && r.task.removed == "":
			r.task.failed = true
			m.log = append(m.log, fmt.Sprintf("  · %s: asynq archived %s (failed for good)", r.label, r.task.label))
		}
		m.mu.Unlock()
	}
}

// state is asynq's state of task id ("" when it has no record).
func (w *osWorld) state(queue, id string) string {
	s, err := w.h.rdb.HGet(context.Background(), store.TaskKey(queue, id), "state").Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		w.fail("read a task's state: " + err.Error())
	}
	return s
}

func goneState(s string) bool { return s == "" || s == "completed" || s == "archived" }

// osLive is asynq's live tasks (pending, scheduled, retry, active) of the
// test's queues.
type osLive struct {
	state map[string]string // queue/id → state
	due   map[string]time.Time
}

func (w *osWorld) readLive() osLive {
	ctx := context.Background()
	type lists struct {
		pending, active *redis.StringSliceCmd
		scheduled, rtry *redis.ZSliceCmd
	}
	ls := map[string]*lists{}
	_, err := w.h.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, q := range w.queues {
			ls[q] = &lists{
				pending: p.LRange(ctx, store.PendingKey(q), 0, -1), active: p.LRange(ctx, store.ActiveKey(q), 0, -1),
				scheduled: p.ZRangeWithScores(ctx, store.ScheduledKey(q), 0, -1), rtry: p.ZRangeWithScores(ctx, store.RetryKey(q), 0, -1),
			}
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		w.fail("read asynq's lists: " + err.Error())
	}
	out := osLive{state: map[string]string{}, due: map[string]time.Time{}}
	for q, l := range ls {
		for _, id := range l.pending.Val() {
			out.state[q+"/"+id] = "pending"
		}
		for _, id := range l.active.Val() {
			out.state[q+"/"+id] = "active"
		}
		for st, z := range map[string]*redis.ZSliceCmd{"scheduled": l.scheduled, "retry": l.rtry} {
			for _, e := range z.Val() {
				id := e.Member.(string)
				out.state[q+"/"+id] = st
				out.due[q+"/"+id] = time.Unix(int64(e.Score), 0)
			}
		}
	}
	return out
}

// liveTasks files the live tasks, learning unknown ones from their records.
func (w *osWorld) liveTasks(l osLive) map[*osTask]string {
	out := map[*osTask]string{}
	for qid, st := range l.state {
		q, id, _ := strings.Cut(qid, "/")
		w.m.mu.Lock()
		t := w.m.tasks[qid]
		w.m.mu.Unlock()
		if t == nil {
			typ, payload, _, found, err := w.h.d.store.StoredTask(context.Background(), q, id)
			if err != nil {
				w.fail("read a task: " + err.Error())
			}
			if !found {
				continue // gone meanwhile
			}
			w.m.mu.Lock()
			t = w.m.task(w, q, id, typ, payload)
			w.m.mu.Unlock()
		}
		out[t] = st
	}
	return out
}

// checkStep checks the invariants that hold after every step.
func (w *osWorld) checkStep() osLive {
	l := w.readLive()
	live := w.liveTasks(l)
	m := w.m
	m.mu.Lock()
	// Invariant 1: one live task per key among those the library accepted,
	// except a started RunningAllow task (or its busy last attempt's copy), and a holder that started with one
	// follow-up that has not: of a RunningDefer type, or the follow-up its
	// lock owes (a busy arrival of a BusyFold type defers behind a running
	// holder: busy.go's foldBusyOption).
	byKey := map[osKey][]*osTask{}
	for t := range live {
		if t.counts() {
			byKey[t.key()] = append(byKey[t.key()], t)
		}
	}
	for k, ts := range byKey {
		var rest []*osTask
		for _, t := range ts {
			if (t.started || t.allowCopy) && w.rules[t.typ].OnRunning == RunningAllow {
				continue
			}
			rest = append(rest, t)
		}
		sort.Slice(rest, func(i, j int) bool { return rest[i].label < rest[j].label })
		if len(rest) < 2 {
			continue
		}
		if len(rest) == 2 {
			a, b := rest[0], rest[1]
			if b.started && !a.started {
				a, b = b, a
			}
			if a.started && !b.started && a.typ == b.typ && (w.rules[a.typ].OnRunning == RunningDefer || w.owedFollowUp(k) == b.id) {
				continue // a running (or retrying) holder and its follow-up
			}
		}
		var desc []string
		for _, t := range rest {
			desc = append(desc, fmt.Sprintf("%s (%s, %s, %s, started %v)", t.label, t.id, t.typ, live[t], t.started))
		}
		m.violate("1", "key %s has %d live tasks the library accepted: %s; %s", k, len(rest), strings.Join(desc, ", "), w.describeLock(k))
	}
	// Invariant 3: MaxPending per type and queue, over keys with a waiting
	// task that never started.
	waitingKeys := map[[2]string]map[string][]string{}
	for t, st := range live {
		if !t.counts() || t.started || (st != "pending" && st != "scheduled") {
			continue
		}
		tq := [2]string{t.typ, t.queue}
		if waitingKeys[tq] == nil {
			waitingKeys[tq] = map[string][]string{}
		}
		waitingKeys[tq][t.kid] = append(waitingKeys[tq][t.kid], t.label)
	}
	for tq, ks := range waitingKeys {
		if mp := w.rules[tq[0]].MaxPending; mp > 0 && len(ks) > mp {
			var desc []string
			for kid, labels := range ks {
				desc = append(desc, short(kid)+": "+strings.Join(labels, ","))
			}
			sort.Strings(desc)
			m.violate("3", "%d keys of %s wait in queue %s, MaxPending %d: %s", len(ks), tq[0], tq[1], mp, strings.Join(desc, "; "))
		}
	}
	for _, e := range m.srvErrors {
		m.violate("5", "the server saw an error of no documented class: %s", e)
	}
	m.srvErrors = nil
	m.mu.Unlock()
	w.checkLocks()
	return l
}

// describeLock tells what the lock of k holds (for a violation's message).
func (w *osWorld) describeLock(k osKey) string {
	key := w.lockKey(k.queue, k.kid)
	ctx := context.Background()
	v, err := w.h.rdb.Get(ctx, key).Result()
	if err != nil {
		return "its lock " + key + " does not exist"
	}
	f := w.h.rdb.HGetAll(ctx, modeKeyOf(key)).Val()
	ttl := w.h.rdb.PTTL(ctx, key).Val()
	fields := make([]string, 0, len(f))
	for n, v := range f {
		fields = append(fields, n+"="+v)
	}
	sort.Strings(fields)
	return fmt.Sprintf("its lock %s: %q, mode record {%s}, TTL %v", key, v, strings.Join(fields, " "), ttl.Round(time.Millisecond))
}

// owedFollowUp returns the follow-up task the lock of k owes ("" for none).
func (w *osWorld) owedFollowUp(k osKey) string {
	ls := w.readLocksAt([]string{w.lockKey(k.queue, k.kid)})
	if len(ls) == 0 {
		return ""
	}
	return ls[0].fields[store.FieldFollow]
}

// osLock is one lock as read for the checks.
type osLock struct {
	key, queue, fp, owner string
	kind                  store.Hold
	fields                map[string]string // its mode record (nil: none, or about another task)
	ttl                   time.Duration
	ownerState            string
}

// cooling reports a lock held past its task on purpose (cooling, failed).
func (l osLock) cooling() bool {
	s := l.ownerState
	return l.kind == store.HoldCooling || ((s == store.StateArchived || s == "" || s == store.StateActive) && l.fields[store.FieldError] != "")
}

// readLocks reads every lock of the run's prefix with its TTL and its
// owner's asynq state.
func (w *osWorld) readLocks() []osLock {
	keys := w.h.locks()
	sort.Strings(keys)
	return w.readLocksAt(keys)
}

// readLocksAt reads the locks at keys.
func (w *osWorld) readLocksAt(keys []string) []osLock {
	ls, err := store.ReadLocks(context.Background(), w.h.rdb, store.NewKeys(w.h.prefix), keys)
	if err != nil {
		w.fail("read locks: " + err.Error())
	}
	out := make([]osLock, 0, len(ls))
	for _, l := range ls {
		st := l.TaskState
		if st == "missing" {
			st = ""
		}
		out = append(out, osLock{key: l.Key, queue: l.Queue, fp: l.FP, owner: l.Owner, kind: l.Kind, fields: l.Fields, ttl: l.TTL, ownerState: st})
	}
	return out
}

// checkLocks checks invariant 4's bound on a lock's lifetime, and notes
// the locks whose owner is gone, for the orphan probe.
func (w *osWorld) checkLocks() {
	locks := w.readLocks()
	now := time.Now()
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	w.orphans, w.locks = w.orphans[:0], locks
	for _, l := range locks {
		cdLeft := time.Duration(0)
		if cd := l.fields[store.FieldCoolEnd]; cd != "" {
			var ms int64
			fmt.Sscan(cd, &ms)
			cdLeft = time.UnixMilli(ms).Sub(now)
		}
		bound := max(w.maxWaitTTL(), w.retryHold(), cdLeft)
		phase := "waiting, running or held"
		switch {
		case l.ttl < 0:
			m.violate("4", "lock %s (owner %s, %s) has no expiry (PTTL %v)", l.key, l.owner, phase, l.ttl)
		case l.ttl > bound+1500*time.Millisecond:
			m.violate("4", "lock %s (owner %s, %s) lives %v more, over its documented bound %v", l.key, l.owner, phase, l.ttl.Round(time.Millisecond), bound)
		}
		if goneState(l.ownerState) && !l.cooling() {
			w.orphans = append(w.orphans, l)
		}
	}
}

func (w *osWorld) maxWaitTTL() time.Duration {
	d := max(osTTL, osCallTTLMax)
	for _, r := range w.rules {
		d = max(d, r.TTL)
	}
	return d + osDelayMax
}

func (w *osWorld) retryHold() time.Duration {
	d := osTTL
	for _, r := range w.rules {
		d = max(d, r.TTL)
	}
	return osDedupRetry + d
}

// checkEnd checks, once the run's work has drained, that the newest
// payload accepted for each key ran last (invariant 2) and that every
// merge unit still owed ran exactly once (invariant 6).
func (w *osWorld) checkEnd() {
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	keys := make([]osKey, 0, len(m.keys))
	for k := range m.keys {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	for _, k := range keys {
		ki := m.keys[k]
		n := ki.newest
		if n == nil || ki.allow {
			continue
		}
		c := n.carrier
		if c == nil || c.removed != "" || c.wasRelease {
			continue // the operator deleted, archived or released the task that carried it
		}
		r := ki.lastRun
		switch {
		case r == nil:
			m.violate("2", "key %s: the newest accepted payload s=%d (enqueue #%d, in %s) never ran", k, n.seq, n.n, c.label)
		case r.p.S == n.seq:
		case m.carrier[r.p.S] != nil && (m.carrier[r.p.S].origin == osLockless || m.carrier[r.p.S].wasRelease) && m.carrier[r.p.S].lastArrive > n.start:
			// a payload enqueued without the library (or whose lock the
			// operator released) that arrived at the middleware after it
		case slices.ContainsFunc(m.decisions, func(d osDecision) bool {
			return d.Event == eventNames[evBusy] && !d.Dropped && w.rules[d.Type].OnBusy == BusyFold && d.TaskID == r.task.id && d.Queue == r.queue && d.ev > n.start
		}):
			// a busy arrival (BusyFold) folded into the task after it: the
			// library takes the arrival for the newer payload
		case r.task.guarded:
			// a relocated task a worker took first was accepted under the
			// key of the queue its call named: meeting this key busy, it
			// is retried and runs after the holder, whatever was folded
			// into the holder meanwhile (docs/lifecycle.md: no order holds
			// between payloads accepted under two keys)
		default:
			m.violate("2", "key %s: the last run %s carried s=%d, but the newest payload accepted for it is s=%d (enqueue #%d, in %s)", k, r.label, r.p.S, n.seq, n.n, c.label)
		}
	}
	units := make([]int, 0, len(m.units))
	for u := range m.units {
		units = append(units, u)
	}
	sort.Ints(units)
	for _, u := range units {
		t := m.units[u]
		if t == nil || !m.mergeUnits[u] {
			continue // replaced, or not a merge's
		}
		if _, ok := m.unitExempt[u]; ok {
			continue
		}
		if slices.ContainsFunc(m.unitTasks[u], func(t *osTask) bool { return t.removed != "" || t.failed || t.wasRelease }) {
			continue // a task that carried it was deleted, archived, released or failed for good
		}
		if m.unitRuns[u] != 1 {
			m.violate("6", "merge unit %d (accepted into %s, %s) ran successfully %d times, want once", u, t.label, t.id, m.unitRuns[u])
		}
	}
}

// isDocumented reports whether a Submit error is of a documented class
// (invariant 5); the caller's own context's end (ctxDone) is one.
func isDocumented(err error, ctxDone bool) bool {
	var dup *DuplicateTaskError
	return errors.As(err, &dup) || (ctxDone && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled))) || errors.Is(err, ErrTooManyPending) || errors.Is(err, ErrInvalidOption) ||
		errors.Is(err, ErrInvalidPayload) || errors.Is(err, asynq.ErrTaskIDConflict)
}

// serverError is asynq's ErrorHandler: errors the middleware returns
// must be the handler's own, a busy task's, or asynq's for an attempt it
// gave up (invariant 5).
func (w *osWorld) serverError(ctx context.Context, t *asynq.Task, err error) {
	switch {
	case errors.Is(err, errOptionSpace), errors.Is(err, asynq.SkipRetry), errors.Is(err, asynq.RevokeTask), errors.Is(err, ErrKeyBusy),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), errors.Is(err, asynq.ErrLeaseExpired),
		strings.HasPrefix(err.Error(), "panic"):
		return
	}
	id, _ := asynq.GetTaskID(ctx)
	w.m.mu.Lock()
	w.m.srvErrors = append(w.m.srvErrors, fmt.Sprintf("task %s (%s): %v", id, t.Type(), err))
	w.m.mu.Unlock()
}

// report is the failure message: the seed, the configuration and the
// steps so far, in words.
func (w *osWorld) report(why string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "TestOptionSpace failed: %s\n\n", why)
	fmt.Fprintf(&b, "reproduce: go test -race -run 'TestOptionSpace$' -optionspace.seed=%d -optionspace.runs=1 -optionspace.steps=%d .\n", w.seed, w.steps)
	fmt.Fprintf(&b, "(asynq's clocks are real: a replay draws the same configuration and operations, but tasks may come due at other steps)\n\n")
	fmt.Fprintf(&b, "configuration (seed %d):\n%s\n", w.seed, w.cfgDesc)
	w.m.mu.Lock()
	defer w.m.mu.Unlock()
	fmt.Fprintf(&b, "steps:\n")
	for _, l := range w.m.log {
		b.WriteString(l)
		b.WriteByte('\n')
	}
	if len(w.m.violations) > 0 {
		fmt.Fprintf(&b, "\nviolations:\n")
		for _, v := range w.m.violations {
			fmt.Fprintf(&b, "- %s\n", v)
		}
	}
	return b.String()
}
