package dedup

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// policies.md, OnFailure: "The held key answers enqueues with a
// *DuplicateTaskError whose Failed is set"; docs/batch.md: EnqueueBatch
// answers each task as Submit would. A batch into a failure-held key and a
// cooling key gets the same answers as single calls.
func TestEnqueueBatchAnswersFailHeldAndCoolingKeysAsSubmitDoes(t *testing.T) {
	bothPaths(t, counterRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour, Cooldown: time.Hour}), func(t *testing.T, h *harness) {
		rc := newRecorder(func(r run) error {
			if decodeCounter(r.task).Key == "fails" {
				return fmt.Errorf("no: %w", asynq.SkipRetry)
			}
			return nil
		})
		h.serve(rc.handler(), nil)
		failed := h.enqueue(counterTask("fails", 1, 1))
		cooled := h.enqueue(counterTask("cools", 1, 1))
		eventually(t, "both keys held past their tasks", func() bool {
			return h.lockState(h.keyOf(counterTask("fails", 1, 1), h.queue)) == "failed" &&
				h.lockState(h.keyOf(counterTask("cools", 1, 1), h.queue)) == "cooling"
		})
		h.asynqDone() // (until asynq archives it, the failed task reads as running to a take)
		res := h.client.EnqueueBatch(context.Background(), []*asynq.Task{counterTask("fails", 1, 2), counterTask("cools", 1, 2)}, asynq.Queue(h.queue))
		var d0, d1 *DuplicateTaskError
		if !errors.As(res[0].Err, &d0) || !d0.FailHeld || d0.Holder != failed.ID || d0.FreeIn <= 59*time.Minute {
			t.Errorf("batch into the failure-held key: %+v, want Failed naming %s with about an hour left", res[0].Err, failed.ID)
		}
		if !errors.As(res[1].Err, &d1) || !d1.CoolingDown || d1.Holder != cooled.ID || d1.FreeIn <= 59*time.Minute {
			t.Errorf("batch into the cooling key: %+v, want CoolingDown naming %s with about an hour left", res[1].Err, cooled.ID)
		}
		for i, r := range res {
			if !errors.Is(r.Err, asynq.ErrDuplicateTask) || !errors.Is(r.Err, ErrDuplicateTask) {
				t.Errorf("task %d: %v, want it to match both ErrDuplicateTask sentinels", i, r.Err)
			}
		}
	})
}

// policies.md, Cooldown: "The lock lasts at least until the cooldown ends,
// on every path (waiting, running, retrying)"; lifecycle.md: "other error or
// panic, retries left | held for RetryDelayFunc(n) + TTL … the panic goes on
// to asynq". A panic keeps the key for the retry, whose success cools it
// for what is left of the cooldown counted from the take.
func TestCooldownKeyHeldAcrossAPanicAndCooledByTheRetrysSuccess(t *testing.T) {
	t.Parallel()
	bothPaths(t, counterRules(Rule{Cooldown: time.Hour, TTL: time.Second}), func(t *testing.T, h *harness) {
		rc := newRecorder(func(r run) error {
			if r.retry == 0 {
				panic("boom")
			}
			return nil
		})
		h.serve(rc.handler(), nil)
		taken := time.Now()
		a := h.enqueue(counterTask("k", 1, 1))
		waitFor(t, rc.runs, "the attempt that panics")
		waitFor(t, rc.runs, "the retry")
		key := h.keyOf(counterTask("k", 1, 1), h.queue)
		eventually(t, "the key cools", func() bool { return h.lockState(key) == "cooling" })
		dup := h.duplicateOf(counterTask("k", 1, 2))
		if !dup.CoolingDown || dup.Holder != a.ID {
			t.Fatalf("after the retry's success: %+v, want cooling, naming %s", dup, a.ID)
		}
		if left := time.Until(taken.Add(time.Hour)); dup.FreeIn > left+time.Second || dup.FreeIn < left-5*time.Second {
			t.Fatalf("FreeIn %v, want the cooldown's rest from the take, about %v", dup.FreeIn, left)
		}
	})
}
