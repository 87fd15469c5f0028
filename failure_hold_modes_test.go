package dedup

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// A fail hold needs a key to hold: RunningAllow frees the key as its task
// starts, so the mix is refused (configuration.md, supported combinations),
// as a rule and per call, before anything is locked or stored.
func TestFailHoldWithRunningAllowIsRefused(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnRunning: RunningAllow}))
	if _, err := New(context.Background(), h.rdb, counterRules(Rule{OnRunning: RunningAllow, OnFailure: FailHold, FailHoldFor: time.Hour})); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("a rule with RunningAllow and FailHold: %v, want ErrInvalidOption", err)
	}
	_, err := h.client.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue), OnFailure(FailHoldUntilReleased, 0))
	if !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("a call with RunningAllow and FailHoldUntilReleased: %v, want ErrInvalidOption", err)
	}
	if ls := h.locks(); len(ls) != 0 || h.queueSize(h.queue) != 0 {
		t.Fatalf("a refused call left locks %v and %d tasks", ls, h.queueSize(h.queue))
	}
}

// policies.md, OnFailure: "A final failure is an attempt asynq archives the
// task after: an error on the last retry, SkipRetry, a panic on the last
// retry, … an attempt asynq gave up on its last retry". failures.md: "a
// handler outlives its Timeout or a CancelProcessing … on the last retry a
// final failure (… OnFailure may hold it)". Inspector.CancelProcessing on
// the last retry makes asynq archive the task; its handler then fails.
func TestFailHoldHoldsWhenCancelProcessingEndsTheLastRetry(t *testing.T) {
	bothPaths(t, counterRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}), func(t *testing.T, h *harness) {
		release := make(chan struct{})
		rc := newRecorder(func(run) error { <-release; return errors.New("crm: 503") })
		h.serve(rc.handler(), nil)
		a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
		waitFor(t, rc.runs, "the task runs")
		h.cancelUntil(a.ID, "asynq archives the cancelled task", asynq.TaskStateArchived)
		close(release) // the handler ignored the cancellation, and fails
		h.settled(1)
		_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.FailHeld || dup.Holder != a.ID {
			t.Fatalf("enqueue after asynq archived the cancelled last attempt: %v (stats %+v), want a failure-held duplicate of %s", err, h.d.Stats(), a.ID)
		}
	})
}
