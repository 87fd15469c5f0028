package dedup

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// A fail hold is the archived task's, "also once an operator deletes it"
// (policies.md, OnFailure), and FailHoldUntilReleased holds "until someone
// releases it". lifecycle.md, Task IDs: "Once no task with an ID exists, the
// ID can be used again, for any key, as asynq's own client allows." So a
// caller-chosen ID whose archived task held key A, deleted by an operator
// and then used again for a task of key B, must leave key A's hold alone.
func TestFailHoldOfADeletedCallerIDSurvivesTheIDsReuseForAnotherKey(t *testing.T) {
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
		if dup := h.duplicateOf(counterTask("a", 1, 2)); !dup.FailHeld || dup.Holder != id {
			t.Fatalf("key a after its archived holder was deleted: %+v, want still failure-held by %s", dup, id)
		}
		// The ID is free in asynq again: the caller uses it for key b, which waits.
		if _, err := h.client.Enqueue(counterTask("b", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id), asynq.ProcessIn(3600e9)); err != nil {
			t.Fatalf("the deleted task's ID for another key: %v", err)
		}
		_, err := h.client.Enqueue(counterTask("a", 1, 3), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.FailHeld {
			t.Fatalf("key a once its holder's ID names a task of key b: %v (lock %q), want still failure-held until released",
				err, h.lockState(keyA))
		}
	})
}

// docs/policies.md: "Running the archived task again ... makes it the key's
// owner again: its success frees the key." So too for a task under a
// caller-chosen ID with per-call key and OnFailure options (the policy is
// recorded in the lock, "so the server needs no matching rule"): an
// operator runs the archived, failure-held task again (Inspector.RunTask),
// it succeeds, and the key is free. (Once, the failure's settle deleted the
// ID's index key, the run by hand went unguarded, and its success left the
// key held forever.)
func TestFailHeldCallerIDTaskRunAgainByHandFreesTheKeyOnSuccess(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (3 * time.Second) / 3})
	h.client = h.d.NewClient()
	fail := make(chan bool, 2)
	fail <- true
	fail <- false
	ran := make(chan string, 4)
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		if <-fail {
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	opts := []asynq.Option{asynq.Queue(h.queue), Key("invoice-7"), OnFailure(FailHoldUntilReleased, 0)}
	info, err := h.client.Enqueue(jobTask("x", 1), append(opts, asynq.TaskID("invoice-7-run"), asynq.Retention(time.Hour))...)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the failing run")
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the run by hand")
	eventually(t, "the run by hand completed", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
	if !within(3*time.Second, func() bool { _, err = h.client.Enqueue(jobTask("x", 2), opts...); return err == nil }) {
		kl, _, _ := h.d.Lookup(context.Background(), jobTask("x", 2), opts...)
		t.Fatalf("enqueue after the run by hand of %s succeeded: %v (lock: state %s, holder %s), want the key free; stats %+v",
			info.ID, err, kl.State, kl.Holder, h.d.Stats())
	}
}

// Re-enqueueing under the same caller TaskID must not free the live task's lock.
func TestCallerIDConflictKeepsTheLiveTasksLock(t *testing.T) {
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
