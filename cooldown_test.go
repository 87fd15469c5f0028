package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// digest is the weekly-digest task of the cooldown tests, keyed on user_id.
func digest(user, seq int) *asynq.Task {
	return asynq.NewTask("digest:weekly", fmt.Appendf(nil, `{"user_id":%d,"seq":%d}`, user, seq))
}

var digestRule = Rule{Fields: []string{"user_id"}, Cooldown: time.Hour}

// coolingDup enqueues through c and asserts a cooling duplicate of holder.
//
// A key kept by asynq's record of its holder's success (NewClient's own
// IDs) cools once asynq records it, moments after the handler returned:
// until then the answer names the holder, held; it is asked again.
func coolingDup(t *testing.T, c *Client, task *asynq.Task, queue, holder string, opts ...asynq.Option) *DuplicateTaskError {
	t.Helper()
	var dup *DuplicateTaskError
	var err error
	eventually(t, "the key cools, or its enqueue is not refused by its holder", func() bool {
		_, err = c.Enqueue(task, append([]asynq.Option{asynq.Queue(queue)}, opts...)...)
		return !errors.As(err, &dup) || dup.Holder != holder || dup.CoolingDown
	})
	if !errors.As(err, &dup) || !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue: %v, want a DuplicateTaskError", err)
	}
	if dup.Holder != holder || !dup.CoolingDown || dup.FreeIn <= 0 || dup.FreeIn > time.Hour {
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
	t.Parallel()
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
	h.asynqDone()
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
	if dup.Holder != first.ID || dup.CoolingDown {
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

// A handler that succeeds within its Timeout, but closer to its deadline
// than LockTimeout (1 s), is settled "as given up" and rechecked later. Its
// success must still start the cooldown: the README's matrix says success
// means "duplicate, CoolingDown", and only deadlines that actually passed
// count as failures.
func TestCooldownStartsAfterASuccessCloseToTheDeadline(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{heartbeat: (600 * time.Millisecond) / 3, Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(func(r run) error {
		dl, ok := r.ctx.Deadline()
		if !ok {
			return errors.New("no deadline")
		}
		select { // the time under test: succeed 400 ms before the deadline
		case <-time.After(time.Until(dl) - 400*time.Millisecond):
			return nil
		case <-r.ctx.Done():
			return r.ctx.Err()
		}
	})
	h.serve(rc.handler(), nil)
	first := h.enqueue(digest(1, 1), asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
	waitFor(t, rc.runs, "the digest runs")
	eventually(t, "asynq completes the digest", func() bool { return h.taskState(first.ID) == asynq.TaskStateCompleted })
	ctx := context.Background()
	eventually(t, "the lock is settled (cooling, or released by the recheck)", func() bool {
		kl, found, err := h.d.Lookup(ctx, digest(1, 0), asynq.Queue(h.queue))
		return err == nil && (!found || kl.State == "cooling")
	})
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
}

// A lock the Client moves to the queue its task landed in (an Enqueuer that
// changes the queue) must keep the call's cooldown: the task's success then
// cools the key.
func TestCooldownSurvivesLockRelocation(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	c := h.d.WrapClient(queueMover{c: h.asynq, q: h.queue})
	other := "elsewhere-" + uniq(t)
	first, err := c.Enqueue(digest(1, 1), asynq.Queue(other))
	if err != nil {
		t.Fatal(err)
	}
	if first.Queue != h.queue {
		t.Fatalf("landed in %q, want %q", first.Queue, h.queue)
	}
	if r := waitFor(t, rc.runs, "the digest runs"); r.id != first.ID {
		t.Fatalf("ran %s, want %s", r.id, first.ID)
	}
	h.settled(1)
	// The key in the queue where the task ran cools down: a direct enqueue there is refused.
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
}

// A duplicate that meets a cooling key after its lock was moved (the task
// landed in another queue) must say CoolingDown, as every other enqueue of
// a cooling key does ("whatever the conflict policy").
func TestCooldownRelocatedDuplicateSaysCoolingDown(t *testing.T) {
	var (
		mu        sync.Mutex
		decisions []Decision
	)
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule},
		OnDecision: func(d Decision) { mu.Lock(); decisions = append(decisions, d); mu.Unlock() }})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	first := h.enqueue(digest(1, 1))
	waitFor(t, rc.runs, "the digest runs")
	h.settled(1)
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)

	// Paused: a worker that took the moved task first would leave it to meet
	// its key when it starts (relocate.go), and the call would say created.
	if err := h.insp.PauseQueue(h.queue); err != nil {
		t.Fatal(err)
	}
	c := h.d.WrapClient(queueMover{c: h.asynq, q: h.queue})
	_, err := c.Enqueue(digest(1, 3), asynq.Queue("elsewhere-"+uniq(t)))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) {
		t.Fatalf("enqueue landing in the cooling key's queue: %v, want a DuplicateTaskError", err)
	}
	if dup.Holder != first.ID || !dup.CoolingDown || dup.FreeIn <= 0 {
		t.Errorf("duplicate %+v, want CoolingDown after %s with FreeIn > 0", dup, first.ID)
	}
	mu.Lock()
	last := decisions[len(decisions)-1]
	mu.Unlock()
	if !last.CoolingDown {
		t.Errorf("last decision %+v, want CoolingDown", last)
	}
	if n := h.queueSize(h.queue); n != 0 {
		t.Errorf("%d tasks left in the queue, want the duplicate taken back out", n)
	}
}

// A Replace call must never fold into the task of a cooling key: the key's
// task is done, and whatever waits under that ID is dropped when it
// arrives (the lockless arrival rule). Here a plain asynq client reuses the
// succeeded task's caller-chosen ID (asynq deleted its record), and a
// Replace enqueue of the key comes next from the same process (which
// remembers the holder).
func TestCooldownKeyIsNeverFoldedIntoByReplace(t *testing.T) {
	rule := digestRule
	rule.OnConflict = Replace
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": rule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	id := "digest-user-1-" + uniq(t)
	first := h.enqueue(digest(1, 1), asynq.TaskID(id))
	waitFor(t, rc.runs, "the digest runs")
	h.settled(1)
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	eventually(t, "asynq drops the done task's record", func() bool { return h.taskState(id) == 0 })

	// Another service reuses the ID for a task due later.
	if _, err := h.asynq.Enqueue(digest(1, 3), asynq.Queue(h.queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}
	res, err := h.client.Submit(context.Background(), digest(1, 4), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || !dup.CoolingDown {
		t.Fatalf("Replace at a cooling key: %+v, %v; want a CoolingDown duplicate (the payload would be dropped with the task it went into)", res, err)
	}
}

// A caller-chosen task ID reused after its task succeeded meets the
// cooldown like any other enqueue; Release ends it and the ID is usable
// again.
func TestCooldownMeetsACallerIDReusedAfterSuccess(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	settled := uint64(0)
	for _, c := range []*Client{h.client, h.d.NewClient()} {
		id := "digest-" + uniq(t)
		user := 1
		if c != h.client {
			user = 2
		}
		first, err := c.Enqueue(digest(user, 1), asynq.Queue(h.queue), asynq.TaskID(id))
		if err != nil || first.ID != id {
			t.Fatalf("first: %v %v", first, err)
		}
		waitFor(t, rc.runs, "the digest runs")
		settled++
		h.settled(settled)
		coolingDup(t, c, digest(user, 2), h.queue, id, asynq.TaskID(id))
		coolingDup(t, c, digest(user, 3), h.queue, id, asynq.TaskID(id+"-other"))
		coolingDup(t, c, digest(user, 4), h.queue, id)
		if ok, err := h.d.Release(context.Background(), digest(user, 0), id, asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("Release: %v %v", ok, err)
		}
		eventually(t, "asynq drops the done task's record", func() bool { return h.taskState(id) == 0 })
		again, err := c.Enqueue(digest(user, 5), asynq.Queue(h.queue), asynq.TaskID(id))
		if err != nil || again.ID != id {
			t.Fatalf("after Release: %v %v", again, err)
		}
		if r := waitFor(t, rc.runs, "the reused ID runs"); r.id != id {
			t.Fatalf("ran %s", r.id)
		}
		settled++
		h.settled(settled)
		coolingDup(t, c, digest(user, 6), h.queue, id)
	}
}

// The execution-time guard: a task of a type whose Rule has a Cooldown,
// enqueued by a plain asynq client, locks its key when it starts; its
// success cools the key; enqueues are cooling duplicates of it, and later
// plain arrivals are dropped, never run.
func TestCooldownThroughTheExecutionGuard(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	plain, err := h.asynq.Enqueue(digest(1, 1), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if r := waitFor(t, rc.runs, "the plain task runs"); r.id != plain.ID {
		t.Fatalf("ran %s", r.id)
	}
	h.settled(1)
	coolingDup(t, h.client, digest(1, 2), h.queue, plain.ID)
	coolingDup(t, h.d.NewClient(), digest(1, 3), h.queue, plain.ID)
	kl, found, err := h.d.Lookup(context.Background(), digest(1, 0), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "cooling" || kl.Holder != plain.ID {
		t.Fatalf("Lookup: %+v %v %v", kl, found, err)
	}
	second, err := h.asynq.Enqueue(digest(1, 4), asynq.Queue(h.queue), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the second plain task is done", func() bool { return h.taskState(second.ID) == asynq.TaskStateCompleted })
	select {
	case r := <-rc.runs:
		t.Fatalf("%s ran while its key cooled down", r.id)
	default:
	}
}

// Inspector operations: a scheduled task run now by the Inspector cools its
// key on success; one archived or deleted while it waits frees its key at
// once (NewClient).
func TestCooldownFollowsInspectorRunArchiveAndDelete(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	c := h.d.NewClient()
	ctx := context.Background()

	sched, err := c.Enqueue(digest(1, 1), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.insp.RunTask(h.queue, sched.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "the run-now task")
	h.settled(1)
	coolingDup(t, c, digest(1, 2), h.queue, sched.ID)

	for i, op := range []func(string, string) error{h.insp.ArchiveTask, h.insp.DeleteTask} {
		user := 10 + i
		w, err := c.Enqueue(digest(user, 1), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		if err := op(h.queue, w.ID); err != nil {
			t.Fatal(err)
		}
		n, err := c.Enqueue(digest(user, 2), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
		if err != nil {
			t.Fatalf("user %d: enqueue after the waiting task was removed: %v", user, err)
		}
		if kl, found, err := h.d.Lookup(ctx, digest(user, 0), asynq.Queue(h.queue)); err != nil || !found || kl.Holder != n.ID || kl.State == "cooling" {
			t.Fatalf("user %d: Lookup %+v %v %v", user, kl, found, err)
		}
	}
}

// MaxPending: a cooling key no longer counts as waiting, and it stays a
// cooling duplicate (not ErrTooManyPending) when the bound is reached.
func TestCooldownKeyIsNotCountedByMaxPending(t *testing.T) {
	rule := digestRule
	rule.MaxPending = 1
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": rule}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	first := h.enqueue(digest(1, 1))
	waitFor(t, rc.runs, "first run")
	h.settled(1)
	h.enqueue(digest(2, 1), asynq.ProcessIn(time.Hour)) // fills the bound
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	if _, err := h.client.Enqueue(digest(3, 1), asynq.Queue(h.queue)); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("a third key: %v, want ErrTooManyPending", err)
	}
}

// A per-call cooldown longer than the TTL keeps the lock through a delay
// longer than the TTL, and after success until the cooldown (counted from
// the enqueue) ends; a per-call cooldown that ended before the task
// succeeded leaves nothing held.
func TestCooldownPerCallIsCountedFromTheEnqueueNotTheTTL(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}}}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	ctx := context.Background()

	start := time.Now()
	long := h.enqueue(digest(1, 1), TTL(50*time.Millisecond), Cooldown(4*time.Second), asynq.ProcessIn(time.Second))
	waitFor(t, rc.runs, "the long-cooldown task")
	h.settled(1)
	dup := coolingDup(t, h.client, digest(1, 2), h.queue, long.ID)
	if dup.FreeIn > 4*time.Second-time.Since(start)+100*time.Millisecond {
		t.Fatalf("FreeIn %v, want what is left of 4 s since the enqueue", dup.FreeIn)
	}

	short := h.enqueue(digest(2, 1), TTL(time.Hour), Cooldown(200*time.Millisecond), asynq.ProcessIn(time.Second))
	if r := waitFor(t, rc.runs, "the short-cooldown task"); r.id != short.ID {
		t.Fatalf("ran %s", r.id)
	}
	h.settled(2)
	if _, found, err := h.d.Lookup(ctx, digest(2, 0), asynq.Queue(h.queue)); err != nil || found {
		t.Fatalf("a cooldown over before the success left the key held: %v %v", found, err)
	}
	if s := h.d.Stats(); s.Cooling != 1 {
		t.Fatalf("cooling %d, want 1", s.Cooling)
	}
}

// Refused combinations, in any option order, leave neither lock nor task.
func TestCooldownAndDebounceRefusedInAnyOptionOrderLeaveNothing(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"defer":   {Fields: []string{"user_id"}, OnConflict: Replace, OnRunning: RunningDefer},
		"replace": {Fields: []string{"user_id"}, OnConflict: Replace},
		"allow":   {Fields: []string{"user_id"}, OnRunning: RunningAllow},
		"deb":     {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: time.Minute},
	}})
	cases := map[string]struct {
		typ  string
		opts []asynq.Option
	}{
		"cooldown on defer":              {"defer", []asynq.Option{Cooldown(time.Minute)}},
		"cooldown on allow":              {"allow", []asynq.Option{Cooldown(time.Minute)}},
		"debounce on defer":              {"defer", []asynq.Option{Debounce(time.Minute)}},
		"debounce then reject":           {"replace", []asynq.Option{Debounce(time.Minute), OnConflict(Reject)}},
		"rule debounce, call reject":     {"deb", []asynq.Option{OnConflict(Reject)}},
		"cooldown(-1) after a good one":  {"replace", []asynq.Option{Cooldown(time.Minute), Cooldown(-time.Second)}},
		"debounce(0) with processin":     {"replace", []asynq.Option{asynq.ProcessIn(time.Minute), Debounce(0)}},
		"debounce with caller id reject": {"replace", []asynq.Option{asynq.TaskID("x-" + uniq(t)), OnConflict(Reject), Debounce(time.Second)}},
	}
	for name, tc := range cases {
		for _, c := range []*Client{h.client, h.d.NewClient()} {
			_, err := c.Enqueue(profileSync(tc.typ, 1, 1), append([]asynq.Option{asynq.Queue(h.queue)}, tc.opts...)...)
			if !errors.Is(err, ErrInvalidOption) {
				t.Errorf("%s: %v, want ErrInvalidOption", name, err)
			}
		}
	}
	if n := len(h.locks()); n != 0 || h.queueSize(h.queue) != 0 {
		t.Fatalf("refused calls left %d locks, %d tasks", n, h.queueSize(h.queue))
	}
}

// A per-call Cooldown on a call folded (Replace) into the waiting task is not
// applied: the key keeps the cooldown it was taken with (here none), and
// Result.NotApplied names the call's Cooldown. The folded payload runs and
// succeeds; the key is then free.
func TestCooldownOfAFoldedCallIsNamedNotApplied(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}, OnConflict: Replace}}})
	rc := newRecorder(nil)
	first := h.enqueue(digest(1, 1), asynq.ProcessIn(time.Hour))
	res, err := h.client.Submit(context.Background(), digest(1, 2), asynq.Queue(h.queue), Cooldown(time.Hour))
	if err != nil || res.Outcome != Replaced || res.TaskID != first.ID || len(res.NotApplied) != 1 || res.NotApplied[0] != "dedup.Cooldown(1h0m0s)" {
		t.Fatalf("fold: %+v %v; want NotApplied naming the Cooldown", res, err)
	}
	h.serve(rc.handler(), nil)
	if err := h.insp.RunTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitFor(t, rc.runs, "the task runs"); string(r.task.Payload()) != `{"user_id":1,"seq":2}` {
		t.Fatalf("ran with %s", r.task.Payload())
	}
	h.settled(1)
	h.asynqDone()
	h.enqueue(digest(1, 3)) // the key was taken without a cooldown: free
}

// libraryScripts counts the calls a client makes of the scripts the
// middleware runs at an attempt's start and end (start, settle, release_all).
type libraryScripts struct {
	n                         atomic.Int64 // start and settle
	starts, settles, together atomic.Int64 // together: release_all
}

func (h *libraryScripts) count(c redis.Cmder) {
	switch {
	case isScript(c, "start"):
		h.n.Add(1)
		h.starts.Add(1)
	case isScript(c, "settle"):
		h.n.Add(1)
		h.settles.Add(1)
	case isScript(c, "release_all"):
		h.together.Add(1)
	}
}

// hook is the go-redis hook that counts a client's calls.
func (h *libraryScripts) hook() redis.Hook { return redistest.CmdHook(h.count) }

// A task NewClient stored under a Cooldown costs the worker no Redis call
// of the library's: the task is stored with a Retention that keeps asynq's
// record of its success until the cooldown ends, and that record, written
// by asynq's own done script, is the hold. The key then cools exactly until
// the cooldown's end, counted from the enqueue. A Period's success is
// settled by the middleware (one call a task): its window holds whatever
// becomes of the task's record.
func TestCooldownSuccessCostsTheWorkerNoRedisCall(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	for name, opt := range map[string]asynq.Option{"cooldown": Cooldown(time.Hour), "period": Period(24*time.Hour, nil)} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			rdb := newRDB(t)
			calls := &libraryScripts{}
			rdb.AddHook(calls.hook())
			d, err := New(ctx, rdb, Config{Prefix: "nc-" + uniq(t), Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Close() })
			srvRDB, q := newRDB(t), "q-"+uniq(t)
			insp := asynq.NewInspectorFromRedisClient(srvRDB)
			t.Cleanup(func() { _ = insp.DeleteQueue(q, true) })
			client := d.NewClient()
			var ids []string
			taken := time.Now()
			for i := range 10 {
				info, err := client.Enqueue(userTask(i, ""), opt, asynq.Queue(q))
				if err != nil {
					t.Fatal(err)
				}
				ids = append(ids, info.ID)
			}
			srv := asynq.NewServerFromRedisClient(srvRDB, asynq.Config{Concurrency: 4, Queues: map[string]int{q: 1},
				TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel})
			if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv.Shutdown)
			eventually(t, "asynq records every success", func() bool {
				for _, id := range ids {
					ti, err := insp.GetTaskInfo(q, id)
					if name == "cooldown" && (err != nil || ti.State != asynq.TaskStateCompleted) || name == "period" && err == nil {
						return false
					}
				}
				return true
			})
			want := map[string]int64{"cooldown": 0, "period": int64(len(ids))}[name]
			if n := calls.n.Load(); n != want {
				t.Fatalf("the middleware called start or settle %d times for %d tasks, want %d", n, len(ids), want)
			}
			_, err = client.Enqueue(userTask(0, ""), opt, asynq.Queue(q))
			var dup *DuplicateTaskError
			if !errors.As(err, &dup) || !dup.CoolingDown || dup.Holder != ids[0] {
				t.Fatalf("enqueue after the success: %v, want cooling after %s", err, ids[0])
			}
			left := time.Hour
			if name == "period" {
				_, end := periodWindow(taken, 24*time.Hour, nil)
				left = end.Sub(taken)
			}
			if want := left - time.Since(taken); dup.FreeIn > want+time.Second || dup.FreeIn < want-5*time.Second {
				t.Fatalf("FreeIn %v, want %v", dup.FreeIn, want)
			}
			if ti, err := insp.GetTaskInfo(q, ids[0]); name == "cooldown" && (err != nil || ti.Retention < dup.FreeIn) {
				t.Fatalf("the task's Retention %v (%v), want at least the %v the key cools", ti.Retention, err, dup.FreeIn)
			}
		})
	}
}

// A task whose key an operator released while it waited takes the key back
// as it starts (no other task took it meanwhile), runs holding it, and its
// success cools the key as any success does: at most one successful run per
// cooldown, on either path.
func TestCooldownTaskReleasedWhileWaitingCoolsAfterItsSuccess(t *testing.T) {
	t.Parallel()
	bothPaths(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}}, func(t *testing.T, h *harness) {
		ctx := context.Background()
		first := h.enqueue(digest(1, 1))
		if ok, err := h.d.Release(ctx, digest(1, 1), first.ID, asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("release: %v %v", ok, err)
		}
		rc := newRecorder(nil)
		h.serve(rc.handler(), nil)
		if r := waitFor(t, rc.runs, "the digest runs"); r.id != first.ID {
			t.Fatalf("ran %s, want %s", r.id, first.ID)
		}
		eventually(t, "asynq records its success", func() bool { return h.finished(first.ID) })
		coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	})
}

// "never two handlers of a key running at once": a kept task's completed
// record outlives its cooldown (asynq's Retention), so an operator can run it
// again by hand (Inspector.RunTask of a completed task) after a new task took
// the key: once the key's next enqueue healed its lock after the cooldown, or
// once Release ended the cooldown early. It must check the key first, as an
// archived holder run again by hand does, and not run beside the key's new
// task.
func TestKeptCooldownTaskRunAgainByHandAfterItsKeyFreedDoesNotRunBesideTheNewHolder(t *testing.T) {
	t.Parallel()
	for name, cooldown := range map[string]time.Duration{"healed": 300 * time.Millisecond, "released": time.Hour} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}, Cooldown: cooldown}}})
			h.client = h.d.NewClient()
			release := make(chan struct{})
			rc := newRecorder(func(r run) error {
				if string(r.task.Payload()) == `{"user_id":1,"seq":2}` {
					<-release // the key's new task runs on
				}
				return nil
			})
			h.serve(rc.handler(), nil)
			defer close(release)
			first := h.enqueue(digest(1, 1))
			waitFor(t, rc.runs, "the first digest runs")
			eventually(t, "asynq records its success", func() bool { return h.taskState(first.ID) == asynq.TaskStateCompleted })
			if name == "released" {
				if ok, err := h.d.Release(context.Background(), digest(1, 1), first.ID, asynq.Queue(h.queue)); err != nil || !ok {
					t.Fatalf("release the cooling key: %v %v", ok, err)
				}
			}
			var second *asynq.TaskInfo
			eventually(t, "the key's next enqueue takes it", func() bool {
				info, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue))
				second = info
				return err == nil
			})
			if r := waitFor(t, rc.runs, "the new task runs"); r.id != second.ID {
				t.Fatalf("ran %s, want %s", r.id, second.ID)
			}
			runByHandWaitsForTheKey(t, h, rc, first.ID, second.ID)
		})
	}
}

// As TestCooldownTaskReleasedWhileWaitingCoolsAfterItsSuccess, where the run
// that took the key back fails and its retry succeeds: the retry's success
// cools the key.
func TestCooldownTaskReleasedWhileWaitingCoolsAfterItsRetrysSuccess(t *testing.T) {
	t.Parallel()
	bothPaths(t, Config{Rules: map[string]Rule{"digest:weekly": digestRule}}, func(t *testing.T, h *harness) {
		ctx := context.Background()
		first := h.enqueue(digest(1, 1))
		if ok, err := h.d.Release(ctx, digest(1, 1), first.ID, asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("release: %v %v", ok, err)
		}
		rc := newRecorder(func(r run) error {
			if r.retry == 0 {
				return errors.New("transient")
			}
			return nil
		})
		h.serve(rc.handler(), nil)
		waitFor(t, rc.runs, "the digest runs, and fails")
		if r := waitFor(t, rc.runs, "its retry runs"); r.id != first.ID || r.retry != 1 {
			t.Fatalf("ran %s (retry %d), want %s's retry", r.id, r.retry, first.ID)
		}
		eventually(t, "asynq records its success", func() bool { return h.finished(first.ID) })
		coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	})
}

// policies.md, Cooldown: "Enqueues meanwhile get a *DuplicateTaskError
// naming that task, with CoolingDown: true and FreeIn (the time left),
// whatever the conflict policy: there is no waiting task to fold into." A
// kept task's completed record, which its Retention keeps, may be run again
// by hand inside the cooldown (Inspector.RunTask of a completed task); an
// enqueue meanwhile is still refused as cooling, never folded into that run.
func TestKeptCooldownTaskRunAgainByHandInsideItsCooldownTakesNoFold(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour, OnConflict: Replace}}})
	h.client = h.d.NewClient()
	first := h.enqueue(digest(1, 1))
	rc := newRecorder(nil)
	srv := h.serve(rc.handler(), nil)
	waitFor(t, rc.runs, "the digest runs")
	eventually(t, "asynq records its success", func() bool { return h.taskState(first.ID) == asynq.TaskStateCompleted })
	srv.Shutdown() // (the run by hand waits)
	if err := h.insp.RunTask(h.queue, first.ID); err != nil {
		t.Fatalf("run the completed task again: %v", err)
	}
	res, err := h.client.Submit(context.Background(), digest(1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || !dup.CoolingDown {
		t.Fatalf("enqueue inside the cooldown: %+v %v, want refused as cooling", res, err)
	}
}

// runByHandWaitsForTheKey runs the completed task first again by hand
// (Inspector.RunTask) while second holds its key and runs: asynq takes it up,
// and it does not run beside second.
func runByHandWaitsForTheKey(t *testing.T, h *harness, rc *recorder, first, second string) {
	t.Helper()
	if err := h.insp.RunTask(h.queue, first); err != nil {
		t.Fatalf("run the completed task again: %v", err)
	}
	eventually(t, "asynq takes the task run by hand up", func() bool {
		st := h.taskState(first)
		return st != asynq.TaskStatePending && st != asynq.TaskStateActive
	})
	select {
	case r := <-rc.runs:
		t.Fatalf("%s ran again by hand while %s holds the key and runs", r.id, second)
	default:
	}
}

// A kept Cooldown task (NewClient's own ID: asynq's record of its success
// holds the key) whose handler is still running LockTimeout before its
// deadline is noted, then succeeds before the deadline. The key cools, and
// the success is counted cooling, as any kept success is: not released.
func TestKeptCooldownSuccessAfterTheDeadlineNoteIsCountedCooling(t *testing.T) {
	t.Parallel()
	rdb := newRDB(t)
	n := newNoted()
	rdb.AddHook(n)
	h := newHarnessOn(t, rdb, Config{Rules: map[string]Rule{"digest:weekly": digestRule}})
	h.client = h.d.NewClient()
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		return n.wait(ctx)
	}, retryInAnHour)
	first := h.enqueue(digest(1, 1), asynq.Timeout(2*time.Second))
	eventually(t, "asynq completes the digest", func() bool { return h.taskState(first.ID) == asynq.TaskStateCompleted })
	coolingDup(t, h.client, digest(1, 2), h.queue, first.ID)
	h.settled(1)
	if s := h.d.Stats(); s.Cooling != 1 || s.Released != 0 {
		t.Errorf("stats: cooling %d, released %d; want the success counted cooling once, not released", s.Cooling, s.Released)
	}
}
