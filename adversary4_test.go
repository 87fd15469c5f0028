package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Adversarial tests of Cooldown and Debounce (issue 12, items 1 and 2),
// through the public API on a real asynq server.

// A handler that succeeds within its Timeout, but closer to its deadline
// than LockTimeout (1 s), is settled "as given up" and rechecked later. Its
// success must still start the cooldown: the README's matrix says success
// means "duplicate, CoolingDown", and only deadlines that actually passed
// count as failures.
func TestCooldownStartsAfterASuccessCloseToTheDeadline(t *testing.T) {
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
	if dup.TaskID != first.ID || !dup.CoolingDown || dup.FreeIn <= 0 {
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

// Debounce + Merge under concurrent producers: every enqueue merged, the
// key runs once, after the burst.
func TestDebounceMergeOfConcurrentProducersRunsOnce(t *testing.T) {
	const typ = "deb:count"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"key"}, OnConflict: Merge, MergeFunc: addMerge, Debounce: 1500 * time.Millisecond}}})
	runs := make(chan counterPayload, 16)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		var p counterPayload
		_ = json.Unmarshal(task.Payload(), &p)
		runs <- p
		return nil
	}, nil)
	const producers, each = 8, 10
	var wg sync.WaitGroup
	clients := []*Client{h.client, h.d.NewClient()}
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				b, _ := json.Marshal(counterPayload{Key: "k", N: 1, Seq: p*each + i})
				if _, err := clients[p%2].Submit(context.Background(), asynq.NewTask(typ, b), asynq.Queue(h.queue)); err != nil {
					t.Errorf("producer %d: %v", p, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	p := waitFor(t, runs, "the merged run")
	if p.N != producers*each {
		t.Errorf("ran with n=%d, want %d (every enqueue merged)", p.N, producers*each)
	}
	h.settled(1)
	select {
	case q := <-runs:
		t.Fatalf("a second run: %+v", q)
	case <-time.After(300 * time.Millisecond):
	}
}

// A fold from another process (no hint of the holder) moves the due time
// of the debounced task too, on both enqueue paths.
func TestDebounceFoldFromAnotherProcessMovesTheDueTime(t *testing.T) {
	const typ = "deb:x"
	const d = time.Hour
	cfg := Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: d}}}
	h := newHarness(t, cfg)
	cfg.Prefix, cfg.Logger = h.prefix, quietLogger()
	ctx := context.Background()
	due := func(id string) int64 {
		t.Helper()
		s, err := h.rdb.ZScore(ctx, "asynq:{"+h.queue+"}:scheduled", id).Result()
		if err != nil {
			t.Fatalf("ZSCORE %s: %v", id, err)
		}
		return int64(s)
	}
	for i, mk := range []func(*Dedup) *Client{func(d *Dedup) *Client { return d.WrapClient(asynq.NewClientFromRedisClient(h.rdb)) }, (*Dedup).NewClient} {
		res, err := h.client.Submit(ctx, profileSync(typ, i, 1), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Created {
			t.Fatal(res, err)
		}
		// Pretend it is due sooner, then fold from a fresh process.
		h.rdb.ZAdd(ctx, "asynq:{"+h.queue+"}:scheduled", redis.Z{Score: float64(time.Now().Unix() + 60), Member: res.TaskID})
		other, err := New(ctx, h.rdb, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		before := time.Now()
		fold, err := mk(other).Submit(ctx, profileSync(typ, i, 2), asynq.Queue(h.queue))
		if err != nil || fold.Outcome != Replaced || fold.TaskID != res.TaskID {
			t.Fatalf("path %d: fold %+v %v", i, fold, err)
		}
		if got := due(res.TaskID); got < before.Add(d).Unix() {
			t.Errorf("path %d: due at %d after a fold from another process, want >= %d", i, got, before.Add(d).Unix())
		}
	}
}

// Two types sharing a key, both debounced: the other type's enqueue is a
// duplicate and must not move the waiting task's due time or touch its payload.
func TestDebounceSharedKeyOfAnotherTypeLeavesTheTaskAlone(t *testing.T) {
	const d = time.Hour
	h := newHarness(t, Config{Rules: map[string]Rule{
		"deb:a": {OnConflict: Replace, Debounce: d},
		"deb:b": {OnConflict: Replace, Debounce: 2 * d},
	}})
	ctx := context.Background()
	res, err := h.client.Submit(ctx, profileSync("deb:a", 1, 1), asynq.Queue(h.queue), SharedKey("k"))
	if err != nil {
		t.Fatal(err)
	}
	sched := "asynq:{" + h.queue + "}:scheduled"
	before := h.rdb.ZScore(ctx, sched, res.TaskID).Val()
	_, err = h.client.Submit(ctx, profileSync("deb:b", 1, 2), asynq.Queue(h.queue), SharedKey("k"))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.TaskID != res.TaskID {
		t.Fatalf("other type: %v, want a duplicate of %s", err, res.TaskID)
	}
	if after := h.rdb.ZScore(ctx, sched, res.TaskID).Val(); after != before {
		t.Fatalf("due moved from %v to %v by another type's enqueue", before, after)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, res.TaskID)
	if err != nil || string(ti.Payload) != `{"user_id":1,"seq":1}` {
		t.Fatalf("payload %s %v", ti.Payload, err)
	}
}

// Debounce overrides a call's ProcessIn/ProcessAt given in any order, and
// NewTask's own ProcessIn (which takes asynq's path).
func TestDebounceOverridesDelaysInAnyOrder(t *testing.T) {
	const typ = "deb:o"
	const d = 30 * time.Minute
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace}}})
	ctx := context.Background()
	sched := "asynq:{" + h.queue + "}:scheduled"
	cases := []struct {
		task *asynq.Task
		opts []asynq.Option
	}{
		{profileSync(typ, 1, 1), []asynq.Option{Debounce(d), asynq.ProcessIn(5 * time.Hour)}},
		{profileSync(typ, 2, 1), []asynq.Option{asynq.ProcessAt(time.Now().Add(5 * time.Hour)), Debounce(d)}},
		{asynq.NewTask(typ, []byte(`{"user_id":3}`), asynq.ProcessIn(5*time.Hour)), []asynq.Option{Debounce(d)}},
		{profileSync(typ, 4, 1), []asynq.Option{asynq.ProcessIn(5 * time.Hour), Debounce(d), OnConflict(Replace)}},
	}
	for i, tc := range cases {
		for j, c := range []*Client{h.client, h.d.NewClient()} {
			before := time.Now()
			res, err := c.Submit(ctx, tc.task, append([]asynq.Option{asynq.Queue(h.queue)}, tc.opts...)...)
			if err != nil || res.Outcome != Created {
				t.Fatalf("case %d/%d: %+v %v", i, j, res, err)
			}
			got := int64(h.rdb.ZScore(ctx, sched, res.TaskID).Val())
			if lo, hi := dueSecond(before.Add(d)), dueSecond(time.Now().Add(d)); got < lo || got > hi {
				t.Errorf("case %d/%d: due at %d, want the debounce's [%d, %d]", i, j, got, lo, hi)
			}
			if res.NotApplied != nil {
				t.Errorf("case %d/%d: NotApplied %v", i, j, res.NotApplied)
			}
			if err := h.insp.DeleteTask(h.queue, res.TaskID); err != nil {
				t.Fatal(err)
			}
			if _, err := h.d.Release(ctx, tc.task, "", asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// Debounce and Cooldown together: the burst runs once with its last
// payload, and its success cools the key.
func TestDebounceThenCooldownRunsOnceAndCools(t *testing.T) {
	const typ = "deb:cool"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: 700 * time.Millisecond, Cooldown: time.Hour}}})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	var id string
	for seq := 1; seq <= 5; seq++ {
		res, err := h.client.Submit(context.Background(), profileSync(typ, 1, seq), asynq.Queue(h.queue))
		if err != nil {
			t.Fatal(err)
		}
		if seq == 1 {
			id = res.TaskID
		} else if res.Outcome != Replaced || res.TaskID != id {
			t.Fatalf("enqueue %d: %+v", seq, res)
		}
	}
	r := waitFor(t, rc.runs, "the debounced run")
	if r.id != id || string(r.task.Payload()) != `{"user_id":1,"seq":5}` {
		t.Fatalf("ran %s with %s", r.id, r.task.Payload())
	}
	h.settled(1)
	coolingDup(t, h.client, profileSync(typ, 1, 6), h.queue, id)
}

// A per-call Cooldown on a call folded (Replace) into the waiting task:
// Cooldown's doc says "once the task succeeds, the key stays held until d
// after this enqueue". The call was accepted (Replaced, nothing in
// NotApplied), its payload ran and succeeded, so the key must cool.
// (Resolved as documented: a fold does not apply its call's Cooldown, and
// NotApplied says so; the key keeps the cooldown it was taken with.)
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
	h.enqueue(digest(1, 3)) // the key was taken without a cooldown: free
}

// Debounce + MaxPending: a key whose folds keep it waiting (each moving its
// due time and lengthening its lock) still counts as waiting: a second key
// beyond the bound is refused for as long as the first waits.
func TestDebounceKeyStaysCountedByMaxPending(t *testing.T) {
	const typ = "deb:bound"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: time.Second, MaxPending: 1}}})
	ctx := context.Background()
	first, err := h.client.Submit(ctx, profileSync(typ, 1, 1), asynq.Queue(h.queue), TTL(100*time.Millisecond))
	if err != nil || first.Outcome != Created {
		t.Fatal(first, err)
	}
	// The time under test: folds every 250 ms for 2.5 s, longer than the
	// first lock's TTL + Debounce.
	for seq := 2; seq <= 11; seq++ {
		time.Sleep(250 * time.Millisecond)
		res, err := h.client.Submit(ctx, profileSync(typ, 1, seq), asynq.Queue(h.queue), TTL(100*time.Millisecond))
		if err != nil || res.Outcome != Replaced || res.TaskID != first.TaskID {
			t.Fatalf("fold %d: %+v %v", seq, res, err)
		}
	}
	if st := h.taskState(first.TaskID); st != asynq.TaskStateScheduled {
		t.Fatalf("first task is %v, want still scheduled (debounced)", st)
	}
	if _, found, _ := h.d.Lookup(ctx, profileSync(typ, 1, 0), asynq.Queue(h.queue)); !found {
		t.Fatal("the first key's lock is gone while its task waits")
	}
	if res, err := h.client.Submit(ctx, profileSync(typ, 2, 1), asynq.Queue(h.queue)); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("a second key while the first still waits: %+v %v, want ErrTooManyPending (MaxPending 1)", res, err)
	}
}

// Debounce with a caller-chosen task ID and a per-call key: folds keep the
// task scheduled past its first lock lifetime; when it finally runs it must
// run under its own lock (the middleware finds it through the ID's index),
// and after its success the key is free again (matrix: success, new task).
func TestDebounceCallerIDTaskRunsUnderItsOwnLock(t *testing.T) {
	const typ = "deb:id"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: time.Second}}})
	rc := newRecorder(nil)
	ctx := context.Background()
	id := "deb-" + uniq(t)
	opts := []asynq.Option{asynq.Queue(h.queue), Key("acct-7"), TTL(100 * time.Millisecond)}
	first, err := h.client.Submit(ctx, profileSync(typ, 1, 1), append(opts, asynq.TaskID(id))...)
	if err != nil || first.Outcome != Created {
		t.Fatal(first, err)
	}
	for seq := 2; seq <= 11; seq++ { // the time under test: 2.5 s of folds
		time.Sleep(250 * time.Millisecond)
		res, err := h.client.Submit(ctx, profileSync(typ, seq, seq), opts...)
		if err != nil || res.Outcome != Replaced || res.TaskID != id {
			t.Fatalf("fold %d: %+v %v", seq, res, err)
		}
	}
	h.serve(rc.handler(), nil)
	if r := waitFor(t, rc.runs, "the debounced run"); r.id != id {
		t.Fatalf("ran %s", r.id)
	}
	h.settled(1)
	if s := h.d.Stats(); s.Started != 1 || s.Released != 1 {
		t.Errorf("stats %+v: want the run started under its own lock and released it", s)
	}
	if res, err := h.client.Submit(ctx, profileSync(typ, 1, 99), opts...); err != nil || res.Outcome != Created {
		t.Fatalf("after the run succeeded: %+v %v, want a new task", res, err)
	}
}
