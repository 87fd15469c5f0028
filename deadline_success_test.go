package dedup

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
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

// noted signals, on each, every library extend call that wrote a note that
// a handler may outlive its attempt (an extend with a note argument), once
// Redis has answered it.
type noted struct{ each chan struct{} }

func newNoted() *noted { return &noted{each: make(chan struct{}, 16)} }

// wait returns once a note was written, or an error if the attempt's
// deadline came first.
func (n *noted) wait(ctx context.Context) error {
	select {
	case <-n.each:
		return nil
	case <-ctx.Done():
		return errors.New("not noted before the deadline")
	}
}

func (n *noted) isNote(cmd redis.Cmder) bool {
	// extend.lua's ARGV[4], the attempt's token in its note, follows the
	// script, numkeys, 4 keys and 3 arguments.
	a := cmd.Args()
	if cmd.Err() != nil || !isScript(cmd, "extend") || len(a) < 11 {
		return false
	}
	return fmt.Sprint(a[10]) != ""
}

func (n *noted) DialHook(next redis.DialHook) redis.DialHook { return next }
func (n *noted) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && n.isNote(cmd) {
			n.each <- struct{}{}
		}
		return err
	}
}
func (n *noted) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			if n.isNote(c) {
				n.each <- struct{}{}
			}
		}
		return err
	}
}

// modeFields returns the key's mode record.
func (h *harness) modeFields(lock string) map[string]string {
	h.t.Helper()
	m, err := h.rdb.HGetAll(context.Background(), store.ModeOf(lock)).Result()
	if err != nil {
		h.t.Fatal(err)
	}
	return m
}

// A plain task (NewClient, Reject) whose handler is still running
// LockTimeout before its deadline is noted (it may outlive its attempt);
// it then succeeds, before the deadline. Its success frees the key as any
// success does, counted released; the note goes with the handler's end, and
// leaves nothing that holds the key.
func TestSuccessAfterTheDeadlineNoteFreesTheKey(t *testing.T) {
	t.Parallel()
	// (asynq keeps a Timeout in whole seconds: a Timeout below LockTimeout
	// takes a LockTimeout above 1 s.)
	for name, timeout := range map[string]time.Duration{"in the last LockTimeout": 3 * time.Second, "Timeout below LockTimeout": time.Second} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rdb := newRDB(t)
			n := newNoted()
			rdb.AddHook(n)
			cfg := jobRules(Rule{})
			cfg.LockTimeout = 2 * time.Second
			h := newHarnessOn(t, rdb, cfg)
			h.client = h.d.NewClient()
			h.serve(func(ctx context.Context, _ *asynq.Task) error {
				return n.wait(ctx)
			}, retryInAnHour)
			info := h.enqueue(jobTask("s", 1), asynq.Timeout(timeout), asynq.Retention(time.Hour))
			eventually(t, "asynq completes the task", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
			lock := h.keyOf(jobTask("s", 1), h.queue)
			if o := h.lockOwner(lock); o != "" && h.lockState(lock) != store.LockOrphaned {
				t.Errorf("after the success the lock names %q (%s)", o, h.lockState(lock))
			}
			if m := h.modeFields(lock); m["o"] != "" || m["oa"] != "" {
				t.Errorf("the note outlives the handler: mode record %v", m)
			}
			next, err := h.client.Enqueue(jobTask("s", 2), asynq.Queue(h.queue))
			if err != nil {
				t.Fatalf("the key's next enqueue after the success: %v", err)
			}
			if s := h.d.Stats(); s.Released != 1 || s.Held != 0 || s.LockLost != 0 || s.RedisErrors != 0 || s.Processed != 1 {
				t.Errorf("stats %+v, want one released, processed", s)
			}
			_ = next
		})
	}
}

// byAttempt is a handler that, for the attempts of payload 1 (by retry
// count) listed in atNote, waits for the deadline note and then returns what
// atNote says (nil: success); other runs return nil at once. Each run's
// payload n is sent on runs.
func byAttempt(n *noted, atNote map[int]error, runs chan<- int) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		retry, _ := asynq.GetRetryCount(ctx)
		if runs != nil {
			runs <- decodeJob(t).N
		}
		res, ok := atNote[retry]
		if !ok || decodeJob(t).N != 1 {
			return nil
		}
		if err := n.wait(ctx); err != nil {
			return err
		}
		return res
	}
}

// noteHarness is a harness over jobTask whose Redis signals the deadline
// notes (LockTimeout 2 s).
func noteHarness(t *testing.T, r Rule) (*harness, *noted) {
	t.Helper()
	rdb := newRDB(t)
	n := newNoted()
	rdb.AddHook(n)
	cfg := jobRules(r)
	cfg.LockTimeout = 2 * time.Second
	h := newHarnessOn(t, rdb, cfg)
	h.client = h.d.NewClient()
	return h, n
}

// An execution-guard task (asynq's own client, under a rule) whose success
// comes after its deadline note: its key frees for the key's next enqueue
// and for the next task that arrives without a lock, and nothing holds it.
func TestArrivalSuccessAfterTheDeadlineNoteLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	for name, timeout := range map[string]time.Duration{"in the last LockTimeout": 3 * time.Second, "Timeout below LockTimeout": time.Second} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h, n := noteHarness(t, Rule{})
			runs := make(chan int, 8)
			h.serve(byAttempt(n, map[int]error{0: nil}, runs), retryInAnHour)
			a, err := h.asynq.Enqueue(jobTask("g", 1), asynq.Queue(h.queue), asynq.Timeout(timeout), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			waitFor(t, runs, "the arrival runs")
			eventually(t, "asynq completes it", func() bool { return h.taskState(a.ID) == asynq.TaskStateCompleted })
			lock := h.keyOf(jobTask("g", 1), h.queue)
			if m := h.modeFields(lock); m["o"] != "" {
				t.Errorf("the note outlives the handler: %v", m)
			}
			b, err := h.asynq.Enqueue(jobTask("g", 2), asynq.Queue(h.queue), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			if got := waitFor(t, runs, "a second arrival runs"); got != 2 {
				t.Fatalf("ran %d, want 2", got)
			}
			eventually(t, "asynq completes the second", func() bool { return h.taskState(b.ID) == asynq.TaskStateCompleted })
			eventually(t, "no lock is left", func() bool { return h.lockOwner(lock) == "" || h.lockState(lock) == store.LockOrphaned })
			if _, err := h.client.Enqueue(jobTask("g", 3), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("the key's next enqueue: %v", err)
			}
			if s := h.d.Stats(); s.Busy != 0 || s.LockLost != 0 || s.RedisErrors != 0 {
				t.Errorf("stats %+v", s)
			}
		})
	}
}
