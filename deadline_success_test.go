package dedup

import (
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// lifecycle.md, "What changed": "A handler that returns within LockTimeout
// of its deadline may still be retried by asynq … A lock that the
// middleware would release at that success (WrapClient's, or one taken at
// start) is then left to asynq's record: the key's next enqueue finds the
// task completed and heals it at once." A task without Retention has no
// record once completed; its WrapClient lock, taken moments before, must
// still heal at once, not wait out HealGrace as a task not stored yet.
func TestWrapClientSuccessNearItsDeadlineFreesTheKeyAtOnce(t *testing.T) {
	h := newHarness(t, counterRules(Rule{})) // WrapClient
	rc := newRecorder(func(r run) error {
		dl, _ := r.ctx.Deadline()
		// Returns nil well inside LockTimeout (1 s) of the deadline, but early
		// enough that asynq sees the success before the deadline.
		time.Sleep(time.Until(dl) - 300*time.Millisecond)
		return nil
	})
	h.serve(rc.handler(), retryInAnHour)
	a := h.enqueue(counterTask("k", 1, 0), asynq.Timeout(time.Second))
	waitFor(t, rc.runs, "the task runs")
	h.settled(1)
	eventually(t, "asynq completes the task (no retention: its record goes)", func() bool { return h.taskState(a.ID) == 0 })
	_, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if errors.As(err, &dup) {
		t.Fatalf("the key's next enqueue after %s succeeded: duplicate of %s (lock %q): the lock waits out HealGrace (%v) instead of healing at once",
			a.ID, dup.TaskID, h.lockState(h.keyOf(counterTask("k", 1, 0), h.queue)), DefaultHealGrace)
	}
	if err != nil {
		t.Fatal(err)
	}
}
