package dedup

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
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
	t.Parallel()
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
			a.ID, dup.Holder, h.lockState(h.keyOf(counterTask("k", 1, 0), h.queue)), defaultHealGrace)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// A handler that returns nil a hair before its Timeout: asynq's select
// (processor.exec) may then find its context done before the handler's
// result and retry the task. The key follows what asynq makes of the
// attempt: every task asynq retries still holds its key (a release at that
// success would leave it waiting for its retry with its key free), and every
// task it completed frees it (the key's next enqueue heals a lock whose
// holder asynq has completed). A control task, far from its deadline, is
// released at its end.
func TestSuccessAtTheDeadlineFollowsWhatAsynqMakesOfTheAttempt(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{heartbeat: (600 * time.Millisecond) / 3, Rules: counterRules(Rule{}).Rules})
	const n = 30
	rc := newRecorder(func(r run) error {
		dl, _ := r.ctx.Deadline()
		seq := decodeCounter(r.task).Seq
		if seq >= 1000 { // control: returns nil well before the deadline
			return nil
		}
		// Return nil between 0 and ~3 ms before the deadline.
		time.Sleep(time.Until(dl) - time.Duration(seq)*100*time.Microsecond)
		return nil
	})
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.Concurrency = n
		retryInAnHour(c)
	})
	ids := make([]string, n)
	for i := range n {
		ids[i] = h.enqueue(counterTask(fmt.Sprint("k", i), 1, i), asynq.Timeout(time.Second), asynq.Retention(time.Hour)).ID
	}
	ctl := h.enqueue(counterTask("control", 1, 1000), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
	for range n + 1 {
		waitFor(t, rc.runs, "run")
	}
	h.settled(n + 1)
	eventually(t, "the control task completes", func() bool { return h.taskState(ctl.ID) == asynq.TaskStateCompleted })
	eventually(t, "the control task's key is free", func() bool {
		return h.lockOwner(h.keyOf(counterTask("control", 1, 1000), h.queue)) == ""
	})
	eventually(t, "asynq moved every task on", func() bool {
		for _, id := range ids {
			if st := h.taskState(id); st != asynq.TaskStateRetry && st != asynq.TaskStateCompleted {
				return false
			}
		}
		return true
	})
	eventually(t, "completed tasks free their keys", func() bool {
		for i, id := range ids {
			key := h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
			if h.taskState(id) == asynq.TaskStateCompleted && h.lockOwner(key) == id && h.lockState(key) != store.LockOrphaned {
				return false
			}
		}
		return true
	})
	var retried, lost, stuck int
	for i, id := range ids {
		key := h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
		owner := h.lockOwner(key)
		switch h.taskState(id) {
		case asynq.TaskStateRetry:
			retried++
			if owner != id {
				lost++
				info, err := h.client.Enqueue(counterTask(fmt.Sprint("k", i), 1, 100+i), asynq.Queue(h.queue))
				t.Errorf("task %s (returned nil %dµs before its deadline) waits for asynq's retry, but its lock owner is %q; a new enqueue of its key: %v %v",
					id, i*100, owner, info != nil, err)
			}
		case asynq.TaskStateCompleted:
			if owner == id && h.lockState(key) != store.LockOrphaned {
				stuck++
				t.Errorf("task %s (returned nil %dµs before its deadline) completed, but still holds its key", id, i*100)
			}
		}
	}
	t.Logf("%d of %d tasks retried by asynq; %d of them lost their lock; %d completed tasks still hold theirs", retried, n, lost, stuck)
}
