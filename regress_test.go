package dedup

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Regression tests: each keeps a behaviour that once broke, named for it.

// Re-enqueueing under the same caller TaskID must not free the live task's lock.
func TestRegressionCallerIDConflictKeepsLiveLock(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}}}})
	first, err := h.client.Enqueue(counterTask("k", 1, 0), asynq.Queue(h.queue), asynq.TaskID("order-42"))
	if err != nil {
		t.Fatal(err)
	}
	key := h.keyOf(counterTask("k", 1, 0), h.queue)
	_, err = h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID("order-42"))
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		t.Fatalf("same ID again: err = %v, want asynq's ErrTaskIDConflict", err)
	}
	if owner := h.lockOwner(key); owner != first.ID {
		t.Fatalf("lock owner %q, want %q", owner, first.ID)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("third enqueue: err = %v, want duplicate of %s", err, first.ID)
	}
}

// A queue set in NewTask with RunningDefer must not create a follow-up
// without an ID (once, when the lock moved to that queue after the enqueue).
func TestRegressionRelocateNeverCreatesEmptyFollowUp(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnRunning: RunningDefer}}})
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(r run) error { <-release; return nil })
	// One worker, busy with the holder: the relocated duplicate stays pending
	// until the wrapper deletes it (an active one could not be deleted).
	h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = 1 })
	holder := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, rc.runs, "holder runs")
	// The lock is taken in NewTask's queue at once (no relocation any
	// more), so the call meets the running holder and defers behind it.
	res, err := h.client.Submit(context.Background(), asynq.NewTask("counter", counterTask("k", 1, 1).Payload(), asynq.Queue(h.queue)))
	if err != nil || res.Outcome != Deferred || !res.FollowUp || res.TaskID == "" {
		t.Fatalf("%+v, %v; want a follow-up of the running %s", res, err, holder.ID)
	}
	if n, _ := h.rdb.Exists(context.Background(), asynqTaskKeyPrefix(h.queue)).Result(); n != 0 {
		t.Fatal("a task record with an empty ID was written")
	}
	if n := h.queueSize(h.queue); n != 2 {
		t.Fatalf("queue holds %d tasks, want the running one and its follow-up", n)
	}
}

// Shutdown puts an unfinished task back even on its last attempt: the lock
// must stay.
func TestRegressionShutdownOnLastAttemptHolds(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}}}})
	rc := newRecorder(func(r run) error { <-r.ctx.Done(); return r.ctx.Err() })
	srv := h.serve(rc.handler(), func(c *asynq.Config) { c.ShutdownTimeout = 200 * time.Millisecond })
	first := h.enqueue(counterTask("k", 1, 0), asynq.MaxRetry(0))
	waitFor(t, rc.runs, "run")
	srv.Shutdown()
	eventually(t, "attempt settled", func() bool { return h.d.Stats().Held == 1 })
	if st := h.taskState(first.ID); st != asynq.TaskStatePending {
		t.Fatalf("task state %v after shutdown, want pending (requeued)", st)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("err = %v, want duplicate of the requeued %s", err, first.ID)
	}
}

// Skip with a caller-chosen ID is not locked at execution either.
func TestRegressionSkipWithCallerIDRunsUnguarded(t *testing.T) {
	h := newHarness(t, Config{})
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(r run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	p := []byte(`{"a":1}`)
	h.enqueue(asynq.NewTask("t", p))
	waitFor(t, rc.runs, "first")
	info, err := h.client.Enqueue(asynq.NewTask("t", p), asynq.Queue(h.queue), Skip(), asynq.TaskID("mine-1"))
	if err != nil {
		t.Fatal(err)
	}
	if r := waitFor(t, rc.runs, "the opted-out task runs alongside"); r.id != info.ID {
		t.Fatalf("ran %s", r.id)
	}
}

// The protobuf rewrite round-trips through asynq's decoder: headers, a
// payload needing a three-byte length, an empty payload.
func TestRegressionPayloadRewriteRoundTrip(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Key: "x", OnConflict: Replace}}})
	big := []byte(`{"key":"k","pad":"` + strings.Repeat("z", 20000) + `"}`)
	info, err := h.client.Enqueue(asynq.NewTaskWithHeaders("counter", []byte(`{}`), map[string]string{"h1": "v1", "h2": strings.Repeat("w", 300)}),
		asynq.Queue(h.queue), asynq.MaxRetry(7), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range [][]byte{big, {}, []byte("x"), big[:200]} {
		res, err := h.client.Submit(context.Background(), asynq.NewTask("counter", p), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Replaced {
			t.Fatalf("%+v %v", res, err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		delete(ti.Headers, store.HeaderLock) // (the library's own)
		if !bytes.Equal(ti.Payload, p) || ti.MaxRetry != 7 || ti.Timeout != time.Minute || ti.Retention != time.Hour || ti.ID != info.ID || len(ti.Headers) != 2 {
			t.Fatalf("round trip of %d bytes: got %d bytes, %+v", len(p), len(ti.Payload), ti)
		}
	}
}
