package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// RunningDefer: once the holder's handler has returned, and before asynq has
// recorded its end (its record still says active), an update is not refused:
// the holder's mode ended with its run, so the key is free for the update,
// which runs after it.
func TestDeferUpdateAfterTheHoldersRunIsNotRefusedBeforeAsynqRecordsItsEnd(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	ended, resume := make(chan string, 1), make(chan struct{})
	ran := make(chan int, 4)
	mw := h.d.Middleware()(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		ran <- decodeCounter(t).Seq
		return nil
	}))
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{
		Concurrency: 1, Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
	})
	first := true
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		if first { // (Concurrency 1: one attempt at a time)
			first = false
			id, _ := asynq.GetTaskID(ctx)
			ended <- id
			<-resume // the middleware returned; asynq has not recorded the end yet
		}
		return err
	})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)

	a := h.enqueue(counterTask("k", 1, 1))
	if id := <-ended; id != a.ID {
		t.Fatalf("ran %s", id)
	}
	if s := h.taskState(a.ID); s != asynq.TaskStateActive {
		t.Fatalf("holder state %v, want active while its end is not recorded", s)
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if errors.As(err, &dup) || err != nil {
		t.Fatalf("update after the holder's run: %v", err)
	}
	close(resume)
	if seq := <-ran; seq != 1 {
		t.Fatalf("first run seq %d", seq)
	}
	if seq := <-ran; seq != 2 {
		t.Fatalf("the update (task %s) ran with seq %d", res.TaskID, seq)
	}
}

// RunningDefer: a holder whose handler succeeded near its deadline leaves its
// lock for asynq's record to answer; should asynq then put the task back (a
// shutdown) before it records the end, the task is not run again (its record
// is marked ended). An update enqueued meanwhile must still run: it may not
// fold into that task, which never runs again.
func TestDeferUpdateAfterANearDeadlineSuccessPutBackByAShutdownIsNotLost(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.LockTimeout = 10 * time.Second // every attempt of a 5 s Timeout ends near its deadline
	h := newHarness(t, cfg)
	h.client = h.d.NewClient()
	ctx := context.Background()
	ended, resume := make(chan string, 1), make(chan struct{})
	mw := h.d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{
		Concurrency: 1, Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure, ShutdownTimeout: 100 * time.Millisecond,
	})
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		id, _ := asynq.GetTaskID(ctx)
		ended <- id
		<-resume // the middleware settled the key; asynq has not recorded the end
		return err
	})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	defer close(resume)

	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(5*time.Second))
	if id := waitFor(t, ended, "the first run"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	srv.Shutdown() // its timeout passes with the attempt unrecorded: asynq puts the task back
	if s := h.taskState(a.ID); s != asynq.TaskStatePending {
		t.Fatalf("holder state %v, want pending (put back by the shutdown)", s)
	}

	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("update: %v", err)
	}
	if res.TaskID == a.ID {
		t.Fatalf("update %v into the holder, which will not run again", res.Outcome)
	}
	ran := make(chan int, 4)
	h.serve(func(_ context.Context, t *asynq.Task) error { ran <- decodeCounter(t).Seq; return nil }, nil)
	if seq := waitFor(t, ran, "the update's run"); seq != 2 {
		t.Fatalf("ran seq %d, want the update (2)", seq)
	}
}

// RunningDefer: a holder whose handler succeeded near its deadline leaves its
// lock for asynq's record; should asynq then take the attempt as given up
// (the deadline passed before it recorded the success) and retry the task,
// the retry still holds its key under RunningDefer: an update while it runs
// is deferred behind it, not refused.
func TestDeferUpdateWhileANearDeadlineSuccessIsRetriedIsDeferred(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.LockTimeout = 10 * time.Second // every attempt of a 1 s Timeout ends near its deadline
	h := newHarness(t, cfg)
	h.client = h.d.NewClient()
	ctx := context.Background()
	started, release := make(chan int, 4), make(chan struct{})
	var attempt atomic.Int32
	mw := h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		started <- decodeCounter(task).Seq
		if n, _ := asynq.GetRetryCount(ctx); n > 0 && decodeCounter(task).Seq == 1 {
			<-release // the retry runs until the test lets it end
		}
		return nil
	}))
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{
		Concurrency: 2, Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	})
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		if attempt.Add(1) == 1 {
			<-ctx.Done() // the success settled; asynq sees the deadline first
		}
		return err
	})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	defer close(release)

	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
	if seq := waitFor(t, started, "the first run"); seq != 1 {
		t.Fatalf("ran seq %d", seq)
	}
	if seq := waitFor(t, started, "the retry"); seq != 1 {
		t.Fatalf("ran seq %d, want the holder's retry", seq)
	}
	if s := h.taskState(a.ID); s != asynq.TaskStateActive {
		t.Fatalf("holder state %v, want active (its retry runs)", s)
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.Timeout(time.Second))
	if err != nil {
		t.Fatalf("update while the holder's retry runs: %v", err)
	}
	if res.Outcome != Deferred {
		t.Fatalf("update: %v into %s, want deferred", res.Outcome, res.TaskID)
	}
}

// A follow-up owed by a holder that arrived without a lock (asynq's own
// client, the execution guard keyed it) is as much the key's as any: run
// early by an operator while the holder runs, it waits for the holder; the
// holder's end hands it the key, and its own end hands the key to the
// follow-up it owes in turn. (Its message names no lock: it once ran
// unchecked, beside the holder.)
func TestDeferFollowUpOfAnArrivalWaitsForItsHolderAndHandsTheKeyOn(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	tr := newKeyTracker(counterKeyOf, 1, 2)
	h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	arrival, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	first := waitFor(t, tr.starts, "the arrival runs")
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the arrival runs: %+v %v, want a follow-up", f, err)
	}
	if err := h.insp.RunTask(h.queue, f.TaskID); err != nil {
		t.Fatal(err)
	}
	tr.noSecondStart(t, h, first, "follow-up "+f.TaskID+" run early while its holder "+arrival.ID+" runs")
	tr.open(1)
	second := waitFor(t, tr.starts, "the follow-up runs after its holder")
	if second.id != f.TaskID {
		t.Fatalf("ran %s after the holder, want the follow-up %s", second.id, f.TaskID)
	}
	g, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || g.Outcome != Deferred {
		t.Fatalf("update while the follow-up runs: %+v %v, want a follow-up of it", g, err)
	}
	tr.open(2)
	if third := waitFor(t, tr.starts, "the follow-up's own follow-up runs"); third.id != g.TaskID {
		t.Fatalf("ran %s after the follow-up, want %s", third.id, g.TaskID)
	}
}

// A holder whose handler asynq gave up (past its Timeout) while the handler
// runs on is running, whatever asynq's record says: an update under
// RunningDefer becomes its follow-up instead of folding into its waiting
// retry, which meets the key busy behind that handler and, on its last
// attempt, is archived with whatever it carries. The newest payload runs,
// after the handler.
func TestDeferUpdateWhileAGivenUpHandlerRunsOnIsAFollowUp(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	started, release := make(chan int, 8), make(chan struct{})
	var first atomic.Bool
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		started <- decodeCounter(task).Seq
		if first.CompareAndSwap(false, true) {
			<-release // ignores its context: outlives its Timeout
		}
		return nil
	}, func(c *asynq.Config) {
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond }
	})
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(1))
	if seq := waitFor(t, started, "the first run"); seq != 1 {
		t.Fatalf("ran seq %d", seq)
	}
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	eventually(t, "asynq gives the attempt up, the handler runs on", func() bool {
		return h.rdb.HExists(context.Background(), modeKeyOf(key), store.FieldOutlived).Val()
	})
	res, err := h.client.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while the given-up handler runs: %v %+v, want deferred behind %s", err, res, a.ID)
	}
	close(release)
	for seq := 0; seq != 2; {
		seq = waitFor(t, started, "the update's run")
	}
}

// givenUp is a key "k" whose holder (seq 1, n 1) has a handler asynq gave up
// (Timeout 1 s) and that still runs until release is closed; its retry waits
// retryIn. runs hears every run's payload.
type givenUp struct {
	h       *harness
	holder  *asynq.TaskInfo
	key     string
	runs    chan counterPayload
	release chan struct{}
}

func startGivenUp(t *testing.T, r Rule, direct bool, retryIn time.Duration, opts ...asynq.Option) *givenUp {
	t.Helper()
	h := newHarness(t, counterRules(r))
	if direct {
		h.client = h.d.NewClient()
	}
	g := &givenUp{h: h, runs: make(chan counterPayload, 32), release: make(chan struct{})}
	var first atomic.Bool
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		g.runs <- decodeCounter(task)
		if first.CompareAndSwap(false, true) {
			<-g.release // ignores its context: outlives its Timeout
		}
		return nil
	}, func(c *asynq.Config) {
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return retryIn }
	})
	g.holder = h.enqueue(counterTask("k", 1, 1), append([]asynq.Option{asynq.Timeout(time.Second), asynq.MaxRetry(5)}, opts...)...)
	if p := waitFor(t, g.runs, "the first run"); p.Seq != 1 {
		t.Fatalf("ran seq %d", p.Seq)
	}
	g.key = h.keyOf(counterTask("k", 1, 1), h.queue)
	eventually(t, "asynq gives the attempt up, the handler runs on", func() bool {
		return h.rdb.HExists(context.Background(), modeKeyOf(g.key), store.FieldOutlived).Val()
	})
	return g
}

func (g *givenUp) submit(t *testing.T, seq, n int) (Result, error) {
	t.Helper()
	return g.h.client.Submit(context.Background(), counterTask("k", n, seq), asynq.Queue(g.h.queue))
}

// settle releases the given-up handler, waits for a run of want, then checks
// for quiet seconds that want ran once, no other seq but 1 ran, and the key
// is left free. It returns how many times seq 1 ran in all.
func (g *givenUp) settle(t *testing.T, want counterPayload) int {
	t.Helper()
	close(g.release)
	ones, wants := 1, 0
	hear := func(p counterPayload) {
		switch {
		case p == want:
			wants++
		case p.Seq == 1:
			ones++
		default:
			t.Errorf("ran %+v, want only %+v (and the holder's seq 1)", p, want)
		}
	}
	for wants == 0 {
		hear(waitFor(t, g.runs, fmt.Sprintf("the run of %+v", want)))
	}
	quiet := time.After(5 * time.Second)
	for done := false; !done; {
		select {
		case p := <-g.runs:
			hear(p)
		case <-quiet:
			done = true
		}
	}
	if wants != 1 {
		t.Errorf("%+v ran %d times, want once", want, wants)
	}
	if !within(10*time.Second, func() bool { return len(g.h.locks()) == 0 }) {
		ctx := context.Background()
		for _, k := range g.h.locks() {
			v, _ := g.h.rdb.Get(ctx, k).Result()
			t.Errorf("left holding the key: %s = %q ttl %v, mode %v, holder %s state %s",
				k, v, g.h.rdb.PTTL(ctx, k).Val(), g.h.rdb.HGetAll(ctx, modeKeyOf(k)).Val(), holderIn(v), taskStateName(g.h, holderIn(v)))
		}
	}
	return ones
}

// The key owes a follow-up when an operator deletes its holder's waiting
// retry (asynq's delete frees the lock), and a task that arrived without a
// lock then takes the free key as it starts: the follow-up is still owed,
// after the arrival. An update meanwhile folds into it; it never becomes a
// second follow-up of the key beside the first.
func TestDeferFollowUpStaysOwedWhenAnArrivalTakesTheKeyItsDeletedHolderFreed(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	started := make(chan int, 8)
	holds := map[int]chan struct{}{1: make(chan struct{}), 3: make(chan struct{})}
	t.Cleanup(func() {
		for _, c := range holds {
			close(c)
		}
	})
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		seq := decodeCounter(task).Seq
		started <- seq
		if c := holds[seq]; c != nil {
			<-c // ignores its context
		}
		return nil
	}, retryInAnHour)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
	if seq := waitFor(t, started, "the holder runs"); seq != 1 {
		t.Fatalf("ran seq %d", seq)
	}
	eventually(t, "asynq gives the attempt up and waits to retry it", func() bool { return h.taskState(a.ID) == asynq.TaskStateRetry })
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the given-up handler runs: %+v %v, want a follow-up", f, err)
	}
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.asynq.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if seq := waitFor(t, started, "the arrival runs"); seq != 3 {
		t.Fatalf("ran seq %d, want the arrival (3)", seq)
	}
	g, err := h.client.Submit(ctx, counterTask("k", 1, 4), asynq.Queue(h.queue))
	if err != nil || g.TaskID != f.TaskID {
		t.Fatalf("update while the arrival runs: %+v %v, want folded into the follow-up %s", g, err, f.TaskID)
	}
}

// A RunningDefer holder noted before its deadline (its handler still ran
// LockTimeout before it), then deferred into, then succeeding before the
// deadline: the follow-up is queued at that end, runs with the new
// payload, and its success frees the key.
func TestDeferFollowUpOfAHolderThatSucceedsAfterItsDeadlineNoteRuns(t *testing.T) {
	t.Parallel()
	h, n := noteHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
	runs := make(chan int, 8)
	proceed := make(chan struct{})
	h.serve(func(ctx context.Context, t *asynq.Task) error {
		runs <- decodeJob(t).N
		if decodeJob(t).N != 1 {
			return nil
		}
		if err := n.wait(ctx); err != nil {
			return err
		}
		<-proceed
		return nil
	}, retryInAnHour)
	h.enqueue(jobTask("d", 1), asynq.Timeout(3*time.Second))
	waitFor(t, runs, "the holder runs")
	// The follow-up is made while the noted handler runs.
	deadline := time.Now().Add(5 * time.Second)
	var res Result
	var err error
	for time.Now().Before(deadline) {
		if res, err = h.client.Submit(context.Background(), jobTask("d", 2), asynq.Queue(h.queue)); err == nil {
			break
		}
	}
	close(proceed)
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("enqueue while the noted holder runs: %+v %v, want deferred", res, err)
	}
	if got := waitFor(t, runs, "the follow-up runs"); got != 2 {
		t.Fatalf("ran payload %d, want the follow-up's 2", got)
	}
	eventually(t, "the key frees", func() bool {
		_, err := h.client.Enqueue(jobTask("d", 3), asynq.Queue(h.queue))
		return err == nil
	})
}
