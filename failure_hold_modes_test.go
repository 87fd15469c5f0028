package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
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

// lifecycle.md: a fail hold holds "until released (or the task is run again
// by hand and succeeds)"; policies.md, Cooldown: "The lock lasts at least
// until the cooldown ends, on every path". A kept task (NewClient's own ID)
// that failed for good on its first attempt (SkipRetry) under a FailHold
// shorter than its cooldown, run again by hand, succeeds: its key cools
// until the cooldown's end, and is not freed when the fail hold would have
// ended.
func TestKeptCooldownTaskRunByHandAfterAFailHoldCoolsItsWholeCooldown(t *testing.T) {
	t.Parallel()
	h, _ := failedThenRunByHand(t, Rule{Fields: []string{"user_id"}, Cooldown: time.Hour, OnFailure: FailHold, FailHoldFor: time.Second})
	succeeded := time.Now()
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue)); !errors.As(err, &dup) || !dup.CoolingDown || dup.FreeIn < 59*time.Minute {
		t.Fatalf("enqueue after its success: %v, want cooling for about an hour", err)
	}
	// Past the moment the fail hold (1 s from the failure) would have ended.
	if within(3*time.Second, func() bool {
		_, err := h.client.Enqueue(digest(1, 3), asynq.Queue(h.queue))
		return err == nil
	}) {
		t.Fatalf("the key was free %v after its success, inside a cooldown that had %v left", time.Since(succeeded), dup.FreeIn)
	}
}

// A fail hold lasts "until released (or the task is run again by hand and
// succeeds)"; deleting a kept task's completed record "ends its cooldown".
// A kept task held by FailHoldUntilReleased after it failed for good on its
// first attempt, run again by hand, succeeds and cools its key; once an
// operator deletes its completed record (if asynq keeps one) the key is not
// held again by the failure its success ended.
func TestKeptCooldownTaskRunByHandAfterAFailHoldIsNotFailHeldOnceItsRecordGoes(t *testing.T) {
	t.Parallel()
	h, first := failedThenRunByHand(t, Rule{Fields: []string{"user_id"}, Cooldown: time.Hour, OnFailure: FailHoldUntilReleased})
	if h.taskState(first.ID) == asynq.TaskStateCompleted { // (kept by its Retention)
		if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
			t.Fatal(err)
		}
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue)); errors.As(err, &dup) && dup.FailHeld {
		t.Fatalf("enqueue once the succeeded task's record is gone: %v, want the key cooling or free, not held by the failure", err)
	}
}

// failedThenRunByHand enqueues a digest through NewClient under rule, whose
// first attempt fails for good (SkipRetry); once asynq archived it, runs it
// again by hand, and returns when that run succeeded and asynq recorded it.
func failedThenRunByHand(t *testing.T, rule Rule) (*harness, *asynq.TaskInfo) {
	t.Helper()
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": rule}})
	h.client = h.d.NewClient()
	var fixed atomic.Bool
	rc := newRecorder(func(run) error {
		if !fixed.Load() {
			return fmt.Errorf("crm down: %w", asynq.SkipRetry)
		}
		return nil
	})
	h.serve(rc.handler(), nil)
	first := h.enqueue(digest(1, 1))
	waitFor(t, rc.runs, "the digest runs, and fails for good")
	eventually(t, "asynq archives it", func() bool { return h.taskState(first.ID) == asynq.TaskStateArchived })
	fixed.Store(true)
	if err := h.insp.RunTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "the digest runs again, by hand")
	eventually(t, "asynq records its success", func() bool { return h.finished(first.ID) })
	return h, first
}
