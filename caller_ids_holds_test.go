package dedup

import (
	"errors"
	"testing"

	"github.com/hibiken/asynq"
)

// A failure hold is the archived task's, "also once an operator deletes it"
// (policies.md, OnFailure), and FailHoldUntilReleased holds "until someone
// releases it". lifecycle.md, Task IDs: "Once no task with an ID exists, the
// ID can be used again, for any key, as asynq's own client allows." So a
// caller-chosen ID whose archived task held key A, deleted by an operator
// and then used again for a task of key B, must leave key A's hold alone.
func TestFailureHoldOfADeletedCallerIDSurvivesTheIDsReuseForAnotherKey(t *testing.T) {
	bothPaths(t, counterRules(Rule{OnFailure: FailHoldUntilReleased}), func(t *testing.T, h *harness) {
		id := "job-" + uniq(t)
		rc := newRecorder(func(r run) error {
			if decodeCounter(r.task).Key == "a" {
				return errors.New("failed for good")
			}
			return nil
		})
		h.serve(rc.handler(), nil)
		h.enqueue(counterTask("a", 1, 1), asynq.TaskID(id), asynq.MaxRetry(0))
		eventually(t, "asynq archives the task of key a", func() bool { return h.taskState(id) == asynq.TaskStateArchived })
		keyA := h.keyOf(counterTask("a", 1, 1), h.queue)
		eventually(t, "key a failure-held", func() bool { return h.lockState(keyA) == "failed" })
		if err := h.insp.DeleteTask(h.queue, id); err != nil { // the operator tidies the archive
			t.Fatal(err)
		}
		if dup := h.duplicateOf(counterTask("a", 1, 2)); !dup.Failed || dup.TaskID != id {
			t.Fatalf("key a after its archived holder was deleted: %+v, want still failure-held by %s", dup, id)
		}
		// The ID is free in asynq again: the caller uses it for key b, which waits.
		if _, err := h.client.Enqueue(counterTask("b", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id), asynq.ProcessIn(3600e9)); err != nil {
			t.Fatalf("the deleted task's ID for another key: %v", err)
		}
		_, err := h.client.Enqueue(counterTask("a", 1, 3), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.Failed {
			t.Fatalf("key a once its holder's ID names a task of key b: %v (lock %q), want still failure-held until released",
				err, h.lockState(keyA))
		}
	})
}
