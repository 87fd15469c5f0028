package dedup

// Edges of the lock scripts (take, acquire, merge, start, settle), through
// the public API: a waiting slot an arrival frees, a caller-chosen ID
// reused, a follow-up whose holder or which itself vanished, hints that
// went stale. Scripts run in the checked build (DEDUP_CHECK_SCRIPT_KEYS=1):
// a key a script touches without being given it fails the call.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// A task that arrives without a lock (asynq.Scheduler, another service)
// and takes, as it starts, a key whose holder is gone while its waiting
// slot (MaxPending) is still counted, frees that slot: the key runs now,
// it does not wait. acquire.lua's heal frees it; start.lua's must too.
func TestArrivalTakingAnOrphanedCountedKeyFreesItsWaitingSlot(t *testing.T) {
	for _, c := range []struct {
		name string
		gone func(h *harness, id string) error
	}{
		{"holder archived, its lock healed", func(h *harness, id string) error { return h.insp.ArchiveTask(h.queue, id) }},
		{"holder deleted with its lock", func(h *harness, id string) error { return h.insp.DeleteTask(h.queue, id) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, Config{Rules: map[string]Rule{"bounded": {Fields: []string{"k"}, MaxPending: 1}}})
			h.client = h.d.NewClient()
			ctx := context.Background()
			work := asynq.NewTask("bounded", []byte(`{"k":1}`))
			first := h.enqueue(work)
			key, wait := h.keyOf(work, h.queue), store.NewKeys(h.prefix).Wait(h.queue, "bounded")
			if n := h.rdb.ZCard(ctx, wait).Val(); n != 1 {
				t.Fatalf("precondition: the waiting set counts %d keys", n)
			}
			if err := c.gone(h, first.ID); err != nil {
				t.Fatal(err)
			}
			started, release := make(chan string, 1), make(chan struct{})
			h.serve(func(ctx context.Context, _ *asynq.Task) error {
				id, _ := asynq.GetTaskID(ctx)
				started <- id
				<-release
				return nil
			}, nil)
			defer close(release)
			arrived, err := h.asynq.Enqueue(work, asynq.Queue(h.queue)) // no lock
			if err != nil {
				t.Fatal(err)
			}
			if id := waitFor(t, started, "the arrival running"); id != arrived.ID || h.lockOwner(key) != arrived.ID {
				t.Fatalf("ran %s holding %q, want the arrival %s", id, h.lockOwner(key), arrived.ID)
			}
			if n := h.rdb.ZCard(ctx, wait).Val(); n != 0 {
				t.Errorf("the arrival runs under the key, and the waiting set still counts %d key(s): %v", n, h.rdb.ZRange(ctx, wait, 0, -1).Val())
			}
			if res, err := h.client.Submit(ctx, asynq.NewTask("bounded", []byte(`{"k":2}`)), asynq.Queue(h.queue)); err != nil || res.Outcome != Created {
				t.Errorf("a new key, with no key waiting: %+v %v", res, err)
			}
		})
	}
}

// A caller-chosen task ID used again for other work (another key) while
// its task waits is refused (asynq.ErrTaskIDConflict), on both enqueue
// paths, and leaves that task alone: its lock stays its own, the other key
// stays free, and the task runs and releases its lock as any other.
func TestCallerIDReusedForAnotherKeyLeavesTheLiveTaskAlone(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			h := newHarness(t, Config{})
			if direct {
				h.client = h.d.NewClient()
			}
			id := "order-" + uniq(t)
			first := asynq.NewTask("order", []byte(`{"n":1}`))
			h.enqueue(first, asynq.TaskID(id), Key("k1"))
			k1, k2 := h.keyOf(first, h.queue, Key("k1")), h.keyOf(first, h.queue, Key("k2"))
			_, err := h.client.Enqueue(asynq.NewTask("order", []byte(`{"n":2}`)), asynq.Queue(h.queue), asynq.TaskID(id), Key("k2"))
			if !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Errorf("the ID reused for another key: err = %v, want ErrTaskIDConflict", err)
			}
			if o1, o2 := h.lockOwner(k1), h.lockOwner(k2); o1 != id || o2 != "" {
				t.Errorf("after the refused call: k1 held by %q (want %s), k2 by %q (want none)", o1, id, o2)
			}
			if lock := taskLock(t, h.rdb, h.queue, id); lock != k1 || h.payloadOf(id) != `{"n":1}` {
				t.Errorf("task %s now names lock %s with payload %s: the refused call changed it", id, lock, h.payloadOf(id))
			}
			ran := make(chan string, 1)
			h.serve(func(ctx context.Context, _ *asynq.Task) error { got, _ := asynq.GetTaskID(ctx); ran <- got; return nil }, nil)
			if got := waitFor(t, ran, "the task running"); got != id {
				t.Fatalf("ran %s, want %s", got, id)
			}
			eventually(t, "its lock released", func() bool { return h.lockOwner(k1) == "" })
			if _, err := h.client.Enqueue(asynq.NewTask("order", []byte(`{"n":3}`)), asynq.Queue(h.queue), Key("k1")); err != nil {
				t.Errorf("new work on k1 after its task succeeded: %v", err)
			}
		})
	}
}

// edgesHolderOwingFollowUp makes the key of a task of type typ (payload
// {"u":1,...}, a RunningDefer rule) held by a holder waiting for its retry
// (an hour off) that owes the follow-up a call made while it ran: its first
// attempt fails after that call. The server is shut down, so nothing runs
// after. It returns the holder's and the follow-up's IDs.
func edgesHolderOwingFollowUp(t *testing.T, h *harness, typ string) (holder, follow string) {
	t.Helper()
	started, fail := make(chan string, 1), make(chan struct{})
	srv := h.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-fail
		return errors.New("the first attempt fails")
	}, func(c *asynq.Config) {
		c.Concurrency = 1
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
	})
	a := h.enqueue(asynq.NewTask(typ, []byte(`{"u":1,"v":1}`)))
	if id := waitFor(t, started, "the holder running"); id != a.ID {
		t.Fatalf("ran %s, want %s", id, a.ID)
	}
	def, err := h.client.Submit(context.Background(), asynq.NewTask(typ, []byte(`{"u":1,"v":2}`)), asynq.Queue(h.queue))
	if err != nil || def.Outcome != Deferred {
		t.Fatalf("a call while the holder runs: %+v %v, want deferred", def, err)
	}
	close(fail)
	eventually(t, "the holder waiting for its retry", func() bool { return h.taskState(a.ID) == asynq.TaskStateRetry })
	srv.Shutdown()
	if key := taskLock(t, h.rdb, h.queue, a.ID); h.lockOwner(key) != a.ID || h.rdb.HGet(context.Background(), store.ModeOf(key), store.FieldFollow).Val() != def.TaskID {
		t.Fatalf("the key is not held by %s owing %s", a.ID, def.TaskID)
	}
	return a.ID, def.TaskID
}

// The follow-up a key owes (RunningDefer) takes the key when its holder is
// gone (deleted by an operator while it waited for its retry): the next
// call queues it at once and meets it as the key's holder, folded into or
// a duplicate of it by its policy, and the key owes nothing more.
func TestOwedFollowUpAdoptedWhenItsHolderIsGone(t *testing.T) {
	for _, pol := range []struct {
		name     string
		conflict Conflict
		outcome  Outcome // 0: a duplicate
	}{{"replace", Replace, Replaced}, {"reject", Reject, 0}, {"merge", Merge, Merged}} {
		t.Run(pol.name, func(t *testing.T) {
			rule := Rule{Fields: []string{"u"}, OnConflict: pol.conflict, OnRunning: RunningDefer}
			if pol.conflict == Merge {
				rule.MergeFunc = func(_, new []byte) ([]byte, error) { return new, nil }
			}
			h := newHarness(t, Config{Rules: map[string]Rule{"prof": rule}, heartbeat: time.Hour}) // (no heartbeat watch queues it first)
			h.client = h.d.NewClient()
			holder, follow := edgesHolderOwingFollowUp(t, h, "prof")
			key := taskLock(t, h.rdb, h.queue, holder)
			if err := h.insp.DeleteTask(h.queue, holder); err != nil {
				t.Fatal(err)
			}
			res, err := h.client.Submit(context.Background(), asynq.NewTask("prof", []byte(`{"u":1,"v":3}`)), asynq.Queue(h.queue))
			var dup *DuplicateTaskError
			switch {
			case pol.outcome == 0 && (!errors.As(err, &dup) || dup.Holder != follow):
				t.Errorf("%+v %v, want a duplicate of the follow-up %s", res, err, follow)
			case pol.outcome != 0 && (err != nil || res.Outcome != pol.outcome || res.TaskID != follow || h.payloadOf(follow) != `{"u":1,"v":3}`):
				t.Errorf("%+v %v, want %v into the follow-up %s", res, err, pol.outcome, follow)
			}
			if owner, st := h.lockOwner(key), h.taskState(follow); owner != follow || st != asynq.TaskStatePending {
				t.Errorf("the key held by %q, the follow-up %v: want it held by the follow-up %s, queued", owner, st, follow)
			}
			if f := h.rdb.HGet(context.Background(), store.ModeOf(key), store.FieldFollow).Val(); f != "" {
				t.Errorf("the key still owes %q", f)
			}
		})
	}
}

// A Merge into a holder waiting for its retry whose owed follow-up was
// deleted by an operator merges into the holder (the follow-up is gone, so
// the payload goes to the task that will run), at once, as a Replace does.
func TestMergeIntoAHolderWhoseFollowUpVanished(t *testing.T) {
	rule := Rule{Fields: []string{"u"}, OnConflict: Merge, OnRunning: RunningDefer,
		MergeFunc: func(_, new []byte) ([]byte, error) { return new, nil }}
	h := newHarness(t, Config{Rules: map[string]Rule{"cnt": rule}, heartbeat: time.Hour})
	h.client = h.d.NewClient()
	holder, follow := edgesHolderOwingFollowUp(t, h, "cnt")
	if err := h.insp.DeleteTask(h.queue, follow); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	res, err := h.client.Submit(ctx, asynq.NewTask("cnt", []byte(`{"u":1,"v":3}`)), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Merged || res.TaskID != holder || h.payloadOf(holder) != `{"u":1,"v":3}` {
		t.Errorf("merge into the holder (its follow-up deleted): %+v %v after %v, want merged into %s", res, err, time.Since(start), holder)
	}
	res, err = h.client.Submit(ctx, asynq.NewTask("cnt", []byte(`{"u":1,"v":4}`)), asynq.Queue(h.queue), OnConflict(Replace))
	if err != nil || res.Outcome != Replaced || res.TaskID != holder || h.payloadOf(holder) != `{"u":1,"v":4}` {
		t.Errorf("replace in the same state: %+v %v, want replaced into %s", res, err, holder)
	}
}

// A process that saw a key's holder (its hint) and calls again under the
// holder's caller-chosen ID after the holder completed (its record kept,
// Retention) answers as a process without the hint does:
// asynq.ErrTaskIDConflict, and no lock taken for a task never stored.
func TestCallerIDOfACompletedTaskConflictsDespiteAStaleHint(t *testing.T) {
	rules := map[string]Rule{"job": {Fields: []string{"k"}}}
	h := newHarness(t, Config{Rules: rules})
	c := h.d.NewClient()
	id, task := "job-"+uniq(t), asynq.NewTask("job", []byte(`{"k":1}`))
	key := h.keyOf(task, h.queue)
	opts := []asynq.Option{asynq.Queue(h.queue), asynq.TaskID(id), asynq.Retention(time.Hour)}
	if _, err := c.Enqueue(task, opts...); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(task, asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) { // now this process knows the holder
		t.Fatalf("duplicate: %v", err)
	}
	ran := make(chan struct{}, 1)
	srv := h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
	waitFor(t, ran, "the task running")
	eventually(t, "completed, its lock released", func() bool {
		return h.taskState(id) == asynq.TaskStateCompleted && h.lockOwner(key) == ""
	})
	srv.Shutdown()

	fresh := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix, Rules: rules})
	if _, err := fresh.d.NewClient().Enqueue(task, opts...); !errors.Is(err, asynq.ErrTaskIDConflict) || h.lockOwner(key) != "" {
		t.Fatalf("reference (no hint): err %v, lock held by %q; want ErrTaskIDConflict and no lock", err, h.lockOwner(key))
	}
	res, err := c.Submit(context.Background(), task, opts...)
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		t.Errorf("with the stale hint: %+v %v, want ErrTaskIDConflict", res, err)
	}
	if owner := h.lockOwner(key); owner != "" {
		t.Errorf("with the stale hint: the key is held by %q, whose task is %v", owner, h.taskState(owner))
	}
}

// edgesStale is a way a holder a process saw stops holding its key.
type edgesStale struct {
	name string
	// end ends holder x of key; it returns the task holding the key after
	// ("" none).
	end func(t *testing.T, h *harness, rules map[string]Rule, key, x string) string
}

var edgesStales = []edgesStale{
	{"finished", func(t *testing.T, h *harness, _ map[string]Rule, key, x string) string {
		ran := make(chan struct{}, 1)
		srv := h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
		waitFor(t, ran, "the holder running")
		eventually(t, "its lock released", func() bool { return h.lockOwner(key) == "" })
		srv.Shutdown()
		return ""
	}},
	{"deleted", func(t *testing.T, h *harness, _ map[string]Rule, _, x string) string {
		if err := h.insp.DeleteTask(h.queue, x); err != nil {
			t.Fatal(err)
		}
		return ""
	}},
	{"archived", func(t *testing.T, h *harness, _ map[string]Rule, _, x string) string {
		if err := h.insp.ArchiveTask(h.queue, x); err != nil {
			t.Fatal(err)
		}
		return ""
	}},
	{"another process's holder", func(t *testing.T, h *harness, rules map[string]Rule, _, x string) string {
		if err := h.insp.DeleteTask(h.queue, x); err != nil {
			t.Fatal(err)
		}
		p2 := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix, Rules: rules})
		y, err := p2.d.NewClient().Enqueue(edgesTask(3), asynq.Queue(h.queue))
		if err != nil {
			t.Fatal(err)
		}
		return y.ID
	}},
}

func edgesTask(v int) *asynq.Task {
	return asynq.NewTask("st", fmt.Appendf(nil, `{"u":1,"v":%d}`, v))
}

// Stale hints on the direct path: a process whose hint names a holder that
// has since finished, been deleted or archived, or given way to another
// process's holder, answers as the key is: the answer, the stored task and
// the lock agree, for Reject and Replace, due now or scheduled.
func TestStaleHintsOnTheDirectPathAgree(t *testing.T) {
	for _, replace := range []bool{false, true} {
		for _, delay := range []time.Duration{0, time.Hour} {
			for _, how := range edgesStales {
				t.Run(fmt.Sprintf("%s/replace=%v/delay=%v", how.name, replace, delay), func(t *testing.T) {
					edgesStaleHint(t, how, replace, delay)
				})
			}
		}
	}
}

func edgesStaleHint(t *testing.T, how edgesStale, replace bool, delay time.Duration) {
	rule := Rule{Fields: []string{"u"}}
	if replace {
		rule.OnConflict = Replace
	}
	rules := map[string]Rule{"st": rule}
	h := newHarness(t, Config{Rules: rules})
	// Every call reads the holder's record: this is about stale hints, not
	// the brief trust in a record read moments ago (store's Recheck).
	recheckAlways(h.d)
	h.client = h.d.NewClient()
	key := h.keyOf(edgesTask(0), h.queue)
	x := h.enqueue(edgesTask(1))
	if _, err := h.client.Submit(context.Background(), edgesTask(2), asynq.Queue(h.queue)); err != nil && !errors.Is(err, ErrDuplicateTask) {
		t.Fatal(err) // now the hint names x
	}
	other := how.end(t, h, rules, key, x.ID)
	opts := []asynq.Option{asynq.Queue(h.queue)}
	if delay > 0 {
		opts = append(opts, asynq.ProcessIn(delay))
	}
	res, err := h.client.Submit(context.Background(), edgesTask(4), opts...)
	var dup *DuplicateTaskError
	switch {
	case other != "" && replace:
		if err != nil || res.Outcome != Replaced || res.TaskID != other || h.payloadOf(other) != `{"u":1,"v":4}` {
			t.Errorf("want replaced into the other process's holder %s: %+v %v", other, res, err)
		}
	case other != "":
		if !errors.As(err, &dup) || dup.Holder != other {
			t.Errorf("want a duplicate of the other process's holder %s: %+v %v", other, res, err)
		}
	default:
		edgesCreated(t, h, key, res, err, delay)
	}
}

// edgesCreated checks a call that found key free: created, holding the
// key, stored as answered, its lock covering its delay.
func edgesCreated(t *testing.T, h *harness, key string, res Result, err error, delay time.Duration) {
	t.Helper()
	if err != nil || res.Outcome != Created {
		t.Fatalf("want created: %+v %v", res, err)
	}
	if owner := h.lockOwner(key); owner != res.TaskID {
		t.Errorf("the key held by %q, the answer %s", owner, res.TaskID)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, res.TaskID)
	if err != nil || string(ti.Payload) != `{"u":1,"v":4}` {
		t.Fatalf("stored task: %+v %v", ti, err)
	}
	want := asynq.TaskStatePending
	if delay > 0 {
		want = asynq.TaskStateScheduled
	}
	if ti.State != want || res.Info.State != want {
		t.Errorf("state stored %v, answered %v, want %v", ti.State, res.Info.State, want)
	}
	if d := h.rdb.PTTL(context.Background(), key).Val(); d < time.Hour+delay-time.Minute {
		t.Errorf("lock TTL %v does not cover the delay %v", d, delay)
	}
}

// README: under OptIn "a type nothing deduplicates keeps asynq's task ID";
// (lifecycle) "Once no task with an ID exists, the ID can be used again, for
// any key, as asynq's own client allows"; (operations) Release: "a
// caller-chosen ID keeps its index key".
//
// A ruled task is enqueued under a caller-chosen ID; an operator releases
// its lock (the index stays, as documented) and deletes the task. The ID is
// reused for a task of a type with no rule (OptIn). When that task runs, the
// server must not follow the stale index and take the ruled key's lock for
// it: the ruled key stays free, and its next enqueue is accepted.
func TestStaleIndexOfACallerIDNeverLocksAnUnruledTask(t *testing.T) {
	h := newHarness(t, Config{OptIn: true, Rules: map[string]Rule{"a11:ruled": {Fields: []string{"user_id"}}}})
	ctx := context.Background()
	ruled := asynq.NewTask("a11:ruled", []byte(`{"user_id":42}`))
	id := "a11-job-" + uniq(t)
	if _, err := h.client.Enqueue(ruled, asynq.Queue(h.queue), asynq.TaskID(id)); err != nil {
		t.Fatal(err)
	}
	key := h.keyOf(ruled, h.queue)
	if ok, err := h.d.Release(ctx, ruled, "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	if err := h.insp.DeleteTask(h.queue, id); err != nil {
		t.Fatal(err)
	}
	free, err := h.client.Enqueue(asynq.NewTask("a11:free", []byte("x")), asynq.Queue(h.queue), asynq.TaskID(id))
	if err != nil || free.ID != id {
		t.Fatalf("reuse of the ID for an unruled type: %v %v", free, err)
	}
	running, gate := make(chan string, 4), make(chan struct{})
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		running <- task.Type()
		if task.Type() == "a11:free" {
			<-gate
		}
		return nil
	}, nil)
	defer close(gate)
	if typ := waitFor(t, running, "the unruled task runs"); typ != "a11:free" {
		t.Fatalf("ran %s", typ)
	}
	if o := h.lockOwner(key); o != "" {
		t.Errorf("while the unruled task %s (type a11:free) runs, the lock of a11:ruled user 42 (%s) is held by %s (ty %q, kf %q)",
			id, key, o, lockField(h, key, "ty"), lockField(h, key, "kf"))
	}
	if _, err := h.client.Enqueue(asynq.NewTask("a11:ruled", []byte(`{"user_id":42,"n":2}`)), asynq.Queue(h.queue)); err != nil {
		t.Errorf("enqueue of a11:ruled user 42 while an unrelated unruled task runs: %v; want accepted", err)
	}
}

// The modes passed in acquire's last, optional arguments all work:
// Debounce with Merge and caller-chosen IDs on WrapClient (the due time of a
// scheduled holder found by its index), MaxPending with a RunningDefer
// follow-up, Cooldown with Replace under a caller-chosen ID.
func TestModesPassedInAcquiresLastArgumentsWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	sum := func(old, new []byte) ([]byte, error) {
		return fmt.Appendf(nil, `{"user_id":1,"n":%d}`, len(old)+len(new)), nil
	}
	t.Run("debounce-merge-callerID-wrap", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:deb": {Fields: []string{"user_id"}, OnConflict: Merge, MergeFunc: sum, Debounce: 3 * time.Second}}})
		a, err := h.client.Submit(ctx, asynq.NewTask("a11:deb", []byte(`{"user_id":1,"n":1}`)), asynq.Queue(h.queue), asynq.TaskID("a11-deb-a"))
		if err != nil || a.Outcome != Created {
			t.Fatalf("A: %+v %v", a, err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, "a11-deb-a")
		if err != nil {
			t.Fatal(err)
		}
		first := ti.NextProcessAt
		eventually(t, "a second passes", func() bool { return time.Now().Unix() >= first.Unix()-1 })
		b, err := h.client.Submit(ctx, asynq.NewTask("a11:deb", []byte(`{"user_id":1,"n":2}`)), asynq.Queue(h.queue), asynq.TaskID("a11-deb-b"))
		if err != nil || b.Outcome != Merged || b.TaskID != "a11-deb-a" {
			t.Fatalf("B: %+v %v; want merged into a11-deb-a", b, err)
		}
		ti, err = h.insp.GetTaskInfo(h.queue, "a11-deb-a")
		if err != nil {
			t.Fatal(err)
		}
		if !ti.NextProcessAt.After(first) {
			t.Errorf("debounce did not move the due time: %v then %v", first, ti.NextProcessAt)
		}
		key := h.keyOf(asynq.NewTask("a11:deb", []byte(`{"user_id":1}`)), h.queue)
		// (Folds are the only mode here: the record counts them, and keeps no type.)
		if n := lockField(h, key, "n"); n != "1" {
			t.Errorf("mode record n %q, want 1 fold", n)
		}
	})
	t.Run("maxpending-defer", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:mp": {Fields: []string{"user_id"}, OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 1}}})
		h.client = h.d.NewClient()
		started, gate := make(chan struct{}, 4), make(chan struct{})
		h.serve(func(context.Context, *asynq.Task) error { started <- struct{}{}; <-gate; return nil }, func(c *asynq.Config) { c.Concurrency = 1 })
		defer close(gate)
		h.enqueue(asynq.NewTask("a11:mp", []byte(`{"user_id":1,"v":1}`)))
		waitFor(t, started, "A runs")
		res, err := h.client.Submit(ctx, asynq.NewTask("a11:mp", []byte(`{"user_id":1,"v":2}`)), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("B: %+v %v", res, err)
		}
		_, err = h.client.Enqueue(asynq.NewTask("a11:mp", []byte(`{"user_id":2}`)), asynq.Queue(h.queue))
		if !errors.Is(err, ErrTooManyPending) {
			t.Errorf("a second key while the follow-up waits under MaxPending 1: %v, want ErrTooManyPending", err)
		}
		key := h.keyOf(asynq.NewTask("a11:mp", []byte(`{"user_id":1}`)), h.queue)
		if b, ty := lockField(h, key, "b"), lockField(h, key, "ty"); b != "a11:mp" || ty != "a11:mp" {
			t.Errorf("lock b %q ty %q", b, ty)
		}
	})
	t.Run("cooldown-replace-callerID", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:cr": {Fields: []string{"user_id"}, OnConflict: Replace, Cooldown: time.Hour}}})
		h.client = h.d.NewClient()
		a, err := h.client.Submit(ctx, asynq.NewTask("a11:cr", []byte(`{"user_id":1,"v":1}`)), asynq.Queue(h.queue), asynq.TaskID("a11-cr-a"))
		if err != nil || a.Outcome != Created {
			t.Fatalf("A: %+v %v", a, err)
		}
		b, err := h.client.Submit(ctx, asynq.NewTask("a11:cr", []byte(`{"user_id":1,"v":2}`)), asynq.Queue(h.queue), asynq.TaskID("a11-cr-b"))
		if err != nil || b.Outcome != Replaced || b.TaskID != "a11-cr-a" {
			t.Fatalf("B: %+v %v", b, err)
		}
		ran := make(chan string, 2)
		h.serve(func(_ context.Context, task *asynq.Task) error { ran <- string(task.Payload()); return nil }, nil)
		if p := waitFor(t, ran, "A runs"); !strings.Contains(p, `"v":2`) {
			t.Errorf("ran %s, want v 2", p)
		}
		key := h.keyOf(asynq.NewTask("a11:cr", []byte(`{"user_id":1}`)), h.queue)
		eventually(t, "the key cools", func() bool { return lockField(h, key, "k") != "" })
		_, err = h.client.Enqueue(asynq.NewTask("a11:cr", []byte(`{"user_id":1,"v":3}`)), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.CoolingDown || dup.FreeIn < 50*time.Minute {
			t.Errorf("enqueue during the cooldown: %v, want a cooling duplicate", err)
		}
		if cd, kf := lockField(h, key, "cd"), lockField(h, key, "kf"); cd == "" || kf != "f:user_id" {
			t.Errorf("lock cd %q kf %q", cd, kf)
		}
	})
}
