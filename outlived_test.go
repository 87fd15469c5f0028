package dedup

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// gatesByRetry is a handler that sends each run's retry count on runs and
// blocks the runs of each retry count until open(n), ignoring its context.
type gatesByRetry struct {
	mu    sync.Mutex
	gates map[int]chan struct{}
	runs  chan int
}

func newGatesByRetry(t *testing.T) *gatesByRetry {
	g := &gatesByRetry{gates: map[int]chan struct{}{}, runs: make(chan int, 16)}
	t.Cleanup(g.openAll)
	return g
}

func (g *gatesByRetry) gate(n int) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, ok := g.gates[n]
	if !ok {
		c = make(chan struct{})
		g.gates[n] = c
	}
	return c
}

func (g *gatesByRetry) open(n int) {
	c := g.gate(n)
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

func (g *gatesByRetry) openAll() {
	g.mu.Lock()
	ns := make([]int, 0, len(g.gates))
	for n := range g.gates {
		ns = append(ns, n)
	}
	g.mu.Unlock()
	for _, n := range ns {
		g.open(n)
	}
}

func (g *gatesByRetry) handler() asynq.HandlerFunc {
	return func(ctx context.Context, _ *asynq.Task) error {
		n, _ := asynq.GetRetryCount(ctx)
		g.runs <- n
		<-g.gate(n) // ignores its context
		return nil
	}
}

// Two given-up handlers of one task (the same ID). The first attempt
// is given up (Timeout) and its handler keeps running; an operator frees the
// key and runs the retry by hand; that attempt, the last, is given up too
// (asynq archives the task) and its handler keeps running. Then the first
// handler returns. The second handler still runs, so the key must not heal:
// the key's next enqueue must not create a task beside it.
func TestSecondGivenUpHandlerOfOneTaskKeepsTheKeyWhenTheFirstReturns(t *testing.T) {
	t.Parallel()
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		g := newGatesByRetry(t)
		h.serve(g.handler(), retryInAnHour)
		task := counterTask("k", 1, 1)
		a := h.enqueue(task, asynq.Timeout(time.Second), asynq.MaxRetry(1))
		if n := waitFor(t, g.runs, "attempt 0 runs"); n != 0 {
			t.Fatalf("ran retry %d", n)
		}
		mode := store.ModeOf(h.keyOf(task, h.queue))
		note := func() error { return h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() }
		eventually(t, "attempt 0 given up (retry waits) and noted", func() bool {
			return h.taskState(a.ID) == asynq.TaskStateRetry && note() == nil
		})
		if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("forced release: %v %v", ok, err)
		}
		if err := h.insp.RunTask(h.queue, a.ID); err != nil {
			t.Fatal(err)
		}
		if n := waitFor(t, g.runs, "attempt 1 runs (the operator freed the key)"); n != 1 {
			t.Fatalf("ran retry %d", n)
		}
		eventually(t, "attempt 1 given up on its last retry: archived", func() bool {
			return h.taskState(a.ID) == asynq.TaskStateArchived
		})
		processed := h.d.Stats().Processed
		g.open(0) // the first handler returns; the second still runs
		eventually(t, "the first handler settled", func() bool { return h.d.Stats().Processed > processed })
		eventually(t, "the settle is written", func() bool { return errors.Is(note(), redis.Nil) || note() == nil })
		t.Logf("note after the first handler's return: %v", note())
		res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
		if err == nil {
			t.Errorf("enqueue while attempt 1's given-up handler still runs: %+v, want a duplicate", res)
		}
		if n, ok := startedWithinASecond(g.runs); ok {
			t.Errorf("a run (retry %d) started beside the still-running given-up handler of attempt 1", n)
		}
	})
}

// gatesBySeqHandler is a handler that sends each run's counter seq on runs
// and blocks the runs of each seq until open(seq), ignoring its context.
func gatesBySeqHandler(g *gatesByRetry) asynq.HandlerFunc {
	return func(ctx context.Context, task *asynq.Task) error {
		seq := decodeCounter(task).Seq
		g.runs <- seq
		<-g.gate(seq) // ignores its context
		return nil
	}
}

// gatedSeqsHandler is gatesBySeqHandler for the seqs gated beforehand
// (g.gate): the runs of the others return at once.
func gatedSeqsHandler(g *gatesByRetry) asynq.HandlerFunc {
	return func(ctx context.Context, task *asynq.Task) error {
		seq := decodeCounter(task).Seq
		g.runs <- seq
		g.mu.Lock()
		c := g.gates[seq]
		g.mu.Unlock()
		if c != nil {
			<-c // ignores its context
		}
		return nil
	}
}

// A rule with no mode terms (Rule{}): task A's attempt is given up
// and noted (the key's mode record is created by the note, naming A); an
// operator frees the key; A's handler returns (its note goes, the record
// stays, naming A); then a new task B takes the free key, is given up on its
// last retry (archived) while its handler keeps running. B's handler runs,
// so the key must not heal under it.
func TestGivenUpHandlerOfANewHolderIsNotedAfterAnEarlierTasksNote(t *testing.T) {
	t.Parallel()
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		g := newGatesByRetry(t)
		h.serve(gatesBySeqHandler(g), retryInAnHour)
		ta := counterTask("k", 1, 1)
		a := h.enqueue(ta, asynq.Timeout(time.Second), asynq.MaxRetry(1))
		if s := waitFor(t, g.runs, "A runs"); s != 1 {
			t.Fatalf("ran seq %d", s)
		}
		mode := store.ModeOf(h.keyOf(ta, h.queue))
		note := func() error { return h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() }
		eventually(t, "A given up (retry waits) and noted", func() bool {
			return h.taskState(a.ID) == asynq.TaskStateRetry && note() == nil
		})
		if ok, err := h.d.Release(ctx, ta, "", asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("forced release: %v %v", ok, err)
		}
		processed := h.d.Stats().Processed
		g.open(1)
		eventually(t, "A's handler returned and settled", func() bool {
			return h.d.Stats().Processed > processed && errors.Is(note(), redis.Nil)
		})
		t.Logf("mode record after A's end: %v", h.rdb.HGetAll(ctx, mode).Val())
		b := h.enqueue(counterTask("k", 1, 2), asynq.Timeout(time.Second), asynq.MaxRetry(0))
		if s := waitFor(t, g.runs, "B runs"); s != 2 {
			t.Fatalf("ran seq %d", s)
		}
		eventually(t, "B given up on its last retry (archived) and noted", func() bool { // (the note is written on its own goroutine, after asynq's move)
			return h.taskState(b.ID) == asynq.TaskStateArchived && h.rdb.HGet(ctx, mode, store.FieldNoteBy).Val() != "" && note() == nil &&
				h.rdb.HGet(ctx, mode, "id").Val() == b.ID
		})
		t.Logf("mode record while B's given-up handler runs: %v", h.rdb.HGetAll(ctx, mode).Val())
		res, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
		if err == nil {
			t.Errorf("enqueue while B's given-up handler still runs: %+v, want a duplicate of %s", res, b.ID)
		}
		if s, ok := startedWithinASecond(g.runs); ok {
			t.Errorf("seq %d started beside B's still-running given-up handler", s)
		}
	})
}

// A follow-up the key owes (RunningDefer) stays owed when a task
// that arrived without a lock (asynq's own client) takes the key its
// deleted holder freed; that arrival is then given up on its last retry
// (archived) while its handler keeps running. The follow-up must not run
// beside that handler; an update meanwhile folds into it; it runs once,
// after the arrival's handler returns, with the newest payload; then the key
// heals.
func TestOwedFollowUpWaitsForAGivenUpArrivalThatTookTheKey(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	g := newGatesByRetry(t)
	g.gate(1)
	g.gate(3)
	ends := make(chan int, 16)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		seq := decodeCounter(task).Seq
		g.runs <- seq
		g.mu.Lock()
		c := g.gates[seq]
		g.mu.Unlock()
		if c != nil {
			<-c // ignores its context
		}
		ends <- seq
		return nil
	}, retryInAnHour)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
	if s := waitFor(t, g.runs, "the holder runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	givenUpAndNoted(t, h, a.ID, counterTask("k", 1, 1))
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update: %+v %v, want a follow-up", f, err)
	}
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	x, err := h.asynq.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue), asynq.Timeout(time.Second), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	if s := waitFor(t, g.runs, "the arrival runs"); s != 3 {
		t.Fatalf("ran seq %d, want the arrival", s)
	}
	mode := store.ModeOf(h.keyOf(counterTask("k", 1, 3), h.queue))
	eventually(t, "the arrival given up on its last retry (archived) and noted", func() bool {
		return h.taskState(x.ID) == asynq.TaskStateArchived && h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() == nil
	})
	u, err := h.client.Submit(ctx, counterTask("k", 1, 4), asynq.Queue(h.queue))
	if err != nil || u.TaskID != f.TaskID {
		t.Fatalf("update while the arrival's given-up handler runs: %+v %v, want folded into %s", u, err, f.TaskID)
	}
	if s, ok := startedWithinASecond(g.runs); ok {
		t.Fatalf("seq %d started while the arrival's given-up handler runs", s)
	}
	g.open(3)
	if s := waitFor(t, g.runs, "the follow-up runs after the arrival"); s != 4 {
		t.Fatalf("ran seq %d, want the follow-up with the newest payload (4)", s)
	}
	g.open(1)
	eventually(t, "the follow-up completes", func() bool {
		st := h.taskState(f.TaskID)
		return st == 0 || st == asynq.TaskStateCompleted
	})
	if s, ok := startedWithinASecond(g.runs); ok {
		t.Fatalf("seq %d ran again", s)
	}
	eventually(t, "the key heals", func() bool {
		r, err := h.client.Submit(ctx, counterTask("k", 1, 5), asynq.Queue(h.queue))
		return err == nil && r.Outcome == Created
	})
	if s := waitFor(t, g.runs, "the next task runs"); s != 5 {
		t.Fatalf("ran seq %d", s)
	}
}

// RunningDefer. The holder A (MaxRetry 0) is given up (archived) and
// its handler keeps running; an update becomes its follow-up F (a copy of
// A's record: the same Timeout and MaxRetry). An operator releases the key
// (owner-checked, naming A): F is queued at once and runs (the operator freed
// the key). F is given up in turn, on its last retry (archived), its handler
// running. The key must not heal under F's handler.
func TestFollowUpQueuedByReleaseIsNotedWhenGivenUp(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	g := newGatesByRetry(t)
	h.serve(gatesBySeqHandler(g), retryInAnHour)
	ta := counterTask("k", 1, 1)
	a := h.enqueue(ta, asynq.Timeout(time.Second), asynq.MaxRetry(0))
	if s := waitFor(t, g.runs, "A runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	mode := store.ModeOf(h.keyOf(ta, h.queue))
	eventually(t, "A given up (archived) and noted", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() == nil
	})
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update: %+v %v, want a follow-up", f, err)
	}
	if ok, err := h.d.Release(ctx, ta, a.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("release naming A: %v %v", ok, err)
	}
	if s := waitFor(t, g.runs, "F runs"); s != 2 {
		t.Fatalf("ran seq %d", s)
	}
	eventually(t, "F given up on its last retry (archived)", func() bool {
		return h.taskState(f.TaskID) == asynq.TaskStateArchived
	})
	t.Logf("A=%s F=%s; mode record while F's given-up handler runs: %v", a.ID, f.TaskID, h.rdb.HGetAll(ctx, mode).Val())
	res, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil {
		t.Logf("update while F's given-up handler runs: %v", err)
	} else if res.Outcome == Created {
		t.Errorf("update while F's given-up handler runs: %+v, want it deferred or refused (the key healed under F)", res)
	}
	if s, ok := startedWithinASecond(g.runs); ok {
		t.Errorf("seq %d started beside F's still-running given-up handler", s)
	}
}

// dedupctl returns a function that runs dedupctl, built for the test,
// against h's Redis and prefix, as an operator would.
func dedupctl(t *testing.T, h *harness) func(args ...string) string {
	t.Helper()
	bin := t.TempDir() + "/dedupctl"
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/dedupctl").CombinedOutput(); err != nil {
		t.Fatalf("build dedupctl: %v\n%s", err, out)
	}
	c, ok := h.rdb.(*redis.Client)
	if !ok {
		t.Fatalf("dedupctl needs a single Redis, not a %T", h.rdb)
	}
	url := "redis://" + c.Options().Addr + "/" + strconv.Itoa(c.Options().DB)
	return func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, append([]string{"--url", url, "--prefix", h.prefix}, args...)...).CombinedOutput()
		t.Logf("dedupctl %s: %v\n%s", strings.Join(args, " "), err, out)
		return string(out)
	}
}

// dedupctl doctor --fix while given-up handlers run. (1) The holder
// A (MaxRetry 0) is given up, archived, its handler running: doctor must
// keep its lock. (2) An operator releases A's key, which owes a follow-up F
// (RunningDefer); F runs and is given up on its last retry (archived), its
// handler running: doctor must keep F's lock too.
func TestDoctorFixKeepsTheLocksOfGivenUpHandlersThatRun(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	operator := dedupctl(t, h)
	g := newGatesByRetry(t)
	h.serve(gatesBySeqHandler(g), retryInAnHour)
	ta := counterTask("k", 1, 1)
	key := h.keyOf(ta, h.queue)
	a := h.enqueue(ta, asynq.Timeout(time.Second), asynq.MaxRetry(0))
	if s := waitFor(t, g.runs, "A runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	mode := store.ModeOf(key)
	eventually(t, "A given up (archived) and noted", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() == nil
	})
	operator("doctor", "--fix", "--grace", "0")
	if o := h.lockOwner(key); o != a.ID {
		t.Fatalf("after doctor --fix while A's given-up handler runs: lock holder %q, want %s", o, a.ID)
	}
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update: %+v %v, want a follow-up", f, err)
	}
	if ok, err := h.d.Release(ctx, ta, a.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("release naming A: %v %v", ok, err)
	}
	if s := waitFor(t, g.runs, "F runs"); s != 2 {
		t.Fatalf("ran seq %d", s)
	}
	eventually(t, "F given up on its last retry (archived)", func() bool {
		return h.taskState(f.TaskID) == asynq.TaskStateArchived && h.lockOwner(key) == f.TaskID
	})
	operator("doctor", "--fix", "--grace", "0")
	if o := h.lockOwner(key); o != f.TaskID {
		t.Errorf("after doctor --fix while F's given-up handler runs: lock holder %q, want %s", o, f.TaskID)
	}
}

// Inspector operations on the task of a given-up handler that still
// runs: its waiting retry is archived by hand (the key must not heal: the
// handler runs), then run by hand (it must not run beside the handler: no
// operator freed the key). Once the handler returns, running the task by
// hand runs it, once.
func TestArchiveAndRunByHandOfAGivenUpHandlersTask(t *testing.T) {
	t.Parallel()
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		g := newGatesByRetry(t)
		h.serve(g.handler(), retryInAnHour)
		task := counterTask("k", 1, 1)
		a := h.enqueue(task, asynq.Timeout(time.Second), asynq.MaxRetry(5))
		if n := waitFor(t, g.runs, "attempt 0 runs"); n != 0 {
			t.Fatalf("ran retry %d", n)
		}
		mode := store.ModeOf(h.keyOf(task, h.queue))
		eventually(t, "attempt 0 given up (retry waits) and noted", func() bool {
			return h.taskState(a.ID) == asynq.TaskStateRetry && h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() == nil
		})
		if err := h.insp.ArchiveTask(h.queue, a.ID); err != nil {
			t.Fatal(err)
		}
		if res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue)); err == nil {
			t.Errorf("enqueue after archiving the task whose given-up handler runs: %+v, want a duplicate", res)
		}
		busy := h.d.Stats().Busy
		if err := h.insp.RunTask(h.queue, a.ID); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the run by hand meets its key busy", func() bool { return h.d.Stats().Busy > busy })
		select {
		case n := <-g.runs:
			t.Fatalf("a run (retry %d) started beside the given-up handler", n)
		case <-time.After(500 * time.Millisecond):
		}
		processed := h.d.Stats().Processed
		g.open(0)
		eventually(t, "attempt 0's handler settled", func() bool { return h.d.Stats().Processed > processed })
		st := h.taskState(a.ID)
		t.Logf("task state after the handler returned: %v", st)
		if st == asynq.TaskStateRetry || st == asynq.TaskStateArchived {
			if err := h.insp.RunTask(h.queue, a.ID); err != nil {
				t.Fatal(err)
			}
		}
		n := waitFor(t, g.runs, "the task runs once its handler returned")
		g.open(n)
		if m, ok := startedWithinASecond(g.runs); ok {
			t.Errorf("ran again (retry %d)", m)
		}
	})
}

// Shutdown requeues. Server 1's handler of A outlives its shutdown
// (A is put back, its key noted); an operator frees the key; server 2 runs A
// (allowed: the key was freed) and its handler outlives server 2's shutdown
// too (A put back again, noted again, the same task ID). Then server 1's
// handler returns. Server 2's handler still runs: A must not run again beside
// it on server 3 (no operator freed the key since), and the key must not
// take a new task.
func TestShutdownRequeueTwiceFirstLeftoverReturningDoesNotFreeTheSecond(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{}))
	ctx := context.Background()
	starts := make(chan int, 8)
	gates := []chan struct{}{make(chan struct{}), make(chan struct{}), make(chan struct{})}
	t.Cleanup(func() {
		for _, g := range gates {
			select {
			case <-g:
			default:
				close(g)
			}
		}
	})
	server := func(i int) func() {
		_, stop := serveRaw(t, h.rdb, h.queue, h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			starts <- i
			<-gates[i] // ignores its context
			return nil
		})), func(c *asynq.Config) { c.Concurrency = 1; c.ShutdownTimeout = 300 * time.Millisecond })
		return stop
	}
	task := counterTask("k", 1, 1)
	mode := store.ModeOf(h.keyOf(task, h.queue))
	note := func() bool { return h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() == nil }
	a := h.enqueue(task)
	stop1 := server(0)
	if s := waitFor(t, starts, "A runs on server 1"); s != 0 {
		t.Fatalf("server %d", s)
	}
	stop1()
	eventually(t, "A put back and noted", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending && note() })
	if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	stop2 := server(1)
	if s := waitFor(t, starts, "A runs on server 2 (the key was freed)"); s != 1 {
		t.Fatalf("server %d", s)
	}
	stop2()
	eventually(t, "A put back again and noted", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending && note() })
	processed := h.d.Stats().Processed
	close(gates[0]) // server 1's leftover returns; server 2's still runs
	eventually(t, "server 1's leftover settled", func() bool { return h.d.Stats().Processed > processed })
	t.Logf("note after server 1's leftover returned: %v; lock %q", note(), h.lockOwner(h.keyOf(task, h.queue)))
	busy := h.d.Stats().Busy
	server(2)
	select {
	case s := <-starts:
		t.Errorf("A ran on server %d beside server 2's still-running handler", s+1)
	case <-time.After(2 * time.Second):
		t.Logf("server 3 met A's key busy: %v", h.d.Stats().Busy > busy)
	}
}

// MaxPending 1 with an owed follow-up that stays owed when an
// arrival (asynq's own client) takes the key its deleted holder freed: the
// follow-up counts as the one waiting key until it starts (another key is
// refused), and its slot is free once it ran (another key is created).
func TestMaxPendingCountsTheOwedFollowUpKeptByAnArrival(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 1}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	g := newGatesByRetry(t)
	g.gate(1)
	g.gate(3)
	h.serve(gatedSeqsHandler(g), retryInAnHour)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
	if s := waitFor(t, g.runs, "the holder runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	givenUpAndNoted(t, h, a.ID, counterTask("k", 1, 1))
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update: %+v %v, want a follow-up", f, err)
	}
	other := func() error {
		_, err := h.client.Submit(ctx, counterTask("k2", 1, 9), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
		return err
	}
	if err := other(); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("another key while the follow-up waits: %v, want ErrTooManyPending", err)
	}
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.asynq.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if s := waitFor(t, g.runs, "the arrival runs"); s != 3 {
		t.Fatalf("ran seq %d, want the arrival", s)
	}
	if err := other(); !errors.Is(err, ErrTooManyPending) {
		t.Errorf("another key while the arrival runs and the follow-up waits: %v, want ErrTooManyPending", err)
	}
	g.open(3)
	if s := waitFor(t, g.runs, "the follow-up runs"); s != 2 {
		t.Fatalf("ran seq %d, want the follow-up (2)", s)
	}
	eventually(t, "the follow-up's slot is free", func() bool { return other() == nil })
	if s, ok := startedWithinASecond(g.runs); ok {
		t.Errorf("seq %d ran", s)
	}
}

// RunningDefer. The holder's attempt is given up (its retry waits)
// while its handler runs; an update becomes its follow-up F; an operator
// deletes the waiting retry (asynq's delete frees the key) while the handler
// still runs; then the handler returns. No task took the key: F, which
// carries the newest payload and is owed by the key, should run once the
// handler has returned (not only when its parking time, the key's TTL,
// ends).
func TestOwedFollowUpRunsAfterTheGivenUpHandlerOfADeletedHolderReturns(t *testing.T) {
	t.Parallel()
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.heartbeat = 200 * time.Millisecond
	h := newHarness(t, cfg)
	h.client = h.d.NewClient()
	ctx := context.Background()
	g := newGatesByRetry(t)
	g.gate(1)
	h.serve(gatedSeqsHandler(g), retryInAnHour)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
	if s := waitFor(t, g.runs, "the holder runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	givenUpAndNoted(t, h, a.ID, counterTask("k", 1, 1))
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update: %+v %v, want a follow-up", f, err)
	}
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	if s, ok := startedWithinASecond(g.runs); ok {
		t.Fatalf("seq %d ran while the given-up handler runs", s)
	}
	g.open(1)
	select {
	case s := <-g.runs:
		if s != 2 {
			t.Fatalf("ran seq %d, want the follow-up", s)
		}
	case <-time.After(20 * time.Second):
		ti, _ := h.insp.GetTaskInfo(h.queue, f.TaskID)
		var due time.Time
		if ti != nil {
			due = ti.NextProcessAt
		}
		t.Errorf("the follow-up %s has not run 20 s after the given-up handler returned (state %s, due in %v)",
			f.TaskID, taskStateName(h, f.TaskID), time.Until(due).Round(time.Second))
	}
}

// givenUpAndNoted waits until asynq gave the holder id of task's key up (its
// retry waits) and the middleware noted its handler still runs in the key's
// mode record (on its own goroutine, after asynq's move): an update before
// the note would fold into the waiting retry.
func givenUpAndNoted(t *testing.T, h *harness, id string, task *asynq.Task) {
	t.Helper()
	mode := modeKeyOf(h.keyOf(task, h.queue))
	eventually(t, "the holder given up (its retry waits) and noted", func() bool {
		return h.taskState(id) == asynq.TaskStateRetry && h.rdb.HGet(context.Background(), mode, store.FieldOutlived).Err() == nil
	})
}

// startedWithinASecond returns the seq of a run that starts on runs within a
// second: a check that nothing starts, where nothing signals that it will
// not.
func startedWithinASecond(runs <-chan int) (int, bool) {
	select {
	case s := <-runs:
		return s, true
	case <-time.After(time.Second):
		return 0, false
	}
}

// The holder is given up at its Timeout on its last attempt (asynq archives
// it) while its handler runs on, and owes a follow-up. When the handler
// returns, the follow-up takes the key for the key's whole lifetime: until
// it runs, an enqueue of the key folds into it or is refused, and no task
// is created beside it (a caller-chosen ID included). (It went with a lock
// of a millisecond.)
func TestFollowUpQueuedWhenAGivenUpLastAttemptReturnsHoldsTheKeyUntilItRuns(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	direct := h.d.NewClient()
	ctx := context.Background()
	g := newGatesByRetry(t)
	g.gate(1)
	h.serve(gatedSeqsHandler(g), nil)
	a, err := direct.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.Timeout(time.Second), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	if s := waitFor(t, g.runs, "the holder runs"); s != 1 {
		t.Fatalf("ran seq %d", s)
	}
	f, err := direct.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the holder runs: %+v %v, want a follow-up", f, err)
	}
	lock := h.keyOf(counterTask("k", 1, 1), h.queue)
	eventually(t, "the holder archived and its handler noted", func() bool {
		return h.taskState(a.TaskID) == asynq.TaskStateArchived && h.rdb.HGet(ctx, modeKeyOf(lock), store.FieldOutlived).Err() == nil
	})
	if err := h.insp.PauseQueue(h.queue); err != nil { // the follow-up, once queued, waits
		t.Fatal(err)
	}
	g.open(1)
	eventually(t, "the follow-up queued", func() bool { return h.taskState(f.TaskID) == asynq.TaskStatePending })
	if owner, left := h.lockOwner(lock), h.rdb.PTTL(ctx, lock).Val(); owner != f.TaskID || left < time.Minute {
		t.Fatalf("the key is held by %q for %v, want the follow-up %s for its key's lifetime", owner, left, f.TaskID)
	}
	dup, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue), asynq.TaskID("caller-3"), OnConflict(Reject))
	if err == nil || dup.Outcome == Created {
		t.Fatalf("an enqueue beside the follow-up %s: %+v %v", f.TaskID, dup, err)
	}
}

// extended signals each library extend call that carried no note (the
// heartbeat's extension of a handler that runs long), once answered.
type plainExtends struct{ each chan struct{} }

func (e *plainExtends) DialHook(next redis.DialHook) redis.DialHook { return next }
func (e *plainExtends) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if a := cmd.Args(); err == nil && isScript(cmd, "extend") && len(a) >= 11 && a[10] == "" {
			select {
			case e.each <- struct{}{}:
			default:
			}
		}
		return err
	}
}
func (e *plainExtends) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// The heartbeat's extension of a handler that merely runs long, far from
// its deadline, is no note that asynq gave the attempt up: the key's mode
// record gets no note (o), and the task's record is not marked outlived
// (dedup-lost), which tells a run of it that asynq put back that a handler
// may still run.
func TestHeartbeatOfALongHandlerWritesNoOutlivedNote(t *testing.T) {
	t.Parallel()
	rdb := newRDB(t)
	ext := &plainExtends{each: make(chan struct{}, 1)}
	rdb.AddHook(ext)
	h := newHarnessOn(t, rdb, jobRulesQuickHeartbeat(Rule{}))
	h.client = h.d.NewClient()
	checked := make(chan struct{})
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		<-checked
		return nil
	}, nil)
	info := h.enqueue(jobTask("hb", 1), asynq.Timeout(time.Hour))
	waitFor(t, ext.each, "the heartbeat extends the long handler's key")
	lock := h.keyOf(jobTask("hb", 1), h.queue)
	m, err := h.rdb.HGetAll(context.Background(), store.ModeOf(lock)).Result()
	if err != nil {
		t.Fatal(err)
	}
	ti, terr := h.insp.GetTaskInfo(h.queue, info.ID)
	close(checked)
	if _, ok := m["o"]; ok {
		t.Errorf("the heartbeat's extension wrote a note that asynq gave the attempt up: mode record %v", m)
	}
	if terr != nil {
		t.Fatal(terr)
	}
	if v, ok := ti.Headers[store.HeaderLost]; ok {
		t.Errorf("the heartbeat's extension marked the running task %s %q", store.HeaderLost, v)
	}
}

// A Replace holder noted before its deadline fails there with retries
// left: while its handler ran the key's update was refused (a running
// holder takes no fold), and once it returned (the note gone with it) an
// update folds into the waiting retry, which runs with the new payload.
func TestReplaceFoldsIntoTheRetryOfAFailureAfterTheDeadlineNote(t *testing.T) {
	t.Parallel()
	h, n := noteHarness(t, Rule{OnConflict: Replace})
	runs := make(chan int, 8)
	fail, failed := make(chan struct{}), make(chan struct{})
	h.serve(func(ctx context.Context, t *asynq.Task) error {
		runs <- decodeJob(t).N
		if retry, _ := asynq.GetRetryCount(ctx); retry > 0 {
			return nil
		}
		if err := n.wait(ctx); err != nil {
			return err
		}
		<-fail
		defer close(failed)
		return errors.New("boom")
	}, func(c *asynq.Config) {
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return 3 * time.Second }
	})
	info := h.enqueue(jobTask("p", 1), asynq.MaxRetry(1), asynq.Timeout(3*time.Second))
	waitFor(t, runs, "the holder runs")
	eventually(t, "the holder's attempt is noted", func() bool { return h.modeFields(h.keyOf(jobTask("p", 1), h.queue))["o"] != "" })
	_, err := h.client.Enqueue(jobTask("p", 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("update while the noted holder runs: %v, want a duplicate of %s", err, info.ID)
	}
	close(fail)
	<-failed
	eventually(t, "asynq makes it a retry", func() bool { return h.taskState(info.ID) == asynq.TaskStateRetry })
	res, err := h.client.Submit(context.Background(), jobTask("p", 3), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Replaced || res.TaskID != info.ID {
		t.Fatalf("update of the waiting retry: %+v %v, want replaced into %s", res, err, info.ID)
	}
	if got := waitFor(t, runs, "the retry runs"); got != 3 {
		t.Fatalf("the retry ran payload %d, want 3", got)
	}
}

// A task with no retries (its first attempt is its last), of a rule that
// holds nothing after a failure, whose handler ignores its deadline: asynq
// archives it at the deadline, writing its record's message anew (the mark
// the note put there goes). Run by hand at once, while that handler still
// runs, it must wait for it, not run beside it (no operator freed the key).
func TestRunningByHandATaskAsynqArchivedAtItsDeadlineWaitsForItsHandler(t *testing.T) {
	t.Parallel()
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{}))
	h.client = h.d.NewClient()
	stuck := make(chan struct{})
	var once sync.Once
	unstick := func() { once.Do(func() { close(stuck) }) }
	defer unstick()
	runs := make(chan int, 8)
	var n atomic.Int32
	h.serve(func(context.Context, *asynq.Task) error {
		i := int(n.Add(1))
		runs <- i
		if i == 1 {
			<-stuck // ignores its deadline
		}
		return nil
	}, nil)
	info := h.enqueue(jobTask("hand", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
	waitFor(t, runs, "the attempt")
	eventually(t, "archived by asynq", func() bool { return h.taskState(info.ID) == asynq.TaskStateArchived })
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	if i, ok := startedWithinASecond(runs); ok {
		t.Fatalf("the run by hand (run %d) started beside the given-up handler", i)
	}
	unstick()
	eventually(t, "the given-up handler settled", func() bool { return h.d.Stats().Processed >= 1 })
	if st := h.taskState(info.ID); st == asynq.TaskStateArchived {
		if err := h.insp.RunTask(h.queue, info.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, runs, "the run by hand once the handler returned")
}
