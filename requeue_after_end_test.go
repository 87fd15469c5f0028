package dedup

import (
	"context"
	"sync"
	"testing"
	"time"

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

// Cooldown: the success cooled the key; a shutdown then requeues the task.
// "A handler that succeeded after all cools its key (Cooldown): the retry
// that follows finds its own cooling key and does not run again"; at most one
// successful run per window.
func TestCooledTaskRequeuedAfterItsSuccessDoesNotRunAgain(t *testing.T) {
	h := newDirectHarness(t, Rule{Cooldown: time.Hour})
	ended := make(chan string, 1)
	stop := slowOuterServer(t, h, func(context.Context, *asynq.Task) error { return nil }, ended)
	a := h.enqueue(counterTask("k", 1, 0))
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
	eventually(t, "asynq is done with the requeued task", func() bool {
		st := h.taskState(a.ID)
		return st == asynq.TaskStateCompleted || st == 0
	})
	if len(rc.runs) > 0 {
		r := <-rc.runs
		t.Fatalf("the cooled task %s ran again (retry %d) inside its cooldown", r.id, r.retry)
	}
	if st := h.lockState(key); st != "cooling" {
		t.Fatalf("lock %q, want still cooling", st)
	}
}

// WrapClient: asynq's client stored the task, whose record does not name its
// lock, so the middleware releases the lock at the success. A shutdown then
// requeues the task: it waits again without a lock, the key's next enqueue
// is accepted, and the two run at once ("never two live tasks holding one
// key", "never two handlers of a key running at once").
func TestWrapClientTaskRequeuedAfterItsReleaseNeverRunsBesideTheKeysNextTask(t *testing.T) {
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
