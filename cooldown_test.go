package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// digest is the weekly-digest task of the cooldown tests, keyed on user_id.
func digest(user, seq int) *asynq.Task {
	return asynq.NewTask("digest:weekly", fmt.Appendf(nil, `{"user_id":%d,"seq":%d}`, user, seq))
}

var digestRule = Rule{Fields: []string{"user_id"}, Cooldown: time.Hour}

// coolingDup enqueues through c and asserts a cooling duplicate of holder.
func coolingDup(t *testing.T, c *Client, task *asynq.Task, queue, holder string, opts ...asynq.Option) *DuplicateTaskError {
	t.Helper()
	_, err := c.Enqueue(task, append([]asynq.Option{asynq.Queue(queue)}, opts...)...)
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue: %v, want a DuplicateTaskError", err)
	}
	if dup.TaskID != holder || !dup.CoolingDown || dup.FreeIn <= 0 || dup.FreeIn > time.Hour {
		t.Fatalf("duplicate %+v, want task %s cooling down for (0, 1h]", dup, holder)
	}
	return dup
}

// After the task succeeds the key stays held for the cooldown, on both
// enqueue paths and whatever the conflict policy; Lookup says cooling; a
// task of the key arriving without a lock is dropped, not run; Release
// ends the cooldown early.
func TestCooldownHoldsTheKeyAfterSuccess(t *testing.T) {
	var (
		mu        sync.Mutex
		decisions []Decision
	)
	replace := digestRule
	replace.OnConflict = Replace // nothing to fold into once the task is done
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": replace},
		OnDecision: func(d Decision) { mu.Lock(); decisions = append(decisions, d); mu.Unlock() }})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	for _, direct := range []bool{false, true} {
		c := h.client
		if direct {
			c = h.d.NewClient()
		}
		user := 1
		if direct {
			user = 2
		}
		first, err := c.Enqueue(digest(user, 1), asynq.Queue(h.queue))
		if err != nil {
			t.Fatal(err)
		}
		if r := waitFor(t, rc.runs, "the digest runs"); r.id != first.ID {
			t.Fatalf("ran %s, want %s", r.id, first.ID)
		}
		h.settled(uint64(user))
		coolingDup(t, c, digest(user, 2), h.queue, first.ID)
		coolingDup(t, c, digest(user, 3), h.queue, first.ID, asynq.ProcessIn(time.Minute))
		kl, found, err := h.d.Lookup(context.Background(), digest(user, 4), asynq.Queue(h.queue))
		if err != nil || !found || kl.State != "cooling" || kl.Holder != first.ID || kl.TTL <= 0 {
			t.Fatalf("Lookup: %+v %v %v, want cooling, held by %s", kl, found, err, first.ID)
		}
	}
	if s := h.d.Stats(); s.Cooling != 2 || s.Released != 0 {
		t.Fatalf("stats: cooling %d, released %d; want 2 and 0", s.Cooling, s.Released)
	}

	// Scheduler-style arrival: dropped (completed, never run).
	arrival, err := h.asynq.Enqueue(digest(1, 9), asynq.Queue(h.queue), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the arrival is done", func() bool { return h.taskState(arrival.ID) == asynq.TaskStateCompleted })
	select {
	case r := <-rc.runs:
		t.Fatalf("%s ran while its key cooled down", r.id)
	default:
	}
	mu.Lock()
	last := decisions[len(decisions)-1]
	mu.Unlock()
	if last.Event != "busy" || !last.Dropped || !last.CoolingDown {
		t.Fatalf("last decision %+v, want a dropped busy arrival at a cooling key", last)
	}

	// Release ends the cooldown.
	if ok, err := h.d.Release(context.Background(), digest(1, 0), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	if _, err := h.client.Enqueue(digest(1, 10), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after Release: %v", err)
	}
}

// The cooldown counts from the enqueue, and the key frees when it ends.
func TestCooldownEndsOnTime(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}}}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	const cool = 1500 * time.Millisecond
	first := h.enqueue(digest(1, 1), Cooldown(cool))
	waitFor(t, rc.runs, "the digest runs")
	h.settled(1)
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	eventually(t, "the cooldown ends", func() bool { return len(h.locks()) == 0 })
	h.enqueue(digest(1, 3))
}

// Only success cools down: a task that fails for good, is revoked or
// archived frees the key as it would without a cooldown.
func TestCooldownOnlyAfterSuccess(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(func(r run) error {
		if r.id != "" && string(r.task.Payload()) == `{"user_id":1,"seq":1}` {
			return fmt.Errorf("no: %w", asynq.SkipRetry)
		}
		return asynq.RevokeTask
	})
	h.serve(rc.handler(), nil)
	h.enqueue(digest(1, 1))
	h.enqueue(digest(2, 1))
	waitFor(t, rc.runs, "first run")
	waitFor(t, rc.runs, "second run")
	h.settled(2)
	h.enqueue(digest(1, 2), asynq.ProcessIn(time.Hour))
	h.enqueue(digest(2, 2), asynq.ProcessIn(time.Hour))
	if s := h.d.Stats(); s.Cooling != 0 {
		t.Fatalf("%d locks cooled down after failures", s.Cooling)
	}
}

// A failed attempt holds the key for its retry (a duplicate names the
// task, not cooling yet); the retry's success starts the cooldown.
func TestCooldownSurvivesARetry(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	failed := make(chan struct{})
	retry := make(chan struct{})
	rc := newRecorder(func(r run) error {
		if r.retry == 0 {
			return errors.New("transient")
		}
		<-retry
		return nil
	})
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.ErrorHandler = asynq.ErrorHandlerFunc(func(context.Context, *asynq.Task, error) { close(failed) })
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Second }
	})
	first := h.enqueue(digest(1, 1))
	<-failed
	dup := h.duplicateOf(digest(1, 2))
	if dup.TaskID != first.ID || dup.CoolingDown {
		t.Fatalf("during the retry wait: %+v, want a plain duplicate of %s", dup, first.ID)
	}
	if r := waitFor(t, rc.runs, "first run"); r.retry != 0 {
		t.Fatalf("first run has retry %d", r.retry)
	}
	if r := waitFor(t, rc.runs, "the retry"); r.retry != 1 || r.id != first.ID {
		t.Fatalf("retry: %+v", r)
	}
	close(retry)
	eventually(t, "the retry settles", func() bool { return h.d.Stats().Cooling == 1 })
	coolingDup(t, h.client, digest(1, 3), h.queue, first.ID)
}

// Cooldown is refused where it would break its promise, before any lock.
func TestCooldownAndDebounceRefusedWhereTheyCannotHold(t *testing.T) {
	for name, r := range map[string]Rule{
		"cooldown+allow":    {Cooldown: time.Minute, OnRunning: RunningAllow},
		"cooldown+defer":    {Cooldown: time.Minute, OnRunning: RunningDefer},
		"debounce+reject":   {Debounce: time.Minute},
		"debounce+defer":    {Debounce: time.Minute, OnConflict: Replace, OnRunning: RunningDefer},
		"negative cooldown": {Cooldown: -time.Second},
	} {
		if _, err := New(context.Background(), newRDB(t), Config{Prefix: "dd-" + uniq(t), Logger: quietLogger(), Rules: map[string]Rule{"x": r}}); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: New: %v, want ErrInvalidOption", name, err)
		}
	}
	h := newHarness(t, Config{Rules: map[string]Rule{"allow": {OnRunning: RunningAllow}}})
	for name, opts := range map[string][]asynq.Option{
		"Cooldown(0)":             {Cooldown(0)},
		"Debounce(-1)":            {Debounce(-time.Second)},
		"Cooldown on allow":       {Cooldown(time.Minute)},
		"Debounce without a fold": {Debounce(time.Minute)},
	} {
		_, err := h.client.Enqueue(asynq.NewTask("allow", []byte("p")), append(opts, asynq.Queue(h.queue))...)
		if !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
	if n := len(h.locks()); n != 0 || h.queueSize(h.queue) != 0 {
		t.Fatalf("refused calls left %d locks, %d tasks", n, h.queueSize(h.queue))
	}
}
