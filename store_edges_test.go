//go:build ignore

package dedup

// Adversarial tests of the internal/store refactor, through the public API
// where possible (scripts run in the checked build: DEDUP_CHECK_SCRIPT_KEYS=1).

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)


// MaxPending with heal, at execution: a task that arrives without a lock
// and heals an orphaned, counted lock (start.lua) must leave the waiting set
// as acquire's heal does. The key is running now, not waiting.
func TestStartHealFreesWaitingSlot(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"bounded": {Fields: []string{"k"}, MaxPending: 1}}})
	ctx := context.Background()
	t1 := asynq.NewTask("bounded", []byte(`{"k":1}`))
	first := h.enqueue(t1)
	key := h.keyOf(t1, h.queue)
	wait := store.NewKeys(h.prefix).Wait(h.queue, "bounded")
	if n := h.rdb.ZCard(ctx, wait).Val(); n != 1 {
		t.Fatalf("precondition: waiting set holds %d", n)
	}
	// The owner vanishes (deleted by an operator); its lock is old.
	if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	h.ageLock(key)
	// The same work arrives without a lock (asynq.Scheduler) and starts:
	// the execution-time guard heals the orphan and runs.
	sched := "sched-" + uniq(t)
	if _, err := h.asynq.Enqueue(t1, asynq.Queue(h.queue), asynq.TaskID(sched)); err != nil {
		t.Fatal(err)
	}
	ref := h.d.newRef(h.queue, fpOfKey(key), sched, "bounded", false)
	st, _, err := h.d.start(ctx, ref, newToken(), RunningReject)
	if err != nil || st != store.StatusTaken {
		t.Fatalf("start: %v %v", st, err)
	}
	if n := h.rdb.ZCard(ctx, wait).Val(); n != 0 {
		t.Errorf("after the guard healed the orphan and started, the waiting set still counts %d key(s): %v", n, h.rdb.ZRange(ctx, wait, 0, -1).Val())
	}
	// Nothing waits: a new key must be accepted.
	if _, err := h.client.Enqueue(asynq.NewTask("bounded", []byte(`{"k":2}`)), asynq.Queue(h.queue)); err != nil {
		t.Errorf("new key refused although no key waits (the healed orphan is still counted): %v", err)
	}
}

// Stale hint on the direct path with a caller-chosen ID: the holder the
// hint names has finished (completed, kept by Retention) and the caller
// enqueues its ID again. Without a hint the direct path answers
// ErrTaskIDConflict and locks nothing; with the stale hint it must answer
// the same — not "Created" for a task that was never enqueued, with a lock
// held for a completed task.
func TestStaleHintCallerIDReuseConflicts(t *testing.T) {
	rules := map[string]Rule{"job": {Fields: []string{"k"}}}
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	c := h.d.NewClient()
	id := "job-" + uniq(t)
	task := asynq.NewTask("job", []byte(`{"k":1}`))
	key := h.keyOf(task, h.queue)
	if _, err := c.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID(id), asynq.Retention(time.Hour)); err != nil {
		t.Fatal(err)
	}
	// A duplicate: this process now remembers the holder.
	if _, err := c.Enqueue(task, asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("duplicate: %v", err)
	}
	ran := make(chan struct{}, 1)
	srv := h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
	waitFor(t, ran, "run")
	eventually(t, "completed, lock released", func() bool {
		return h.taskState(id) == asynq.TaskStateCompleted && h.lockOwner(key) == ""
	})
	srv.Shutdown()

	// Reference: a process without the hint.
	fresh := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix, Rules: rules})
	_, ferr := fresh.d.NewClient().Enqueue(task, asynq.Queue(h.queue), asynq.TaskID(id), asynq.Retention(time.Hour))
	if !errors.Is(ferr, asynq.ErrTaskIDConflict) || h.lockOwner(key) != "" {
		t.Fatalf("reference (no hint): err %v, lock owner %q; want ErrTaskIDConflict and no lock", ferr, h.lockOwner(key))
	}

	// The process with the stale hint.
	res, err := c.Submit(ctx, task, asynq.Queue(h.queue), asynq.TaskID(id), asynq.Retention(time.Hour))
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		state := ""
		if res.Info != nil {
			state = res.Info.State.String()
		}
		t.Errorf("stale hint: Submit = outcome %v task %s (state %s), err %v; the same call without a hint gives ErrTaskIDConflict",
			res.Outcome, res.TaskID, state, err)
	}
	if owner := h.lockOwner(key); owner != "" {
		t.Errorf("stale hint: lock left held by %q, whose task is %v", owner, h.taskState(owner))
		if _, err := c.Enqueue(task, asynq.Queue(h.queue)); errors.Is(err, ErrDuplicateTask) {
			t.Errorf("stale hint: new work on the key is now refused as a duplicate of a completed task: %v", err)
		}
	}
}

// Healing an orphaned lock that owes a follow-up: the holder waited for its
// retry (follow-up parked) and was deleted by hand. The next enqueue must
// make the follow-up the holder, queue it at once and fold into it, with
// every key it touches given (checked build).
func TestHealOrphanOwedFollowUpAdopts(t *testing.T) {
	for _, pol := range []struct {
		name     string
		conflict Conflict
		outcome  Outcome
	}{{"replace", Replace, Replaced}, {"reject", Reject, 0}, {"merge", Merge, Merged}} {
		t.Run(pol.name, func(t *testing.T) {
			rule := Rule{Fields: []string{"u"}, OnConflict: pol.conflict, OnRunning: RunningDefer}
			if pol.conflict == Merge {
				rule.MergeFunc = func(old, new []byte) ([]byte, error) { return new, nil }
			}
			h := newHarness(t, Config{Rules: map[string]Rule{"prof": rule}})
			ctx := context.Background()
			a := h.enqueue(asynq.NewTask("prof", []byte(`{"u":1,"v":1}`)))
			key := h.keyOf(asynq.NewTask("prof", []byte(`{"u":1}`)), h.queue)
			fp := fpOfKey(key)
			ref := h.d.newRef(h.queue, fp, a.ID, "prof", false)
			tok := newToken()
			if st, _, err := h.d.start(ctx, ref, tok, RunningDefer); err != nil || st != store.StatusTaken {
				t.Fatalf("start: %v %v", st, err)
			}
			def, err := h.client.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":2}`)), asynq.Queue(h.queue))
			if err != nil || def.Outcome != Deferred {
				t.Fatalf("defer: %+v %v", def, err)
			}
			follow := def.TaskID
			if owned, _, err := h.d.finish(ctx, ref, tok, false, time.Hour, time.Hour); err != nil || !owned {
				t.Fatalf("hold: %v %v", owned, err)
			}
			if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
				t.Fatal(err)
			}
			h.ageLock(key)
			res, err := h.client.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":3}`)), asynq.Queue(h.queue))
			var dup *DuplicateTaskError
			switch {
			case pol.outcome == 0 && (!errors.As(err, &dup) || dup.TaskID != follow):
				t.Errorf("reject: %+v %v, want a duplicate of the follow-up %s", res, err, follow)
			case pol.outcome != 0 && (err != nil || res.Outcome != pol.outcome || res.TaskID != follow):
				t.Errorf("%s: %+v %v, want %v into the follow-up %s", pol.name, res, err, pol.outcome, follow)
			}
			if owner := h.lockOwner(key); owner != follow {
				t.Errorf("lock owner %q, want the follow-up %s", owner, follow)
			}
			if st := h.taskState(follow); st != asynq.TaskStatePending {
				t.Errorf("follow-up state %v, want pending", st)
			}
			if n := h.rdb.Exists(ctx, store.NewKeys(h.prefix).Follow(h.queue, fp)).Val(); n != 0 {
				t.Errorf("follow-up pointer left")
			}
			if f := h.rdb.HGet(ctx, key, "f").Val(); f != "" {
				t.Errorf("lock still owes %q", f)
			}
		})
	}
}

// replace.lua must never write into a task that is running, that owes a
// follow-up, or into a holder the lock no longer names; and it must bump
// the merge version so a concurrent Merge's compare-and-set fails.
func TestReplaceScriptOnlyWritesAWaitingHolder(t *testing.T) {
	rule := Rule{Fields: []string{"u"}, OnConflict: Replace, OnRunning: RunningDefer}
	h := newHarness(t, Config{Rules: map[string]Rule{"prof": rule}})
	ctx := context.Background()
	c := h.d.NewClient()
	a, err := c.Enqueue(asynq.NewTask("prof", []byte(`{"u":1,"v":1}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	key := h.keyOf(asynq.NewTask("prof", []byte(`{"u":1}`)), h.queue)
	fp := fpOfKey(key)
	// Two replaces: the second through replace.lua.
	for v := 2; v <= 3; v++ {
		res, err := c.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":`+string(rune('0'+v))+`}`)), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Replaced || res.TaskID != a.ID {
			t.Fatalf("replace %d: %+v %v", v, res, err)
		}
	}
	if n := h.rdb.HGet(ctx, key, "n").Val(); n != "2" {
		t.Errorf("fold count %q after two replaces, want 2", n)
	}
	// Merge compare-and-set against a replace through replace.lua.
	ref := store.Ref{Queue: h.queue, FP: fp, ID: newLockedID(fp), Type: "prof"}
	mr, err := h.d.store.Acquire(ctx, &store.Acquire{Ref: ref, OnWaiting: store.FoldMerge, TTL: time.Hour, Now: time.Now()})
	if err != nil || mr.Status != store.StatusMerge {
		t.Fatalf("merge read: %+v %v", mr, err)
	}
	if res, err := c.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":4}`)), asynq.Queue(h.queue)); err != nil || res.Outcome != Replaced {
		t.Fatalf("replace: %+v %v", res, err)
	}
	cr, err := h.d.store.Coalesce(ctx, &store.Coalesce{Ref: ref, Target: mr.Task, Version: mr.Version, Payload: []byte(`{"u":1,"v":"merged-stale"}`)})
	if err != nil || cr.Written {
		t.Errorf("a merge read before a replace still wrote: %+v %v", cr, err)
	}
	// The holder starts: a replace must not touch it.
	aref := h.d.newRef(h.queue, fp, a.ID, "prof", false)
	tok := newToken()
	if st, _, err := h.d.start(ctx, aref, tok, RunningDefer); err != nil || st != store.StatusTaken {
		t.Fatalf("start: %v %v", st, err)
	}
	before := h.payloadOf(a.ID)
	res, err := c.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":5}`)), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("replace into running: %+v %v", res, err)
	}
	if got := h.payloadOf(a.ID); got != before {
		t.Errorf("running task's payload rewritten: %s -> %s", before, got)
	}
	follow := res.TaskID
	// Retry: the holder waits again, with a follow-up owed.
	if owned, _, err := h.d.finish(ctx, aref, tok, false, time.Hour, time.Hour); err != nil || !owned {
		t.Fatalf("hold: %v %v", owned, err)
	}
	for v := 6; v <= 7; v++ {
		res, err := c.Submit(ctx, asynq.NewTask("prof", []byte(`{"u":1,"v":`+string(rune('0'+v))+`}`)), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Replaced || res.TaskID != follow {
			t.Errorf("replace while a follow-up is owed: %+v %v, want Replaced into %s", res, err, follow)
		}
	}
	if got := h.payloadOf(a.ID); got != before {
		t.Errorf("retry-waiting holder owing a follow-up was rewritten: %s -> %s", before, got)
	}
	if got := h.payloadOf(follow); got != `{"u":1,"v":7}` {
		t.Errorf("follow-up payload %s", got)
	}
}

var _ = redis.Nil

// A caller-chosen task ID reused for other work (another key) must be
// refused (ErrTaskIDConflict) without touching the first task's lock or its
// index key. The acquire script writes the index key before asynq refuses
// the ID; the rollback then deletes it: the first task's lock can no longer
// be found from its ID, so the middleware locks another key for it and
// never releases its real lock.
func TestCallerIDReuseLeavesLiveTaskAlone(t *testing.T) {
	h := newHarness(t, Config{})
	ctx := context.Background()
	id := "order-" + uniq(t)
	first := asynq.NewTask("order", []byte(`{"n":1}`))
	if _, err := h.client.Enqueue(first, asynq.Queue(h.queue), asynq.TaskID(id), Key("k1")); err != nil {
		t.Fatal(err)
	}
	idx := indexKey(h.prefix, h.queue, id)
	fp1 := h.rdb.Get(ctx, idx).Val()
	if fp1 == "" {
		t.Fatal("no index key")
	}
	_, err := h.client.Enqueue(asynq.NewTask("order", []byte(`{"n":2}`)), asynq.Queue(h.queue), asynq.TaskID(id), Key("k2"))
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		t.Errorf("reused ID: err = %v, want ErrTaskIDConflict", err)
	}
	if got, err := h.rdb.Get(ctx, idx).Result(); got != fp1 {
		t.Errorf("index key of pending task %s was %q, now %q (%v): the refused enqueue clobbered it", id, fp1, got, err)
	}
	// Consequence: the first task runs and succeeds, its lock stays.
	ran := make(chan struct{}, 1)
	h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
	waitFor(t, ran, "run")
	k1 := lockKeyHex(h.prefix, h.queue, fp1)
	// The middleware settles the lock before asynq marks the task done.
	eventually(t, "task done", func() bool { return h.taskState(id) == 0 || h.taskState(id) == asynq.TaskStateCompleted })
	if owner := h.lockOwner(k1); owner != "" {
		t.Errorf("after task %s succeeded its lock %s is still held by %q", id, k1, owner)
		if _, err := h.client.Enqueue(asynq.NewTask("order", []byte(`{"n":3}`)), asynq.Queue(h.queue), Key("k1")); errors.Is(err, ErrDuplicateTask) {
			t.Errorf("key k1 refused as a duplicate of the finished task: %v", err)
		}
	}
}

// Merge into a holder that waits for its retry while the follow-up it owes
// has vanished (deleted by an operator): acquire names the holder as the
// merge target (the follow-up is not waiting), but coalesce.lua refuses any
// holder target while the lock has a follow-up field, so every
// compare-and-set fails and the enqueue ends in ErrContention after 32
// rounds; Replace in the same state writes into the holder.
func TestMergeIntoHolderWhoseFollowUpVanished(t *testing.T) {
	merge := func(old, new []byte) ([]byte, error) { return new, nil }
	h := newHarness(t, Config{Rules: map[string]Rule{"cnt": {Fields: []string{"u"}, OnConflict: Merge, MergeFunc: merge, OnRunning: RunningDefer}}})
	ctx := context.Background()
	a := h.enqueue(asynq.NewTask("cnt", []byte(`{"u":1,"v":1}`)))
	key := h.keyOf(asynq.NewTask("cnt", []byte(`{"u":1}`)), h.queue)
	aref := h.d.newRef(h.queue, fpOfKey(key), a.ID, "cnt", false)
	tok := newToken()
	if st, _, err := h.d.start(ctx, aref, tok, RunningDefer); err != nil || st != store.StatusTaken {
		t.Fatalf("start: %v %v", st, err)
	}
	def, err := h.client.Submit(ctx, asynq.NewTask("cnt", []byte(`{"u":1,"v":2}`)), asynq.Queue(h.queue))
	if err != nil || def.Outcome != Deferred {
		t.Fatalf("defer: %+v %v", def, err)
	}
	if owned, _, err := h.d.finish(ctx, aref, tok, false, time.Hour, time.Hour); err != nil || !owned {
		t.Fatalf("hold: %v %v", owned, err)
	}
	if err := h.insp.DeleteTask(h.queue, def.TaskID); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	res, err := h.client.Submit(ctx, asynq.NewTask("cnt", []byte(`{"u":1,"v":3}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Errorf("merge into the retry-waiting holder (its follow-up deleted): %v after %v", err, time.Since(start))
	} else if res.Outcome != Merged {
		t.Errorf("outcome %v", res.Outcome)
	}
	res, err = h.client.Submit(ctx, asynq.NewTask("cnt", []byte(`{"u":1,"v":4}`)), asynq.Queue(h.queue), OnConflict(Replace))
	if err != nil || res.Outcome != Replaced || res.TaskID != a.ID {
		t.Errorf("replace in the same state: %+v %v (for comparison)", res, err)
	}
}

// Stale hints on the direct path (the call sends no task and, if the key
// is free, enqueues through asynq): the answer, the stored task and the
// lock must agree, for a holder that finished, was deleted, or was
// replaced by another process's holder; scheduled and Replace calls too.
func TestStaleHintsDirectPathAgrees(t *testing.T) {
	for _, replace := range []bool{false, true} {
		for _, delay := range []time.Duration{0, time.Hour} {
			for _, how := range []string{"finished", "deleted", "other process"} {
				name := how
				if replace {
					name += "/replace"
				}
				if delay > 0 {
					name += "/scheduled"
				}
				t.Run(name, func(t *testing.T) {
					rule := Rule{Fields: []string{"u"}}
					if replace {
						rule.OnConflict = Replace
					}
					rules := map[string]Rule{"st": rule}
					h := newHarness(t, Config{Rules: rules})
					// Every call here reads the owner's record: the test is about
					// stale hints, not the brief trust after a read (TestRecheck…).
					recheckAlways(h.d)
					ctx := context.Background()
					c := h.d.NewClient()
					task := func(v int) *asynq.Task {
						return asynq.NewTask("st", []byte(`{"u":1,"v":`+string(rune('0'+v))+`}`))
					}
					key := h.keyOf(task(0), h.queue)
					x, err := c.Enqueue(task(1), asynq.Queue(h.queue))
					if err != nil {
						t.Fatal(err)
					}
					if _, err := c.Submit(ctx, task(2), asynq.Queue(h.queue)); err != nil && !errors.Is(err, ErrDuplicateTask) {
						t.Fatal(err) // now the hint names x
					}
					var other string
					switch how {
					case "finished":
						_ = h.insp.DeleteTask(h.queue, x.ID)
						h.rdb.Del(ctx, key)
					case "deleted":
						_ = h.insp.DeleteTask(h.queue, x.ID)
						h.ageLock(key)
					case "other process":
						_ = h.insp.DeleteTask(h.queue, x.ID)
						h.rdb.Del(ctx, key)
						p2 := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix, Rules: rules})
						y, err := p2.d.NewClient().Enqueue(task(3), asynq.Queue(h.queue))
						if err != nil {
							t.Fatal(err)
						}
						other = y.ID
					}
					opts := []asynq.Option{asynq.Queue(h.queue)}
					if delay > 0 {
						opts = append(opts, asynq.ProcessIn(delay))
					}
					res, err := c.Submit(ctx, task(4), opts...)
					owner := h.lockOwner(key)
					switch {
					case other != "" && replace:
						if err != nil || res.Outcome != Replaced || res.TaskID != other || h.payloadOf(other) != `{"u":1,"v":4}` {
							t.Errorf("replace into the other process's holder: %+v %v", res, err)
						}
					case other != "":
						var dup *DuplicateTaskError
						if !errors.As(err, &dup) || dup.TaskID != other {
							t.Errorf("want a duplicate of %s: %+v %v", other, res, err)
						}
					default:
						if err != nil || res.Outcome != Created {
							t.Fatalf("want Created: %+v %v", res, err)
						}
						if owner != res.TaskID {
							t.Errorf("lock owner %q, answer %s", owner, res.TaskID)
						}
						ti, err := h.insp.GetTaskInfo(h.queue, res.TaskID)
						if err != nil || string(ti.Payload) != `{"u":1,"v":4}` {
							t.Errorf("stored task: %+v %v", ti, err)
						} else {
							want := asynq.TaskStatePending
							if delay > 0 {
								want = asynq.TaskStateScheduled
							}
							if ti.State != want || res.Info.State != want {
								t.Errorf("state stored %v, answered %v, want %v", ti.State, res.Info.State, want)
							}
						}
						if d := h.rdb.PTTL(ctx, key).Val(); d < time.Hour+delay-time.Minute {
							t.Errorf("lock TTL %v does not cover the delay %v", d, delay)
						}
					}
				})
			}
		}
	}
}
