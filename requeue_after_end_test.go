package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// A shutdown can requeue a task whose handler has already returned and whose
// end the middleware has already settled: asynq's worker picks between the
// handler's result and its ShutdownTimeout, and a middleware mounted outside
// Dedup.Middleware (dedupotel's, a logger's) may still be at work when the
// timeout comes. lifecycle.md: "The holds are written before the handler's
// result reaches asynq, so a shutdown, a deadline or a crash after that
// moment cannot lose or stretch them." The requeued task then runs again
// with its retry count unchanged.

// slowOuterServer runs the middleware for h under an outer middleware that,
// after the first attempt it sees ends, waits for asynq to give the attempt
// up (a shutdown: its context ends once asynq requeued the task). ended
// receives the attempt's ID once the middleware has returned.
func slowOuterServer(t *testing.T, h *harness, inner asynq.HandlerFunc, ended chan<- string) (stop func()) {
	t.Helper()
	var once sync.Once
	mw := h.d.Middleware()(inner)
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		first := false
		once.Do(func() { first = true })
		if first {
			id, _ := asynq.GetTaskID(ctx)
			ended <- id
			<-ctx.Done() // still flushing a span, say, when the shutdown times out
		}
		return err
	})
	_, stop = serveRaw(t, h.rdb, h.queue, outer, func(c *asynq.Config) {
		c.Concurrency = 1 // the follow-up, once queued, waits for the next server
		c.ShutdownTimeout = 300 * time.Millisecond
	})
	return stop
}

// RunningDefer: the holder's end hands the key to its follow-up and queues
// it; a shutdown then requeues the holder. The holder must not run beside
// the follow-up that now holds its key ("never runs two tasks of a key at
// once").
func TestDeferHolderRequeuedAfterItsEndNeverRunsBesideItsFollowUp(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
	ctx := context.Background()
	release := make(chan struct{})
	ended := make(chan string, 1)
	stop := slowOuterServer(t, h, func(ctx context.Context, task *asynq.Task) error {
		<-release
		return nil
	}, ended)
	holder := h.enqueue(counterTask("k", 1, 0))
	eventually(t, "the holder runs", func() bool { return h.taskState(holder.ID) == asynq.TaskStateActive })
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v, %v, want a follow-up", res, err)
	}
	close(release)
	waitFor(t, ended, "the holder's attempt ended")
	key := h.keyOf(counterTask("k", 1, 0), h.queue)
	if owner := h.lockOwner(key); owner != res.TaskID {
		t.Fatalf("lock owner %q after the holder's end, want its follow-up %s", owner, res.TaskID)
	}
	stop() // ShutdownTimeout passes while the outer middleware works: asynq requeues the holder
	if st := h.taskState(holder.ID); st != asynq.TaskStatePending {
		t.Fatalf("holder %v after the shutdown, want pending (requeued)", st)
	}

	// The next server: both the holder (requeued) and its follow-up wait.
	neverBoth(t, h, holder.ID, res.TaskID)
}

// neverBoth serves h's queue with handlers that block, and fails the test if
// tasks a and b, both waiting, run at once: whichever runs first must hold
// the key, and the other must not run beside it.
func neverBoth(t *testing.T, h *harness, a, b string) {
	t.Helper()
	runs := make(chan string, 10)
	hold := make(chan struct{})
	defer close(hold) // (before the server's cleanup shuts it down)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		runs <- id
		<-hold
		return nil
	}, retryInAnHour)
	first := waitFor(t, runs, "a task of the key runs")
	other := a
	if first == a {
		other = b
	}
	eventually(t, "the other task of the key runs or is deferred", func() bool {
		if len(runs) > 0 {
			return true
		}
		st := h.taskState(other)
		return st == asynq.TaskStateRetry || st == asynq.TaskStateCompleted || st == 0
	})
	if len(runs) > 0 {
		t.Fatalf("%s and %s run at once under one key", first, <-runs)
	}
}

// Cooldown, settled by the middleware (a caller-chosen ID: call.keptFor):
// the success cooled the key; a shutdown then requeues the task. "A handler
// that succeeded after all cools its key (Cooldown): the retry that follows
// finds its own cooling key and does not run again"; at most one successful
// run per window.
func TestCooledTaskRequeuedAfterItsSuccessDoesNotRunAgain(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{Cooldown: time.Hour})
	ended := make(chan string, 1)
	stop := slowOuterServer(t, h, func(context.Context, *asynq.Task) error { return nil }, ended)
	a := h.enqueue(counterTask("k", 1, 0), asynq.TaskID("cooled-"+uniq(t)))
	waitFor(t, ended, "the task's attempt ended")
	key := h.keyOf(counterTask("k", 1, 0), h.queue)
	if st := h.lockState(key); st != "cooling" {
		t.Fatalf("lock %q after the success, want cooling", st)
	}
	stop()
	if st := h.taskState(a.ID); st != asynq.TaskStatePending {
		t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
	}
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	eventually(t, "asynq is done with the requeued task", func() bool { return h.finished(a.ID) })
	if len(rc.runs) > 0 {
		r := <-rc.runs
		t.Fatalf("the cooled task %s ran again (retry %d) inside its cooldown", r.id, r.retry)
	}
	if st := h.lockState(key); st != "cooling" {
		t.Fatalf("lock %q, want still cooling", st)
	}
}

// Cooldown kept by asynq's record (NewClient's own ID): a success counts
// once asynq records it. A shutdown requeues the task after its handler
// succeeded but before asynq recorded that: asynq runs it again, as it does
// any task it did not see end, holding its key all the while (a duplicate
// meanwhile is refused, naming it), and its key cools once asynq records the
// second run's success, until the cooldown's end counted from the enqueue.
func TestKeptCooldownTaskRequeuedBeforeAsynqRecordedItsSuccessRunsAgainHoldingItsKey(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{Cooldown: time.Hour})
	ended := make(chan string, 1)
	stop := slowOuterServer(t, h, func(context.Context, *asynq.Task) error { return nil }, ended)
	taken := time.Now()
	a := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, ended, "the task's attempt ended")
	key := h.keyOf(counterTask("k", 1, 0), h.queue)
	if st := h.lockState(key); st != "running" {
		t.Fatalf("lock %q after the handler returned, before asynq recorded it, want running (asynq's record)", st)
	}
	stop()
	if st := h.taskState(a.ID); st != asynq.TaskStatePending {
		t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
	}
	_, err := h.client.Enqueue(counterTask("k", 2, 0), asynq.Queue(h.queue))
	if dup := (*DuplicateTaskError)(nil); !errors.As(err, &dup) || dup.Holder != a.ID || dup.CoolingDown {
		t.Fatalf("enqueue while the requeued task waits: %v, want a duplicate of %s, not cooling", err, a.ID)
	}
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	if r := waitFor(t, rc.runs, "the requeued task runs again"); r.id != a.ID {
		t.Fatalf("ran %s, want %s", r.id, a.ID)
	}
	eventually(t, "asynq records its success", func() bool { return h.taskState(a.ID) == asynq.TaskStateCompleted })
	dup := coolingDup(t, h.client, counterTask("k", 3, 0), h.queue, a.ID)
	if want := time.Until(taken.Add(time.Hour)); dup.FreeIn > want+time.Second || dup.FreeIn < want-time.Minute {
		t.Fatalf("FreeIn %v, want about %v (the cooldown counts from the enqueue)", dup.FreeIn, want)
	}
	if len(rc.runs) > 0 {
		t.Fatalf("ran a third time: %s", (<-rc.runs).id)
	}
}

// WrapClient: asynq's client stored the task, whose record does not name its
// lock, so the middleware releases the lock at the success. A shutdown then
// requeues the task: it waits again without a lock, the key's next enqueue
// is accepted, and the two run at once ("never two live tasks holding one
// key", "never two handlers of a key running at once").
func TestWrapClientTaskRequeuedAfterItsReleaseNeverRunsBesideTheKeysNextTask(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{})) // h.client: WrapClient
	ended := make(chan string, 1)
	stop := slowOuterServer(t, h, func(context.Context, *asynq.Task) error { return nil }, ended)
	a := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, ended, "the task's attempt ended")
	stop()
	if st := h.taskState(a.ID); st != asynq.TaskStatePending {
		t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
	}
	info, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil {
		return // refused while the requeued task waits: one live task of the key
	}
	t.Logf("the key's next enqueue was accepted (%s) while %s, requeued, waits to run again", info.ID, a.ID)
	neverBoth(t, h, a.ID, info.ID)
}

// README (Lock lifecycle): "a task locked at enqueue finds its key held by
// another task, or cooling | retried until the key is free, never dropped or
// folded"; the matrix: "the Inspector archives or deletes the task while it
// waits | NewClient: new task at once".
//
// A waiting task A is archived by an operator; the key's next enqueue B
// heals the lock and takes the key, and runs. The operator then runs A
// again (Inspector.RunTask): A is still on its first attempt (asynq's
// archive keeps the retry count), yet it meets the key held by B and never
// runs beside it. (Once, a first attempt started "free", trusting a time
// carried in its task ID, and A ran beside B with no lock of its own.)
func TestArchivedWaitingTaskRunAgainNeverRunsBesideTheNewHolder(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	if err := h.insp.ArchiveTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	b := h.enqueue(counterTask("k", 1, 2)) // heals: A is archived
	tr := newKeyTracker(counterKeyOf, 1, 2)
	serveWith(t, h.rdb, h.d, h.queue, tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	first := waitFor(t, tr.starts, "B runs")
	if first.id != b.ID {
		t.Fatalf("first run %s, want B %s", first.id, b.ID)
	}
	if err := h.insp.RunTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	tr.noSecondStart(t, h, first, "archived task "+a.ID+" run again by an operator while "+b.ID+" holds its key")
}

// The same, through asynq's own archiving: a first attempt that ends for
// good with SkipRetry (or an error under MaxRetry(0)) is archived with retry
// count 0, and its key is released (orphaned, healed at the next enqueue). A
// task of the key B then takes the key and runs; an operator re-runs the
// archived task (the usual fix after a bug). It meets the key held by B
// (retried until free), never runs beside B.
func TestTaskArchivedOnItsFirstAttemptRunAgainNeverRunsBesideTheNewHolder(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []asynq.Option
		err  error
	}{
		{"SkipRetry", nil, fmt.Errorf("bad input: %w", asynq.SkipRetry)},
		{"MaxRetry(0)", []asynq.Option{asynq.MaxRetry(0)}, errors.New("boom")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newDirectHarness(t, Rule{})
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 2)
			serveWith(t, h.rdb, h.d, h.queue, tr.handler(func(r keyRun) error {
				if r.seq == 1 && r.retry == 0 && r.id != "" {
					if n, _ := h.rdb.Get(ctx, h.prefix+":a9:ran:"+r.id).Int(); n == 0 {
						h.rdb.Set(ctx, h.prefix+":a9:ran:"+r.id, 1, time.Hour)
						return tc.err
					}
				}
				return nil
			}), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
			t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
			a := h.enqueue(counterTask("k", 1, 1), tc.opts...)
			requirePlainID(t, a.ID)
			waitFor(t, tr.starts, "A's first attempt")
			waitFor(t, tr.ends, "A's first attempt ends")
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			eventually(t, "A archived, its key orphaned", func() bool {
				return h.taskState(a.ID) == asynq.TaskStateArchived && h.lockState(key) == store.LockOrphaned
			})
			b := h.enqueue(counterTask("k", 1, 2))
			first := waitFor(t, tr.starts, "B runs")
			if first.id != b.ID {
				t.Fatalf("run %s, want B %s", first.id, b.ID)
			}
			if err := h.insp.RunTask(h.queue, a.ID); err != nil {
				t.Fatal(err)
			}
			tr.noSecondStart(t, h, first, "archived task "+a.ID+" run again while "+b.ID+" runs")
		})
	}
}

// README (Lock API): "the holder, if alive, still runs … and takes the key
// again when it starts if the key is free; if a task of its type has taken
// the key since (the release marks the holder so), the holder gives way to
// it"; (Lock lifecycle) "shutdown, the handler outliving ShutdownTimeout |
// back in the queue".
//
// An operator releases the key of A while A runs. B takes the key and waits.
// A's server shuts down, the handler outlives ShutdownTimeout, and asynq
// puts A back with retry count 0 and its original message. On the next
// server A meets B's key: the two never run at once.
func TestReleasedRunningHolderRequeuedByShutdownNeverRunsBesideTheNewHolder(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	started1, leftoverGo := make(chan string, 4), make(chan struct{})
	_, stop1 := serveRaw(t, h.rdb, h.queue, h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started1 <- id
		<-leftoverGo
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1; c.ShutdownTimeout = 300 * time.Millisecond })
	t.Cleanup(func() { close(leftoverGo) })
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	waitFor(t, started1, "A runs on server 1")
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	b := h.enqueue(counterTask("k", 1, 2)) // the key is free: B takes it, and waits (server 1 is busy)
	stop1()
	eventually(t, "A put back in the queue", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending })

	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	tr := newKeyTracker(counterKeyOf, 1, 2)
	serveWith(t, h.rdb, d2, h.queue, tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	first := waitFor(t, tr.starts, "the key's first run on server 2")
	tr.noSecondStart(t, h, first, "released holder "+a.ID+" and "+b.ID+", which took the key since")
}
