package dedup

import (
	"context"
	"errors"
	"testing"
	"time"

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
