package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"go.uber.org/goleak"
)

// run is one handler invocation seen by a test.
type run struct {
	id    string
	retry int
	ctx   context.Context
	task  *asynq.Task
}

// recorder is a handler that reports each run on a channel and then does
// whatever the test's behave function says.
type recorder struct {
	runs   chan run
	behave func(r run) error
}

func newRecorder(behave func(run) error) *recorder {
	return &recorder{runs: make(chan run, 100), behave: behave}
}

func (rc *recorder) handler() asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		r := run{id: id, retry: n, ctx: ctx, task: t}
		rc.runs <- r
		if rc.behave == nil {
			return nil
		}
		return rc.behave(r)
	}
}

// done returns a channel closed when the task reaches state want.
func (h *harness) taskState(id string) asynq.TaskState {
	ti, err := h.insp.GetTaskInfo(h.queue, id)
	if err != nil {
		return 0
	}
	return ti.State
}

// finished reports that asynq is done with task id: completed (kept by
// its Retention), or its record gone.
func (h *harness) finished(id string) bool {
	st := h.taskState(id)
	return st == 0 || st == asynq.TaskStateCompleted
}

func (h *harness) enqueue(task *asynq.Task, opts ...asynq.Option) *asynq.TaskInfo {
	h.t.Helper()
	info, err := h.client.Enqueue(task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
	if err != nil {
		h.t.Fatalf("enqueue: %v", err)
	}
	return info
}

func TestSuccessReleasesLock(t *testing.T) {
	h := newHarness(t, Config{})
	rc := newRecorder(nil)
	h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = 1 })
	task := userTask(1, "")
	info := h.enqueue(task, asynq.Retention(time.Hour))
	r := waitFor(t, rc.runs, "first run")
	if r.id != info.ID {
		t.Fatalf("ran %s, want %s", r.id, info.ID)
	}
	eventually(t, "task completed", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
	// (The release goes out just after the handler returns, with others:
	// asynq may mark the task completed first.)
	eventually(t, "lock released after success", func() bool { return h.lockOwner(h.keyOf(task, h.queue)) == "" })
	again := h.enqueue(task)
	if again.ID == info.ID {
		t.Fatal("same ID twice")
	}
	waitFor(t, rc.runs, "second run")
	if s := h.d.Stats(); s.Started < 1 || s.Released < 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestLockLifecycleOnOutcomes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		maxRetry int
		err      error
		panics   bool
		state    asynq.TaskState
		held     bool
	}{
		{"revoke", 5, asynq.RevokeTask, false, 0, false},
		{"skip retry", 5, fmt.Errorf("bad input: %w", asynq.SkipRetry), false, asynq.TaskStateArchived, false},
		{"retries exhausted", 0, errors.New("fails"), false, asynq.TaskStateArchived, false},
		{"error with retries left", 3, errors.New("transient"), false, asynq.TaskStateRetry, true},
		{"panic with retries left", 3, nil, true, asynq.TaskStateRetry, true},
		{"panic on last attempt", 0, nil, true, asynq.TaskStateArchived, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, Config{RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
			rc := newRecorder(func(r run) error {
				if c.panics {
					panic("handler bug")
				}
				return c.err
			})
			h.serve(rc.handler(), func(cfg *asynq.Config) {
				cfg.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
			})
			task := userTask(1, "")
			info := h.enqueue(task, asynq.MaxRetry(c.maxRetry))
			waitFor(t, rc.runs, "run")
			key := h.keyOf(task, h.queue)
			if c.held {
				eventually(t, "task waits for retry", func() bool { return h.taskState(info.ID) == asynq.TaskStateRetry })
				if owner := h.lockOwner(key); owner != info.ID {
					t.Fatalf("lock owner %q across retry, want %q", owner, info.ID)
				}
				if ttl := pttl(t, h.rdb, key); ttl < time.Hour+defaultTTL-time.Minute {
					t.Fatalf("lock TTL %v across retry, want retry delay + TTL", ttl)
				}
				var dup *DuplicateTaskError
				if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
					t.Fatalf("enqueue during retry wait: err = %v, want duplicate of %s", err, info.ID)
				}
				return
			}
			if c.state != 0 {
				eventually(t, "task "+c.state.String(), func() bool { return h.taskState(info.ID) == c.state })
			}
			if c.state == asynq.TaskStateArchived {
				// asynq keeps an archived task's unique key: the lock stays,
				// its holder archived, and the key's next enqueue heals it.
				if st := h.lockState(key); st != store.LockOrphaned {
					t.Fatalf("lock of the archived task: %q, want orphaned", st)
				}
			} else {
				eventually(t, "lock released", func() bool { return h.lockOwner(key) == "" })
			}
			h.enqueue(task) // the key is free again
		})
	}
}

func TestRetryRunsHoldingLock(t *testing.T) {
	h := newHarness(t, Config{})
	var attempts atomic.Int32
	rc := newRecorder(func(r run) error {
		if attempts.Add(1) == 1 {
			return errors.New("first attempt fails")
		}
		return nil
	})
	h.serve(rc.handler(), nil)
	task := userTask(8, "")
	info := h.enqueue(task)
	first := waitFor(t, rc.runs, "first attempt")
	second := waitFor(t, rc.runs, "second attempt")
	if first.id != info.ID || second.id != info.ID || second.retry != 1 {
		t.Fatalf("attempts %+v, %+v", first, second)
	}
	eventually(t, "lock released", func() bool { return h.lockOwner(h.keyOf(task, h.queue)) == "" })
}

// A handler that runs longer than the lock's TTL keeps its key: the
// heartbeat (every TTL/3) lengthens the lock while it runs.
func TestHandlerOutlivesTTL(t *testing.T) {
	t.Parallel()                        // mostly waiting: beside the other waiting tests
	const ttl = 1500 * time.Millisecond // (a heartbeat may be late by 2 of its 500 ms beats under load)
	h := newHarness(t, Config{TTL: ttl, heartbeat: ttl / 3})
	release := make(chan struct{})
	rc := newRecorder(func(r run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info := h.enqueue(task)
	waitFor(t, rc.runs, "run")
	h.heldThrough(2*ttl, h.keyOf(task, h.queue)) // only the heartbeat keeps the lock
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("enqueue while the long handler runs: err = %v, want duplicate of %s", err, info.ID)
	}
	close(release)
	eventually(t, "lock released", func() bool { return h.lockOwner(h.keyOf(task, h.queue)) == "" })
	if s := h.d.Stats(); s.LockLost != 0 {
		t.Fatalf("LockLost = %d", s.LockLost)
	}
}

func TestLockStolenCancelsHandler(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (300 * time.Millisecond) / 3, CancelOnLockLoss: true})
	causes := make(chan error, 1)
	rc := newRecorder(func(r run) error {
		<-r.ctx.Done()
		causes <- context.Cause(r.ctx)
		return nil
	})
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info := h.enqueue(task)
	waitFor(t, rc.runs, "run")
	key := h.keyOf(task, h.queue)
	// Someone else (an operator, or a task after an expiry) takes the key.
	if err := h.rdb.Set(context.Background(), key, "intruder", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if cause := waitFor(t, causes, "handler cancelled"); !errors.Is(cause, ErrLockLost) {
		t.Fatalf("cause %v, want ErrLockLost", cause)
	}
	eventually(t, "task done", func() bool { return h.taskState(info.ID) != asynq.TaskStateActive })
	if owner := h.lockOwner(key); owner != "intruder" {
		t.Fatalf("the stale attempt touched the new owner's lock: owner %q", owner)
	}
	if s := h.d.Stats(); s.LockLost != 1 {
		t.Fatalf("LockLost = %d, want 1", s.LockLost)
	}
}

// A handler that ignores its deadline and "succeeds" after asynq gave its
// attempt up must not free the key: asynq's record says the task lives on (it
// is retried), so the key stays with it until the retry ends.
func TestLeftoverAttemptCannotTouchLock(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{})
	releaseFirst := make(chan struct{})
	releaseSecond := make(chan struct{})
	var attempts atomic.Int32
	rc := newRecorder(func(r run) error {
		if attempts.Add(1) == 1 {
			<-releaseFirst // ignores its deadline, like a stuck handler
			return nil     // reports success long after asynq gave up on it
		}
		<-releaseSecond
		return nil
	})
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info := h.enqueue(task, asynq.Timeout(time.Second)) // asynq keeps whole seconds
	key := h.keyOf(task, h.queue)
	waitFor(t, rc.runs, "first attempt")
	eventually(t, "asynq gives the first attempt up", func() bool {
		ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
		return err == nil && ti.Retried > 0
	})
	close(releaseFirst) // the leftover finishes "successfully"
	second := waitFor(t, rc.runs, "second attempt")
	if second.id != info.ID {
		t.Fatalf("second attempt of %s", second.id)
	}
	if owner := h.lockOwner(key); owner != info.ID {
		t.Fatalf("after the leftover returned: owner %q, want %q (its second attempt runs)", owner, info.ID)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("enqueue while the second attempt runs: %v, want a duplicate of %s", err, info.ID)
	}
	close(releaseSecond)
	// Its success is near its deadline (Timeout 1 s, LockTimeout 1 s): the
	// lock is left for asynq's record to answer, and the key is free once
	// that record says the task is done.
	eventually(t, "the key is free after the retry's success", func() bool {
		st := h.lockState(key)
		return st == "" || st == "orphaned"
	})
	h.enqueue(task)
}

func TestWorkerConfiguredDifferently(t *testing.T) {
	// The producer picks fields per call; the worker's Dedup has no rules.
	producer := newHarness(t, Config{})
	worker := newHarnessOn(t, producer.rdb, Config{Prefix: producer.prefix, Rules: map[string]Rule{"user:reindex": {Fields: []string{"nothing_like_it"}}}})
	worker.queue = producer.queue
	rc := newRecorder(nil)
	worker.serve(rc.handler(), nil)
	task := userTask(4, "t1")
	producer.enqueue(task, Fields("user_id"))
	producer.enqueue(userTask(5, "t1"), Fields("user_id"), asynq.TaskID("caller-chosen"))
	waitFor(t, rc.runs, "run 1")
	waitFor(t, rc.runs, "run 2")
	eventually(t, "both locks released", func() bool { return len(producer.locks()) == 0 })
	producer.enqueue(userTask(4, "t2"), Fields("user_id"))
}

func TestScheduledTask(t *testing.T) {
	h := newHarness(t, Config{TTL: time.Minute})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info := h.enqueue(task, asynq.ProcessIn(500*time.Millisecond))
	key := h.keyOf(task, h.queue)
	if ttl := pttl(t, h.rdb, key); ttl <= time.Minute {
		t.Fatalf("scheduled lock TTL %v does not cover the delay", ttl)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("err = %v, want duplicate of the scheduled task", err)
	}
	if r := waitFor(t, rc.runs, "scheduled run"); r.id != info.ID {
		t.Fatalf("ran %s", r.id)
	}
	eventually(t, "lock released", func() bool { return h.lockOwner(key) == "" })
}

func TestOptedOutTasksRunUnguarded(t *testing.T) {
	h := newHarness(t, Config{})
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	h.enqueue(task, Skip())
	h.enqueue(task, Skip())
	waitFor(t, rc.runs, "run 1")
	waitFor(t, rc.runs, "run 2") // both run at once: opted out at enqueue and at execution
	close(release)
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks for opted-out tasks", n)
	}
}

func TestExecutionGuard(t *testing.T) {
	for _, skip := range []bool{false, true} {
		t.Run(fmt.Sprintf("SkipBusy=%v", skip), func(t *testing.T) {
			h := newHarness(t, Config{SkipBusy: skip})
			release := make(chan struct{})
			var running, overlap atomic.Int32
			rc := newRecorder(func(r run) error {
				if running.Add(1) > 1 {
					overlap.Add(1)
				}
				defer running.Add(-1)
				if r.retry == 0 && r.id != "direct" {
					<-release
				}
				return nil
			})
			h.serve(rc.handler(), nil)
			task := userTask(1, "")
			first := h.enqueue(task)
			waitFor(t, rc.runs, "wrapped task runs")
			// The same work, enqueued past the wrapper (Scheduler, another service).
			direct, err := h.asynq.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID("direct"), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			eventually(t, "direct task turned away", func() bool { return h.d.Stats().Busy >= 1 })
			if skip {
				eventually(t, "direct task completed unrun", func() bool { return h.taskState(direct.ID) == asynq.TaskStateCompleted })
				close(release)
			} else {
				close(release)
				if r := waitFor(t, rc.runs, "direct task runs after the holder"); r.id != direct.ID {
					t.Fatalf("ran %s, want %s", r.id, direct.ID)
				}
				eventually(t, "direct task completed", func() bool { return h.taskState(direct.ID) == asynq.TaskStateCompleted })
				ti, err := h.insp.GetTaskInfo(h.queue, direct.ID)
				if err != nil {
					t.Fatal(err)
				}
				if ti.Retried != 0 {
					t.Fatalf("busy deferral used %d retries (IsFailure)", ti.Retried)
				}
			}
			if overlap.Load() != 0 {
				t.Fatal("two handlers ran one key at once")
			}
			eventually(t, "locks released", func() bool { return len(h.locks()) == 0 })
			_ = first
		})
	}
}

// A task that arrived without a lock and succeeds, under a rule that keeps
// nothing at the end, makes no settle call: its lock is released together
// with the other successes of the moment by one shared call (releases.go), so
// such a task costs the worker one script of its own, its start.
func TestExecutionGuardSuccessesAreReleasedTogetherWithoutASettleCall(t *testing.T) {
	needRealRedis(t)
	rdb := newRDB(t)
	calls := &libraryScripts{}
	rdb.AddHook(calls.hook())
	h := newHarnessOn(t, rdb, Config{})
	const n = 30
	for i := range n {
		if _, err := h.asynq.Enqueue(userTask(i, ""), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
	}
	ran := make(chan struct{}, n)
	h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
	for range n {
		waitFor(t, ran, "every task runs")
	}
	eventually(t, "every lock released", func() bool { return len(h.locks()) == 0 })
	if s, e, d := calls.starts.Load(), calls.settles.Load(), calls.together.Load(); s != n || e != 0 || d < 1 || d > n {
		t.Fatalf("%d tasks: %d starts, %d settles, %d shared releases; want %d, 0, 1 to %d", n, s, e, d, n, n)
	}
}

// Close sends the shared release of successes just before it: a guard
// success just before Close leaves no lock behind.
func TestCloseReleasesTheLocksOfSuccessesJustBefore(t *testing.T) {
	h := newHarness(t, Config{})
	closed := make(chan error, 1)
	outer := func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			err := next.ProcessTask(ctx, t)
			closed <- h.d.Close() // (before asynq's done: the shared release is not sent yet)
			return err
		})
	}
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel})
	if err := srv.Start(outer(h.d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	if _, err := h.asynq.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(t, closed, "the success, then Close"); err != nil {
		t.Fatal(err)
	}
	if l := h.locks(); len(l) != 0 {
		t.Fatalf("locks left after Close: %v", l)
	}
}

func TestUnlockedTaskTakesLockAtStart(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	info, err := h.asynq.Enqueue(userTask(3, "from-scheduler"), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "run")
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(userTask(3, "from-api"), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("err = %v, want duplicate of the running unlocked task %s", err, info.ID)
	}
	close(release)
	eventually(t, "lock released", func() bool { return len(h.locks()) == 0 })
}

func TestCloseStopsHeartbeat(t *testing.T) {
	rdb := newRDB(t)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		// miniredis (the fallback) serves each connection New opens.
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer.func2"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).ServeConn.func1"))
	d, err := New(context.Background(), rdb, Config{Prefix: uniq(t), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	_ = d.Middleware()
	_ = d.Middleware() // one heartbeat goroutine, however many middlewares
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	_ = d.Close()
}

func TestHeartbeatOneRoundTripForManyHandlers(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{heartbeat: (300 * time.Millisecond) / 3})
	const n = 50
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = n })
	for i := range n {
		h.enqueue(userTask(i, ""))
	}
	for range n {
		waitFor(t, rc.runs, "runs")
	}
	keys := make([]string, n)
	for i := range n {
		keys[i] = h.keyOf(userTask(i, ""), h.queue)
	}
	h.heldThrough(1200*time.Millisecond, keys...) // several TTLs pass; all must survive
	close(release)
	eventually(t, "all released", func() bool { return h.d.Stats().Released == n })
	eventually(t, "no lock left (asynq's done drops them)", func() bool { return len(h.locks()) == 0 })
	if s := h.d.Stats(); s.LockLost != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestMiddlewareRedisDown(t *testing.T) {
	needRealRedis(t)
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%v", open), func(t *testing.T) {
			// Locks through the proxy, tasks direct.
			h := newHarness(t, Config{})
			lockRedis, d := proxiedLockStore(t, h, Config{FailOpen: open})
			h.d = d
			rc := newRecorder(nil)
			errs := make(chan error, 10)
			lockRedis.close()
			h.serve(rc.handler(), func(c *asynq.Config) {
				c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { errs <- err })
				c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
			})
			if _, err := h.asynq.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
			if open {
				waitFor(t, rc.runs, "handler runs without its lock")
				eventually(t, "counted", func() bool { return d.Stats().FailOpen >= 1 })
				return
			}
			if err := waitFor(t, errs, "task refused"); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("err = %v, want ErrUnavailable", err)
			}
			select {
			case <-rc.runs:
				t.Fatal("handler ran while the lock store was down (fail-closed)")
			default:
			}
		})
	}
}

// Rule.OnBusy chooses per type what happens to a task that arrives without
// a lock and meets its key held: retried (ErrKeyBusy reaches ErrorHandler),
// dropped (counted, never reaching ErrorHandler) or folded into the holder.
func TestBusyPolicyPerType(t *testing.T) {
	rule := func(b Busy) Rule { return Rule{Fields: []string{"key"}, OnBusy: b} }
	h := newHarness(t, Config{Rules: map[string]Rule{"b:retry": rule(BusyRetry), "b:drop": rule(BusyDrop), "b:fold": rule(BusyFold)}})
	task := func(typ string, seq int) *asynq.Task {
		return asynq.NewTask(typ, []byte(fmt.Sprintf(`{"key":"k","seq":%d}`, seq)))
	}
	holders := map[string]*asynq.TaskInfo{}
	for _, typ := range []string{"b:retry", "b:drop", "b:fold"} {
		holders[typ] = h.enqueue(task(typ, 1), asynq.ProcessIn(time.Hour)) // waiting, holds the key
	}
	errs := make(chan error, 100)
	rc := newRecorder(nil)
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, tk *asynq.Task, err error) { errs <- fmt.Errorf("%s: %w", tk.Type(), err) })
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
	})
	arrivals := map[string]string{}
	for _, typ := range []string{"b:retry", "b:drop", "b:fold"} {
		info, err := h.asynq.Enqueue(task(typ, 2), asynq.Queue(h.queue), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		arrivals[typ] = info.ID
	}
	if err := waitFor(t, errs, "the retried arrival's error"); !errors.Is(err, ErrKeyBusy) || !strings.HasPrefix(err.Error(), "b:retry") {
		t.Fatalf("ErrorHandler got %v, want b:retry's ErrKeyBusy", err)
	}
	eventually(t, "drop and fold arrivals done", func() bool {
		return h.taskState(arrivals["b:drop"]) == asynq.TaskStateCompleted && h.taskState(arrivals["b:fold"]) == asynq.TaskStateCompleted
	})
	if got := h.payloadOf(holders["b:fold"].ID); got != `{"key":"k","seq":2}` {
		t.Fatalf("the folded arrival's payload is not in the holder: %s", got)
	}
	if got := h.payloadOf(holders["b:drop"].ID); got != `{"key":"k","seq":1}` {
		t.Fatalf("the dropped arrival changed the holder: %s", got)
	}
	select {
	case err := <-errs:
		t.Fatalf("another error reached ErrorHandler: %v", err)
	case r := <-rc.runs:
		t.Fatalf("a busy arrival ran: %s", r.id)
	default:
	}
	if s := h.d.StatsByType(); s["b:drop"].Busy != 1 || s["b:fold"].Busy != 1 || s["b:retry"].Busy < 1 {
		t.Fatalf("busy counts: drop %d, fold %d, retry %d", s["b:drop"].Busy, s["b:fold"].Busy, s["b:retry"].Busy)
	}
}

// ---- the worker's fast path (the begin and done scripts) for tasks
// NewClient locked at enqueue ----

// trackedAttempt is one handler run.
type trackedAttempt struct {
	id    string
	seq   int
	retry int
	ctx   context.Context
}

// attemptTracker records runs, notes overlaps per key, and holds runs of gated
// (seq, retry) pairs until opened.
type attemptTracker struct {
	mu       sync.Mutex
	active   map[string]int
	overlaps []string
	gates    map[string]chan struct{}
	result   func(trackedAttempt) error
	starts   chan trackedAttempt
	ends     chan trackedAttempt
}

func newAttemptTracker(result func(trackedAttempt) error) *attemptTracker {
	return &attemptTracker{active: map[string]int{}, gates: map[string]chan struct{}{}, result: result,
		starts: make(chan trackedAttempt, 1000), ends: make(chan trackedAttempt, 1000)}
}

func attemptGateKey(seq, retry int) string { return fmt.Sprintf("%d/%d", seq, retry) }

// gate holds the run of seq at retry until open.
func (tr *attemptTracker) gate(seq, retry int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.gates[attemptGateKey(seq, retry)] = make(chan struct{})
}

func (tr *attemptTracker) open(seq, retry int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if g, ok := tr.gates[attemptGateKey(seq, retry)]; ok {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

func (tr *attemptTracker) openAll() {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, g := range tr.gates {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

func (tr *attemptTracker) handler() asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		p := decodeCounter(t)
		r := trackedAttempt{id: id, seq: p.Seq, retry: n, ctx: ctx}
		tr.mu.Lock()
		if tr.active[p.Key] > 0 {
			tr.overlaps = append(tr.overlaps, fmt.Sprintf("%s (seq %d retry %d) started beside another run of key %q", id, p.Seq, n, p.Key))
		}
		tr.active[p.Key]++
		g := tr.gates[attemptGateKey(p.Seq, n)]
		tr.mu.Unlock()
		tr.starts <- r
		if g != nil {
			<-g // (ignores ctx on purpose: a leftover handler)
		}
		var err error
		if tr.result != nil {
			err = tr.result(r)
		}
		tr.mu.Lock()
		tr.active[p.Key]--
		tr.mu.Unlock()
		tr.ends <- r
		return err
	}
}

func (tr *attemptTracker) overlapsSeen() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]string(nil), tr.overlaps...)
}

// waitAttemptOf waits up to d for a start of seq; nil if none.
func waitAttemptOf(ch <-chan trackedAttempt, seq int, d time.Duration) *trackedAttempt {
	deadline := time.After(d)
	for {
		select {
		case r := <-ch:
			if r.seq == seq {
				return &r
			}
		case <-deadline:
			return nil
		}
	}
}

// lookupState is what Lookup says of task's key: "state:holder", or ""
// when the key is free.
func lookupState(t *testing.T, h *harness, task *asynq.Task, opts ...asynq.Option) string {
	t.Helper()
	l, found, err := h.d.Lookup(context.Background(), task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	if !found {
		return ""
	}
	return l.State + ":" + l.Holder
}

// README (lock lifecycle; Benchmarks, "Worker side"): a task locked at
// enqueue by NewClient runs through begin/done; the lock must be held
// (Lookup: running) while it runs, held across a retry (retry-wait,
// duplicates refused), and released on success.
func TestFastPathHoldsTheKeyWhileRunningAndAcrossARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(func(r trackedAttempt) error {
		if r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	})
	tr.gate(1, 0)
	tr.gate(1, 1)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	a := h.enqueue(counterTask("k", 1, 1))
	// (The fast path's precondition: a lock written with its task, field v.)
	if v, _ := h.rdb.HGet(context.Background(), h.keyOf(counterTask("k", 1, 1), h.queue), "v").Result(); v != "1" && len(tr.starts) == 0 {
		t.Logf("lock has no v field (%q): begin may not be exercised", v)
	}
	waitFor(t, tr.starts, "first attempt")
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("during the first attempt Lookup says %q, want running:%s", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue during the run: %v, want duplicate", err)
	}
	tr.open(1, 0)
	r := waitFor(t, tr.starts, "the retry")
	if r.id != a.ID || r.retry != 1 {
		t.Fatalf("ran %s retry %d", r.id, r.retry)
	}
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("during the retry Lookup says %q, want running:%s", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue during the retry: %v, want duplicate", err)
	}
	tr.open(1, 1)
	waitFor(t, tr.ends, "first end")
	waitFor(t, tr.ends, "retry end")
	eventually(t, "the lock is released after success", func() bool { return lookupState(t, h, counterTask("k", 1, 1)) == "" })
	if _, err := h.client.Enqueue(counterTask("k", 1, 4), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after success: %v", err)
	}
}

// README (lock lifecycle): a key is free again after SkipRetry and
// exhausted retries (healed at its next enqueue) and after a revoke; a
// per-call Cooldown keeps the key after success — all on the fast path
// (NewClient, a lock holding nothing else, or a cd field).
func TestFastPathFreesOrCoolsTheKeyAtEachEnding(t *testing.T) {
	cases := []struct {
		name    string
		result  error
		opts    []asynq.Option
		cooling bool
	}{
		{"SkipRetry", fmt.Errorf("no: %w", asynq.SkipRetry), nil, false},
		{"exhausted", errors.New("boom"), []asynq.Option{asynq.MaxRetry(0)}, false},
		{"revoked", asynq.RevokeTask, nil, false},
		{"success with per-call Cooldown", nil, []asynq.Option{Cooldown(time.Minute)}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, counterRules(Rule{}))
			h.client = h.d.NewClient()
			tr := newAttemptTracker(func(trackedAttempt) error { return c.result })
			h.serve(tr.handler(), nil)
			a := h.enqueue(counterTask("k", 1, 1), c.opts...)
			waitFor(t, tr.ends, "the run")
			if c.cooling {
				eventually(t, "the key cools", func() bool { return lookupState(t, h, counterTask("k", 1, 1)) == "cooling:"+a.ID })
				_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
				var dup *DuplicateTaskError
				if !errors.As(err, &dup) || !dup.CoolingDown {
					t.Fatalf("enqueue while cooling: %v, want a cooling duplicate", err)
				}
				return
			}
			// asynq's archive keeps the key named in the task's record: it
			// is orphaned, and the key's next enqueue heals it.
			eventually(t, "the lock is released or orphaned", func() bool {
				s := lookupState(t, h, counterTask("k", 1, 1))
				return s == "" || c.result != asynq.RevokeTask && s == store.LockOrphaned+":"+a.ID
			})
			if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("enqueue after the end: %v", err)
			}
		})
	}
}

// README (RunningDefer): a follow-up attached DURING a fast-path run
// (begin saw no follow-up) is queued when the run ends and runs last with
// the newest payload, never beside the run.
func TestFastPathQueuesAFollowUpAttachedDuringTheRun(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	a := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v %v, want a follow-up", res, err)
	}
	if r2, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil || r2.TaskID != res.TaskID {
		t.Fatalf("%+v %v, want folded into %s", r2, err, res.TaskID)
	}
	tr.open(1, 0)
	r := waitAttemptOf(tr.starts, 3, 10*time.Second)
	if r == nil || r.id != res.TaskID {
		t.Fatalf("the follow-up (seq 3, %s) never ran after %s: %+v", res.TaskID, a.ID, r)
	}
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Fatalf("overlaps: %v", o)
	}
	eventually(t, "no lock left", func() bool { return len(h.locks()) == 0 })
}

// README (Lock API): an operator Release during a fast-path run frees
// the key; a new task takes it; the old run's end (done.lua) must not
// release the new holder's lock.
func TestFastPathRunReleasedMidwayLeavesTheNewHoldersLock(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	b := h.enqueue(counterTask("k", 1, 2), asynq.ProcessIn(time.Hour))
	tr.open(1, 0)
	waitFor(t, tr.ends, "the old run ends")
	eventually(t, "the old run settled", func() bool { return h.d.Stats().Processed >= 1 })
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "waiting:"+b.ID {
		t.Fatalf("after the released run ended Lookup says %q, want waiting:%s", s, b.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue while %s waits: %v, want duplicate", b.ID, err)
	}
}

// A task locked at enqueue (NewClient) whose attempt 0 outlives its
// Timeout: asynq retries it, and the retry waits for the leftover handler
// (leftover_overlap_test.go). The leftover then returns nil: that must not
// free the key, which stays the task's while its retry runs.
func TestFastPathLeftoverAttemptLeavesTheRetrysLock(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	tr.gate(1, 1)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second))
	waitFor(t, tr.starts, "attempt 0")
	eventually(t, "asynq gives attempt 0 up", func() bool {
		ti, err := h.insp.GetTaskInfo(h.queue, a.ID)
		return err == nil && ti.Retried > 0
	})
	tr.open(1, 0) // the leftover returns nil
	waitFor(t, tr.ends, "the leftover ends")
	r := waitFor(t, tr.starts, "attempt 1")
	if r.id != a.ID || r.retry != 1 {
		t.Fatalf("ran %s retry %d, want %s retry 1", r.id, r.retry, a.ID)
	}
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("after the leftover returned Lookup says %q, want running:%s (attempt 1 runs)", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue while attempt 1 runs: %v, want duplicate", err)
	}
	tr.open(1, 1)
}

// README (MaxPending): entries "leave when their task starts" — also a
// task whose first attempt goes through the fast path decision.
func TestFastPathMaxPendingEntryLeavesAtStart(t *testing.T) {
	h := newHarness(t, counterRules(Rule{MaxPending: 1}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	h.enqueue(counterTask("a", 1, 1))
	waitFor(t, tr.starts, "a runs")
	if _, err := h.client.Enqueue(counterTask("b", 1, 2), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("a second key while the first runs: %v, want room (the first left the waiting set at start)", err)
	}
	tr.open(1, 0)
}

// A task that arrived without a lock, whose key another task took while it
// ran (an operator released it, another task took it), ends with its lock
// lost: the attempt counts LockLost, not Released, whether its success
// makes a settle call or is released together with others. (A short handler: no heartbeat
// beat came between, so only its end can see the loss.)
func TestArrivalSuccessWhoseLockAnotherTookCountsLockLost(t *testing.T) {
	h := newHarness(t, Config{})
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info, err := h.asynq.Enqueue(task, asynq.Queue(h.queue)) // past the wrapper: it takes its lock as it starts
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "the arrival runs")
	key := h.keyOf(task, h.queue)
	if owner := h.lockOwner(key); owner != info.ID {
		t.Fatalf("lock owner %q while it runs, want %s", owner, info.ID)
	}
	if err := h.rdb.Set(context.Background(), key, "intruder", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	close(release)
	eventually(t, "asynq done with it", func() bool { return h.finished(info.ID) })
	if err := h.d.Close(); err != nil { // (sends the release under way)
		t.Fatal(err)
	}
	if owner := h.lockOwner(key); owner != "intruder" {
		t.Fatalf("the ended attempt touched the new owner's lock: owner %q", owner)
	}
	if s := h.d.Stats(); s.LockLost != 1 || s.Released != 0 {
		t.Fatalf("LockLost = %d, Released = %d; want 1, 0 (the lock was not its to release)", s.LockLost, s.Released)
	}
}

// A caller-chosen task ID may be used again once asynq is done with its
// task (no Retention: its record is gone). The first task, which arrived
// without a lock, succeeds; the shared call that releases its lock is cut
// off at LockTimeout (a stalled connection) and reaches Redis late, after
// the ID's next task took the key: through asynq's client (it takes the
// lock as it starts) or through WrapClient or NewClient (they heal the
// done task's lock and take it). That late release must not delete the
// running task's lock: the key stays held and a duplicate is refused.
func TestLateReleaseOfASuccessLeavesTheLockOfAReusedIDsNextTask(t *testing.T) {
	for _, via := range []string{"asynq's client", "WrapClient", "NewClient"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, Config{})
			enqueue := h.asynq.Enqueue
			switch via {
			case "WrapClient":
				enqueue = h.client.Enqueue
			case "NewClient":
				enqueue = h.d.NewClient().Enqueue
			}
			proxy, slow := proxiedLockStore(t, h, Config{LockTimeout: 500 * time.Millisecond})
			task := userTask(1, "")
			key := h.keyOf(task, h.queue)
			// Worker A: its lock calls go through a connection the test
			// stalls once the handler has run (the attempt's start has gone
			// through).
			srvA := serveWith(t, h.rdb, slow, h.queue, asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
				proxy.stall()
				return nil
			}), nil)
			t.Cleanup(proxy.resume)
			if _, err := h.asynq.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID("job-1")); err != nil {
				t.Fatal(err)
			}
			eventually(t, "asynq done with the first job-1", func() bool {
				_, err := h.insp.GetTaskInfo(h.queue, "job-1")
				return errors.Is(err, asynq.ErrTaskNotFound)
			})
			srvA.Shutdown()
			// Worker B, on a healthy connection, runs job-1's next task.
			release := make(chan struct{})
			rc := newRecorder(func(run) error { <-release; return nil })
			h.serve(rc.handler(), nil)
			t.Cleanup(func() { close(release) }) // (before the server's shutdown)
			if _, err := enqueue(task, asynq.Queue(h.queue), asynq.TaskID("job-1")); err != nil {
				t.Fatalf("enqueue job-1 again through %s: %v", via, err)
			}
			waitFor(t, rc.runs, "the second job-1 runs")
			if owner := h.lockOwner(key); owner != "job-1" {
				t.Fatalf("lock owner %q while the second job-1 runs, want job-1", owner)
			}
			proxy.resume()
			if err := slow.Close(); err != nil { // (waits for worker A's calls)
				t.Fatal(err)
			}
			if owner := h.lockOwner(key); owner != "job-1" {
				t.Fatalf("worker A's late release deleted the lock of the running second job-1 (enqueued through %s): owner %q", via, owner)
			}
			var dup *DuplicateTaskError
			if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) {
				t.Fatalf("enqueue while the second job-1 runs: %v, want a duplicate", err)
			}
		})
	}
}
