package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
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
				if ttl := pttl(t, h.rdb, key); ttl < time.Hour+DefaultTTL-time.Minute {
					t.Fatalf("lock TTL %v across retry, want retry delay + TTL", ttl)
				}
				var dup *DuplicateTaskError
				if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
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

func TestHandlerOutlivesTTL(t *testing.T) {
	h := newHarness(t, Config{TTL: 300 * time.Millisecond, heartbeat: (300 * time.Millisecond) / 3})
	release := make(chan struct{})
	rc := newRecorder(func(r run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	task := userTask(1, "")
	info := h.enqueue(task)
	waitFor(t, rc.runs, "run")
	// Let several TTLs and leases pass: only the heartbeat keeps the lock.
	time.Sleep(1200 * time.Millisecond)
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
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
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
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
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
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
	if _, err := h.client.Enqueue(userTask(3, "from-api"), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
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
	time.Sleep(1200 * time.Millisecond) // several leases pass; all must survive
	for i := range n {
		if owner := h.lockOwner(h.keyOf(userTask(i, ""), h.queue)); owner == "" {
			t.Fatalf("lock %d expired while its handler ran", i)
		}
	}
	close(release)
	eventually(t, "all released", func() bool { return h.d.Stats().Released == n })
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left", n)
	}
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
