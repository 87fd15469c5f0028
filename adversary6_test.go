package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Adversarial tests, round 6: seams between modes, operator actions, asynq's
// own retries and the ID namespace, through the public API on a real asynq
// server and redis-server. Each test names the README promise it checks.

// 1. README (Caveats): "a task that meets a busy key at execution on its
// last attempt is not returned as busy: the middleware schedules a copy of
// it (same message, new task ID) one Lease later"; (lifecycle) the
// recovered attempt "then waits for it (busy) and never runs beside it";
// "Per-call options override the type's rule". A task locked at enqueue on
// a per-call key whose lock was force-released (Lock API: "the holder, if
// alive, still runs, and takes the key again when it starts if the key is
// free") and which meets a newer task of the key on its last attempt is
// copied; the copy must stay on the key it was enqueued with, and so never
// run beside the key's running task.
func TestBusyLastAttemptCopyKeepsItsPerCallKey(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		opt  asynq.Option
	}{
		{"per-call Key", Config{heartbeat: (time.Second) / 3}, Key("tenant-7")},
		{"OptIn with per-call Fields", Config{heartbeat: (time.Second) / 3, OptIn: true}, Fields("key")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, c.cfg)
			ctx := context.Background()
			opts := []asynq.Option{asynq.Queue(h.queue), asynq.MaxRetry(0), c.opt}
			a, err := h.client.Enqueue(counterTask("k", 1, 1), opts...)
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", opts...); err != nil || !ok {
				t.Fatalf("forced release: %v %v", ok, err)
			}
			b, err := h.client.Enqueue(counterTask("k", 1, 2), opts...)
			if err != nil {
				t.Fatalf("new task of the released key: %v", err)
			}
			tr := newKeyTracker(func(*asynq.Task) string { return "the key" }, 2)
			h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4 })
			t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
			first := waitFor(t, tr.starts, "the key's first run")
			if first.id != b.ID {
				t.Fatalf("first run %s (seq %d), want the key's holder %s", first.id, first.seq, b.ID)
			}
			select {
			case r := <-tr.starts:
				// The copy ran beside the key's running task: the copied work
				// is not lost, but it ran under another key.
				t.Errorf("the copy of %s (busy on its last attempt): %s (seq %d) started while %s (seq 2) was still running; overlaps: %v",
					a.ID, r.id, r.seq, first.id, tr.overlapsSeen())
				return
			case <-time.After(4 * time.Second):
			}
			tr.open(2)
			// The copied work is owed, not lost: it runs once the key is free.
			deadline := time.After(10 * time.Second)
			for {
				select {
				case r := <-tr.starts:
					if r.seq == 1 {
						return
					}
				case <-deadline:
					t.Fatalf("the work of %s (seq 1) never ran", a.ID)
				}
			}
		})
	}
}

// 2. README (Lock API): Release "deletes the lock with its index key …,
// never a task: the holder, if alive, still runs, and takes the key again
// when it starts if the key is free" (and dedupctl release's note says the
// same). A holder enqueued under a caller-chosen ID with a per-call Key
// loses its index with the release; when it starts it must still be on
// its key, so it cannot run while another task of that key runs.
func TestForcedReleaseKeepsACallerIDHolderOnItsKey(t *testing.T) {
	h := newHarness(t, Config{})
	ctx := context.Background()
	opts := []asynq.Option{asynq.Queue(h.queue), Key("tenant-7")}
	a, err := h.client.Enqueue(counterTask("k", 1, 1), append(opts, asynq.TaskID("a6-"+uniq(t)))...)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", opts...); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	b, err := h.client.Enqueue(counterTask("k", 1, 2), opts...)
	if err != nil {
		t.Fatalf("new task of the released key: %v", err)
	}
	tr := newKeyTracker(func(*asynq.Task) string { return "tenant-7" }, 1, 2)
	h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4 })
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	first := waitFor(t, tr.starts, "the key's first run")
	tr.noSecondStart(t, first, 3*time.Second, fmt.Sprintf("tasks %s and %s of key tenant-7", a.ID, b.ID))
}

// A caller-chosen ID of the library's own form is refused; one only shaped
// like it (the earlier layout's dd-<fingerprint>-<random>, copied from an
// old TaskInfo) is a caller's ID like any: its task runs under its key, and
// another, never enqueued, key stays free.
func TestCallerIDShapedLikeAnOldLibraryIDIsTheCallers(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	ctx := context.Background()
	if _, err := h.client.Enqueue(counterTask("b", 1, 1), asynq.Queue(h.queue), asynq.TaskID(store.NewPlainID())); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("caller-chosen ID of the library's own form: %v, want ErrInvalidOption", err)
	}
	keyA := h.keyOf(counterTask("a", 1, 1), h.queue)
	own := "dd-" + fpOfLock(keyA) + "-0123456789abcdef0123"
	info := h.enqueue(counterTask("b", 1, 1), asynq.TaskID(own))
	if info.ID != own {
		t.Fatalf("caller-chosen ID not honoured: %s", info.ID)
	}
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(nil), nil)
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	waitFor(t, tr.starts, "key b runs")
	if l, found, err := h.d.Lookup(ctx, counterTask("b", 1, 1), asynq.Queue(h.queue)); err != nil || !found || l.State != "running" {
		t.Errorf("key b's lock while its task runs: %+v found=%v err=%v, want running", l, found, err)
	}
	if _, err := h.client.Submit(ctx, counterTask("a", 1, 2), asynq.Queue(h.queue)); err != nil {
		t.Errorf("key a was never enqueued, but its first enqueue got: %v", err)
	}
}

// 4. README: Replace is for "state: only the newest matters … the task
// that runs must see the newest version"; Release: "the holder, if alive,
// still runs". With BusyFold, an older task of a force-released key that
// starts while a newer task of the key waits must not overwrite the newer
// payload: the key's last run carries the newest payload.
func TestBusyFoldNeverRunsAnOlderPayloadInsteadOfTheNewest(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnBusy: BusyFold}))
	ctx := context.Background()
	h.enqueue(counterTask("k", 1, 1))
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	newest := h.enqueue(counterTask("k", 1, 2))
	tr := newKeyTracker(counterKeyOf)
	h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 1 })
	waitFor(t, tr.ends, "the key runs")
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	tr.mu.Lock()
	runs := append([]keyRun(nil), tr.done...)
	tr.mu.Unlock()
	last := runs[len(runs)-1]
	if last.seq != 2 {
		t.Fatalf("runs %+v: the key's last run carried seq %d, want the newest (seq 2, enqueued as %s)", runs, last.seq, newest.ID)
	}
}

// 5. README: "*dedup.Client has Enqueue, EnqueueContext, Close and Ping, as
// *asynq.Client does"; Skip: "off … no lock at enqueue or at execution";
// OptIn: "only deduplicate types with a rule". Where deduplication is off,
// a task ID given to asynq.NewTask must keep asynq's meaning: the task is
// stored under it, and a second enqueue of that ID is refused with
// asynq.ErrTaskIDConflict, as asynq's own client does.
func TestNewTaskIDHonouredWhereDedupIsOff(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		opts []asynq.Option
	}{
		{"Skip", Config{}, []asynq.Option{Skip()}},
		{"OptIn, type without a rule", Config{OptIn: true}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, c.cfg)
			id := "order-" + uniq(t)
			task := asynq.NewTask("a6:plain", []byte(`{"n":1}`), asynq.TaskID(id), asynq.Queue(h.queue))
			// What asynq's own client does with it, in another queue.
			other := asynq.NewTask("a6:plain", []byte(`{"n":1}`), asynq.TaskID(id), asynq.Queue(h.queue+"-asynq"))
			if _, err := h.asynq.Enqueue(other); err != nil {
				t.Fatal(err)
			}
			if _, err := h.asynq.Enqueue(other); !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Fatalf("asynq's client, same ID again: %v", err)
			}
			info, err := h.client.Enqueue(task, c.opts...)
			if err != nil {
				t.Fatal(err)
			}
			if info.ID != id {
				t.Errorf("stored under ID %q, want NewTask's %q", info.ID, id)
			}
			if _, err := h.client.Enqueue(task, c.opts...); !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Errorf("same NewTask ID again: err = %v, want asynq.ErrTaskIDConflict (as *asynq.Client)", err)
			}
			if n := h.queueSize(h.queue); n != 1 {
				t.Errorf("%d tasks stored for one task ID", n)
			}
		})
	}
}

// 6. README: "asynq refuses the enqueue → given back, owner-checked";
// "once no task with an ID exists the ID can be used again … as asynq's
// own client allows" (so while its record exists, it cannot); the matrix:
// after "SkipRetry → archived", a second enqueue of the key gets "new task".
// Re-enqueueing under the ID of an archived task (same payload) must be
// refused as asynq refuses it (both paths alike), and must leave the key
// free for the next enqueue.
func TestReEnqueueUnderAnArchivedTasksIDIsRefusedLikeAsynq(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		id := "job-" + uniq(t)
		key := h.keyOf(counterTask("k", 1, 1), h.queue)
		tr := newKeyTracker(counterKeyOf)
		h.serve(tr.handler(func(r keyRun) error {
			if r.seq == 1 {
				return fmt.Errorf("bad input: %w", asynq.SkipRetry)
			}
			return nil
		}), nil)
		h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
		// (An archived task keeps its lock, orphaned: the key's next enqueue heals it.)
		eventually(t, "the task is archived and its key orphaned", func() bool {
			return h.taskState(id) == asynq.TaskStateArchived && h.lockState(key) == store.LockOrphaned
		})
		res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id))
		if !errors.Is(err, asynq.ErrTaskIDConflict) {
			t.Errorf("re-enqueue under the archived task's ID: %+v (state %v), %v; want asynq.ErrTaskIDConflict, as asynq's client answers",
				res, stateOf(res), err)
		}
		if st := h.lockState(key); st != "" && st != store.LockOrphaned {
			t.Errorf("the refused re-enqueue left a lock %s (held by %s)", st, h.lockOwner(key))
		}
		if _, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue)); err != nil {
			t.Errorf("next enqueue of the key after its task was archived: %v, want a new task", err)
		}
	})
}

func stateOf(res Result) string {
	if res.Info == nil || res.Info.State == 0 {
		return "-"
	}
	return res.Info.State.String()
}

// 7. README: Replace "writes the new payload into the waiting task"; "a
// newer payload for a waiting task: replaced … in place"; lifecycle:
// "Enqueue, key held by a live task → … (with Replace/Merge/Defer: the
// payload is folded in)". A second process whose Enqueuer puts the task in
// another queue than the lock's first guess must still replace, not get a
// duplicate (the README's relocation row says "DuplicateTaskError", which
// contradicts the Replace promise).
func TestRelocatedReplaceStillReplaces(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace})
	h := newHarness(t, cfg)
	ctx := context.Background()
	cfg.Prefix, cfg.Logger = h.prefix, quietLogger()
	d2, err := New(ctx, h.rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	c1 := h.d.WrapClient(queueMover{c: h.asynq, q: h.queue})
	c2 := d2.WrapClient(queueMover{c: h.asynq, q: h.queue})
	first, err := c1.Submit(ctx, counterTask("k", 1, 1))
	if err != nil || first.Outcome != Created {
		t.Fatalf("first: %+v %v", first, err)
	}
	res, err := c2.Submit(ctx, counterTask("k", 1, 2))
	if err != nil || res.Outcome != Replaced || res.TaskID != first.TaskID {
		t.Errorf("a newer payload of the waiting key from another process: %+v, %v; want Replaced into %s", res, err, first.TaskID)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, first.TaskID)
	if err != nil {
		t.Fatal(err)
	}
	if s := decodeCounter(asynq.NewTask("counter", ti.Payload)).Seq; s != 2 {
		t.Errorf("waiting task carries seq %d, want the newest, 2", s)
	}
}

// 8. Errors: "Errors this package makes match one of them with errors.Is
// and wrap their cause; errors … from a function you gave (MergeFunc,
// KeyFunc) are returned wrapped"; bad input gets ErrInvalidOption "before
// any lock is taken"; "a merge that changes the key's fields is refused
// (ErrInvalidPayload)"; Release "(else ErrNotHolder)"; nothing locked or
// enqueued for any of them.
func TestErrorsMatchTheirSentinels(t *testing.T) {
	errKeyFunc := errors.New("a6: key func failed")
	errMerge := errors.New("a6: merge failed")
	cfg := Config{Rules: map[string]Rule{
		"a6:keyfunc": {KeyFunc: func(string, []byte) (string, error) { return "", errKeyFunc }},
		"a6:defer":   {Fields: []string{"key"}, OnRunning: RunningDefer},
		"counter":    {Fields: []string{"key"}},
	}}
	h := newHarness(t, cfg)
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	p := []byte(`{"key":"k","n":1,"seq":1}`)
	cases := []struct {
		name string
		call func() error
		want []error
	}{
		{"Fields()", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields()); return err }, []error{ErrInvalidOption}},
		{"Fields(\"\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields("")); return err }, []error{ErrInvalidOption}},
		{"Fields(\"a..b\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields("a..b")); return err }, []error{ErrInvalidOption}},
		{"Key twice, different", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, Key("a"), Key("b"))
			return err
		}, []error{ErrInvalidOption}},
		{"SharedKey then Key", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, SharedKey("a"), Key("a"))
			return err
		}, []error{ErrInvalidOption}},
		{"Key(\"\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Key("")); return err }, []error{ErrInvalidOption}},
		{"TTL(0)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, TTL(0)); return err }, []error{ErrInvalidOption}},
		{"Cooldown(-1)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Cooldown(-1)); return err }, []error{ErrInvalidOption}},
		{"OnConflict(9)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, OnConflict(9)); return err }, []error{ErrInvalidOption}},
		{"MergeWith(nil)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, MergeWith(nil)); return err }, []error{ErrInvalidOption}},
		{"OnConflict(Replace) then MergeWith", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, OnConflict(Replace), MergeWith(addMerge))
			return err
		}, []error{ErrInvalidOption}},
		{"Debounce with Reject", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Debounce(time.Second)); return err }, []error{ErrInvalidOption}},
		{"Cooldown on a RunningDefer type", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("a6:defer", p), q, Cooldown(time.Hour))
			return err
		}, []error{ErrInvalidOption}},
		{"Debounce on a RunningDefer type", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("a6:defer", p), q, OnConflict(Replace), Debounce(time.Second))
			return err
		}, []error{ErrInvalidOption}},
		{"Group in the call", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, asynq.Group("g")); return err }, []error{ErrInvalidOption}},
		{"KeyFunc error", func() error { _, err := h.client.Enqueue(asynq.NewTask("a6:keyfunc", p), q); return err }, []error{ErrInvalidPayload, errKeyFunc}},
		{"not JSON", func() error { _, err := h.client.Enqueue(asynq.NewTask("counter", []byte("{nope")), q); return err }, []error{ErrInvalidPayload}},
		{"field missing", func() error { _, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"n":1}`)), q); return err }, []error{ErrInvalidPayload, ErrFieldMissing}},
		{"huge exponent", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"key":1e1000000001}`)), q)
			return err
		}, []error{ErrInvalidPayload}},
		{"Lookup with Skip", func() error { _, _, err := h.d.Lookup(ctx, counterTask("k", 1, 1), q, Skip()); return err }, []error{ErrInvalidOption}},
		{"Lookup, blank queue", func() error { _, _, err := h.d.Lookup(ctx, counterTask("k", 1, 1), asynq.Queue(" ")); return err }, []error{ErrInvalidOption}},
		{"Release, not JSON", func() error {
			_, err := h.d.Release(ctx, asynq.NewTask("counter", []byte("x")), "", q)
			return err
		}, []error{ErrInvalidPayload}},
		{"WaitHolder(nil)", func() error { _, err := h.d.WaitHolder(ctx, nil); return err }, []error{ErrInvalidOption}},
		{"New, brace in prefix", func() error { _, err := New(ctx, h.rdb, Config{Prefix: "a{b"}); return err }, []error{ErrInvalidOption}},
		{"New, Merge rule without MergeFunc", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnConflict: Merge}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, negative Debounce", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnConflict: Replace, Debounce: -time.Second}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, unknown OnBusy", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnBusy: 7}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, blank rule name", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{" ": {}}})
			return err
		}, []error{ErrInvalidOption}},
	}
	for _, c := range cases {
		err := c.call()
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		for _, w := range c.want {
			if !errors.Is(err, w) {
				t.Errorf("%s: %v does not match %v", c.name, err, w)
			}
		}
		if errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v matches ErrUnavailable: Redis is fine", c.name, err)
		}
	}
	if l := h.locks(); len(l) != 0 {
		t.Errorf("locks left by refused calls: %v", l)
	}
	if n := h.queueSize(h.queue); n != 0 {
		t.Errorf("%d tasks stored by refused calls", n)
	}
	// With a holder: merge errors, a merge that changes the key, a wrong holder.
	holder := h.enqueue(counterTask("k", 1, 1))
	_, err := h.client.Enqueue(counterTask("k", 2, 2), q, MergeWith(func(_, _ []byte) ([]byte, error) { return nil, errMerge }))
	if !errors.Is(err, errMerge) {
		t.Errorf("MergeFunc's error: %v, want it wrapped", err)
	}
	_, err = h.client.Enqueue(counterTask("k", 2, 2), q, MergeWith(func(_, _ []byte) ([]byte, error) { return []byte(`{"key":"other"}`), nil }))
	if !errors.Is(err, ErrInvalidPayload) {
		t.Errorf("merge that changes the key: %v, want ErrInvalidPayload", err)
	}
	if _, err := h.d.Release(ctx, counterTask("k", 1, 1), "not-the-holder", q); !errors.Is(err, ErrNotHolder) {
		t.Errorf("Release with a wrong holder: %v, want ErrNotHolder", err)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), q); !errors.Is(err, ErrDuplicateTask) || !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Errorf("duplicate: %v", err)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, holder.ID)
	if err != nil || string(ti.Payload) != string(counterTask("k", 1, 1).Payload()) {
		t.Errorf("the holder's payload changed after refused merges: %v %v", ti, err)
	}
}

// 9. README: "A folded call's payload lands in a task that keeps its own
// asynq options: Result.NotApplied names the call's options that were not
// applied (ProcessIn, …)"; Debounce "makes a new task due d after its
// enqueue, and every enqueue folded into it … moves its due time". A
// per-call Debounce folded into a task that was scheduled for later on
// purpose (ProcessIn, no debounce) must not pull it earlier than it was
// due.
func TestDebounceFoldNeverPullsAScheduledTaskEarlier(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"a6:sync": {Fields: []string{"user_id"}, OnConflict: Replace}}})
	ctx := context.Background()
	holder := h.enqueue(profileSync("a6:sync", 1, 1), asynq.ProcessIn(time.Hour))
	res, err := h.client.Submit(ctx, profileSync("a6:sync", 1, 2), asynq.Queue(h.queue), Debounce(2*time.Second))
	if err != nil || res.Outcome != Replaced || res.TaskID != holder.ID {
		t.Fatalf("%+v %v, want Replaced into %s", res, err, holder.ID)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, holder.ID)
	if err != nil {
		t.Fatal(err)
	}
	if ti.NextProcessAt.Before(holder.NextProcessAt.Add(-time.Second)) {
		t.Errorf("the task scheduled for %v (ProcessIn 1h) is now due at %v: a fold's Debounce pulled it %v earlier",
			holder.NextProcessAt.Format(time.TimeOnly), ti.NextProcessAt.Format(time.TimeOnly), holder.NextProcessAt.Sub(ti.NextProcessAt).Round(time.Second))
	}
}

// 10. README: "RunningDefer never runs two tasks of a key at once"; "After a
// failure with retries left it waits for the retry, so the newest payload
// still runs last". Under load: producers per key, handlers that fail a
// third of the time, Replace + RunningDefer on the direct path.
func TestDeferUnderLoadNeverOverlapsAndEndsWithTheNewest(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	var rmu sync.Mutex
	rng := rand.New(rand.NewPCG(6, 6))
	tr := newKeyTracker(counterKeyOf)
	h.serve(tr.handler(func(r keyRun) error {
		rmu.Lock()
		sleep, fail := time.Duration(rng.IntN(15))*time.Millisecond, rng.IntN(3) == 0
		rmu.Unlock()
		time.Sleep(sleep)
		if fail {
			return errors.New("flaky")
		}
		return nil
	}), func(c *asynq.Config) { c.Concurrency = 8 })
	const keys, n = 3, 60
	var wg sync.WaitGroup
	errs := make(chan error, keys*n)
	for k := range keys {
		wg.Go(func() {
			for s := 1; s <= n; s++ {
				_, err := h.client.Submit(ctx, counterTask(fmt.Sprint("k", k), 1, s), asynq.Queue(h.queue))
				var dup *DuplicateTaskError
				if err != nil && !errors.As(err, &dup) {
					errs <- err
				}
				time.Sleep(time.Duration(s%4) * time.Millisecond)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("enqueue: %v", err)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("runs of one key overlapped: %v", o)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	last := map[string]int{}
	for _, r := range tr.done {
		if r.err == nil {
			last[r.key] = r.seq
		}
	}
	for k := range keys {
		key := fmt.Sprint("k", k)
		if last[key] != n {
			t.Errorf("key %s: last successful run had seq %d, want the newest, %d", key, last[key], n)
		}
	}
}

// 11. README: Release "deletes the lock with its index key and MaxPending
// entry"; WaitForRoom "waits until there is room or its context ends". An
// operator's forced release of a waiting key frees its slot for a caller
// waiting for room.
func TestForcedReleaseMakesRoomForAWaiter(t *testing.T) {
	h := newHarness(t, counterRules(Rule{MaxPending: 1}))
	ctx := context.Background()
	h.enqueue(counterTask("k1", 1, 1))
	got := make(chan error, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 8*time.Second)
		defer cancel()
		_, err := h.client.Submit(wctx, counterTask("k2", 1, 1), asynq.Queue(h.queue), WaitForRoom())
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("the waiter returned before there was room: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if ok, err := h.d.Release(ctx, counterTask("k1", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("waiter after the release: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter still waits 5 s after the release freed the slot")
	}
}

// 12. README: RunningDefer: "When the run ends … the follow-up is queued and
// takes the lock. After a failure with retries left it waits for the
// retry, so the newest payload still runs last"; Release: "never a task:
// the holder, if alive, still runs, and takes the key again when it starts
// if the key is free". A key force-released while its holder waits for
// its retry, with a follow-up owed: the newest payload must still run
// soon (the holder's retry, then the follow-up), not after the lock's
// retry hold (here over an hour).
func TestForcedReleaseDuringARetryWaitStillRunsTheNewest(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour } // an upper bound of the server's
	h := newHarness(t, cfg)
	ctx := context.Background()
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(func(r keyRun) error {
		if r.seq == 1 && r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	}), func(c *asynq.Config) {
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return 2 * time.Second }
	})
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	holder := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v %v, want a follow-up", res, err)
	}
	tr.open(1)
	eventually(t, "the holder waits for its retry", func() bool { return h.taskState(holder.ID) == asynq.TaskStateRetry })
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	deadline := time.After(8 * time.Second)
	for {
		select {
		case r := <-tr.ends:
			if r.seq == 2 {
				return
			}
		case <-deadline:
			fi, _ := h.insp.GetTaskInfo(h.queue, res.TaskID)
			var next time.Time
			if fi != nil {
				next = fi.NextProcessAt
			}
			t.Fatalf("8 s after the release neither the holder's retry nor the follow-up %s ran the newest payload; holder state %v (superseded counted %d), follow-up due %v",
				res.TaskID, taskStateName(h, holder.ID), h.d.Stats().Superseded, next.Format(time.TimeOnly))
		}
	}
}

// slowEnqueuer is an Enqueuer whose first call takes a while (a decorator
// that calls a slow service, a Redis hiccup with go-redis's retries).
type slowEnqueuer struct {
	c       *asynq.Client
	delay   time.Duration
	once    *sync.Once
	entered chan struct{}
}

func (s slowEnqueuer) Enqueue(t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	return s.EnqueueContext(context.Background(), t, o...)
}

func (s slowEnqueuer) EnqueueContext(ctx context.Context, t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	slow := false
	s.once.Do(func() { slow = true; close(s.entered) })
	if slow {
		time.Sleep(s.delay)
	}
	return s.c.EnqueueContext(ctx, t, o...)
}

// 13. README: Merge: "concurrent producers never lose an update"; a Replace
// or Merge that meets a holder whose WrapClient producer has not stored it
// yet "waits for it, about 0.8 s in all, then is answered as a duplicate"
// (the review found the README silent on that bound: it now says so). A
// Merge that meets a holder its producer stores within the wait merges;
// one whose producer takes longer (a slow Enqueuer) is told it was not
// merged (a DuplicateTaskError naming the holder), never silently dropped.
func TestMergeIntoAHolderStillBeingStoredMergesOrSaysSo(t *testing.T) {
	for _, tc := range []struct {
		delay  time.Duration
		merged bool
	}{{200 * time.Millisecond, true}, {1500 * time.Millisecond, false}} {
		t.Run(tc.delay.String(), func(t *testing.T) { mergeIntoHolderBeingStored(t, tc.delay, tc.merged) })
	}
}

func mergeIntoHolderBeingStored(t *testing.T, delay time.Duration, merged bool) {
	h := newHarness(t, counterRules(Rule{OnConflict: Merge, MergeFunc: addMerge}))
	ctx := context.Background()
	se := slowEnqueuer{c: h.asynq, delay: delay, once: new(sync.Once), entered: make(chan struct{})}
	c := h.d.WrapClient(se)
	first := make(chan error, 1)
	go func() {
		_, err := c.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
		first <- err
	}()
	<-se.entered
	res, err := c.Submit(ctx, counterTask("k", 2, 2), asynq.Queue(h.queue))
	if err := <-first; err != nil {
		t.Fatalf("first: %v", err)
	}
	var dup *DuplicateTaskError
	switch {
	case merged && (err != nil || res.Outcome != Merged):
		t.Errorf("merge into the holder being stored: %+v, %v; want Merged (its n=2 is otherwise lost)", res, err)
	case !merged && !errors.As(err, &dup):
		t.Errorf("merge into a holder stored after the wait: %+v, %v; want a DuplicateTaskError (not merged, and told so)", res, err)
	}
}

// 14. README: "a server whose Config.Prefix differs from the producer's
// follows the producer's lock"; RunningDefer: one follow-up, queued when
// the run ends, never two runs at once. A server of another prefix (and no
// rules) runs a Replace + RunningDefer key of a producer.
func TestServerWithAnotherPrefixHandsTheFollowUpOver(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	ds, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	tr := newKeyTracker(counterKeyOf, 1)
	serveWith(t, h.rdb, ds, h.queue, tr.handler(nil), nil)
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	holder := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("enqueue during the run: %+v %v, want Deferred behind %s", res, err, holder.ID)
	}
	res3, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || res3.Outcome != Replaced || res3.TaskID != res.TaskID {
		t.Fatalf("second enqueue during the run: %+v %v, want Replaced into the follow-up %s", res3, err, res.TaskID)
	}
	tr.open(1)
	r := waitFor(t, tr.ends, "the holder ends")
	if r.id != holder.ID {
		t.Fatalf("first end %s, want the holder", r.id)
	}
	r = waitFor(t, tr.ends, "the follow-up runs")
	if r.id != res.TaskID || r.seq != 3 {
		t.Errorf("after the holder: %s with seq %d, want the follow-up %s with seq 3", r.id, r.seq, res.TaskID)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("overlaps: %v", o)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
}

// 15. README: "RunningDefer never runs two tasks of a key at once. … When
// the run ends … the follow-up is queued"; SkipBusy/BusyDrop is for "tasks
// that arrive without a lock". An operator who runs the parked follow-up
// now (Inspector.RunTask, asynqmon's "run") while its holder runs must not
// lose the newest payload, whatever the busy policy.
func TestRunNowOnAFollowUpKeepsTheNewestPayload(t *testing.T) {
	for _, skipBusy := range []bool{false, true} {
		t.Run(fmt.Sprintf("SkipBusy=%v", skipBusy), func(t *testing.T) {
			cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
			cfg.SkipBusy = skipBusy
			h := newHarness(t, cfg)
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 1)
			h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 2 })
			t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
			h.enqueue(counterTask("k", 1, 1))
			waitFor(t, tr.starts, "the holder runs")
			res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("%+v %v, want a follow-up", res, err)
			}
			if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
				t.Fatalf("run the follow-up now: %v", err)
			}
			eventually(t, "the follow-up was picked up", func() bool {
				s := h.taskState(res.TaskID)
				return s != asynq.TaskStatePending && s != asynq.TaskStateScheduled && s != asynq.TaskStateActive
			})
			if o := tr.overlapsSeen(); len(o) > 0 {
				t.Errorf("overlaps: %v", o)
			}
			tr.open(1)
			deadline := time.After(6 * time.Second)
			for {
				select {
				case r := <-tr.ends:
					if r.seq == 2 {
						return
					}
				case <-deadline:
					t.Fatalf("the newest payload (seq 2, follow-up %s) never ran; follow-up state %v (busy counted %d)", res.TaskID, taskStateName(h, res.TaskID), h.d.Stats().Busy)
				}
			}
		})
	}
}

// 16. README: "one Lua script takes the lock or returns the holder: never an
// empty holder". Many goroutines enqueue one new key at once, on both
// paths: exactly one task, and every other call names it.
func TestConcurrentFirstEnqueuesMakeOneTaskOnBothPaths(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		const n = 32
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			created []string
			holders = map[string]int{}
			other   []error
		)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				res, err := h.client.Submit(ctx, counterTask("k", 1, i), asynq.Queue(h.queue))
				mu.Lock()
				defer mu.Unlock()
				var dup *DuplicateTaskError
				switch {
				case err == nil:
					created = append(created, res.TaskID)
				case errors.As(err, &dup):
					holders[dup.TaskID]++
				default:
					other = append(other, err)
				}
			})
		}
		close(start)
		wg.Wait()
		if len(other) > 0 {
			t.Errorf("unexpected errors: %v", other)
		}
		if len(created) != 1 {
			t.Fatalf("created %v, want exactly one task", created)
		}
		if len(holders) != 1 || holders[created[0]] != n-1 {
			t.Errorf("duplicates named %v, want %s %d times", holders, created[0], n-1)
		}
		if q := h.queueSize(h.queue); q != 1 {
			t.Errorf("%d tasks stored", q)
		}
	})
}

// 17. Three modes at once. README (combinations): "every other mix … works
// … Cooldown + Debounce: the debounced task's success cools the key"; "a
// RunningDefer follow-up counts"; MaxPending: "enqueues folded into keys
// already waiting always pass"; entries "leave when their task starts".
func TestDebounceCooldownAndMaxPendingTogether(t *testing.T) {
	const typ = "a6:sync"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace,
		Debounce: time.Second, Cooldown: time.Hour, MaxPending: 1}}})
	h.client = h.d.NewClient()
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	tr := newKeyTracker(func(t *asynq.Task) string {
		var p struct {
			UserID int `json:"user_id"`
		}
		_ = json.Unmarshal(t.Payload(), &p)
		return fmt.Sprint(p.UserID)
	})
	h.serve(tr.handler(nil), nil)
	r1, err := h.client.Submit(ctx, profileSync(typ, 1, 1), q)
	if err != nil || r1.Outcome != Created {
		t.Fatalf("first: %+v %v", r1, err)
	}
	if r, err := h.client.Submit(ctx, profileSync(typ, 1, 2), q); err != nil || r.Outcome != Replaced || r.TaskID != r1.TaskID {
		t.Fatalf("fold: %+v %v", r, err)
	}
	if _, err := h.client.Submit(ctx, profileSync(typ, 2, 1), q); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("second key while one waits (MaxPending 1): %v, want ErrTooManyPending", err)
	}
	run := waitFor(t, tr.ends, "the debounced task runs")
	if run.id != r1.TaskID || run.seq != 2 {
		t.Fatalf("ran %s seq %d, want %s with seq 2", run.id, run.seq, r1.TaskID)
	}
	eventually(t, "the key cools down", func() bool {
		_, err := h.client.Submit(ctx, profileSync(typ, 1, 3), q)
		var dup *DuplicateTaskError
		return errors.As(err, &dup) && dup.CoolingDown && dup.TaskID == r1.TaskID
	})
	if r, err := h.client.Submit(ctx, profileSync(typ, 2, 1), q); err != nil || r.Outcome != Created {
		t.Fatalf("another key once the first ran (its slot left when it started): %+v %v", r, err)
	}
	if l, found, err := h.d.Lookup(ctx, profileSync(typ, 1, 9), q); err != nil || !found || l.State != "cooling" {
		t.Errorf("Lookup of the cooling key: %+v %v %v", l, found, err)
	}
}

// 18. Errors: "ErrUnavailable reports that Redis could not be reached";
// "ErrOutcomeUnknown reports an enqueue that may or may not have stored
// its task: a lock call that carried the task … failed after it was sent";
// "errors … from the context … are returned wrapped". A call whose context
// was cancelled before it was made reached no Redis: it is the caller's
// cancellation, not an outage and not an unknown outcome.
func TestCancelledCallIsNotAnOutage(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled call: %v, want context.Canceled wrapped", err)
		}
		if errors.Is(err, ErrOutcomeUnknown) {
			t.Errorf("cancelled call: %v matches ErrOutcomeUnknown, but it never reached Redis", err)
		}
		if errors.Is(err, ErrUnavailable) {
			t.Errorf("cancelled call: %v matches ErrUnavailable, but Redis is up", err)
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Errorf("%d tasks stored by a cancelled call", n)
		}
	})
}

// 19. README: "A call under the caller-chosen ID of the task that holds its
// key meets that task as any call of the key does"; RunningDefer: "later
// ones are folded into it"; "After a failure with retries left it waits
// for the retry, so the newest payload still runs last"; "once no task with
// an ID exists the ID can be used again". Caller-chosen IDs on every call
// of a Replace + RunningDefer key whose holder fails once.
func TestDeferWithCallerIDsAndARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(func(r keyRun) error {
		if r.seq == 1 && r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	}), nil)
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	idA, idB, idC := "a-"+uniq(t), "b-"+uniq(t), "c-"+uniq(t)
	if _, err := h.client.Submit(ctx, counterTask("k", 1, 1), q, asynq.TaskID(idA)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, tr.starts, "the holder runs")
	fb, err := h.client.Submit(ctx, counterTask("k", 1, 2), q, asynq.TaskID(idB))
	if err != nil || fb.Outcome != Deferred {
		t.Fatalf("B: %+v %v, want Deferred", fb, err)
	}
	fc, err := h.client.Submit(ctx, counterTask("k", 1, 3), q, asynq.TaskID(idC))
	if err != nil || fc.Outcome != Replaced || fc.TaskID != fb.TaskID || !fc.FollowUp {
		t.Fatalf("C: %+v %v, want Replaced into the follow-up %s", fc, err, fb.TaskID)
	}
	tr.open(1)
	var runs []keyRun
	for len(runs) < 3 {
		runs = append(runs, waitFor(t, tr.ends, "runs"))
	}
	if runs[0].id != idA || runs[0].err == nil || runs[1].id != idA || runs[1].err != nil || runs[2].id != fb.TaskID || runs[2].seq != 3 {
		t.Fatalf("runs %+v: want %s failing, %s again succeeding, then the follow-up %s with seq 3", runs, idA, idA, fb.TaskID)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if extra := len(tr.ends); extra != 0 {
		t.Errorf("%d more runs", extra)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
	if n, _ := h.rdb.Keys(ctx, h.prefix+":*").Result(); len(n) != 0 {
		t.Errorf("keys left behind: %v", n)
	}
	// The IDs are free again, each for a new task.
	for i, id := range []string{idA, idB, idC} {
		if r, err := h.client.Submit(ctx, counterTask(fmt.Sprint("n", i), 1, 9), q, asynq.TaskID(id)); err != nil || r.TaskID != id {
			t.Errorf("ID %s reused: %+v %v", id, r, err)
		}
	}
}

// 20. README: "RunningAllow frees the key when the task starts; the next
// enqueue creates a new task"; Rule.OnRunning: "Recorded in the lock, so
// the server needs no matching configuration". A RunningAllow task whose
// first attempt failed starts its retry on a server that has no rule for
// its type: the key must be free while the retry runs, as it was while the
// first attempt ran.
// (After the review: a RunningAllow lock goes when its task starts, so a
// retry takes a lock by the server's own rule; the README now says a
// server needs a RunningAllow type's rule. With it, the retry frees the key
// too.)
func TestRunningAllowFreesTheKeyForARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnRunning: RunningAllow}))
	ctx := context.Background()
	ds, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: counterRules(Rule{OnRunning: RunningAllow}).Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	hold := make(chan struct{})
	tr := newKeyTracker(counterKeyOf)
	serveWith(t, h.rdb, ds, h.queue, tr.handler(func(r keyRun) error {
		if r.seq != 1 {
			return nil
		}
		if r.retry == 0 {
			return errors.New("flaky")
		}
		<-hold
		return nil
	}), nil)
	t.Cleanup(func() { close(hold) })
	h.enqueue(counterTask("k", 1, 1))
	for {
		r := waitFor(t, tr.starts, "the task runs")
		if r.retry == 0 {
			// While the first attempt runs, the key is free (RunningAllow).
			continue
		}
		break
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Created {
		t.Errorf("enqueue while the RunningAllow task's retry runs: %+v %v; want a new task (the key frees when the task starts)", res, err)
	}
}

// 21. README (matrix): "the Inspector runs a scheduled task → runs now";
// RunningDefer: "After a failure with retries left it waits for the retry,
// so the newest payload still runs last". An operator runs a holder that
// waits for its retry (with a follow-up owed) now: the holder's retry runs,
// then the follow-up, never at once, and the newest payload last.
func TestRunNowOnARetryingHolderThenItsFollowUp(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(func(r keyRun) error {
		if r.seq == 1 && r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	}), retryInAnHour)
	t.Cleanup(tr.openAll) // (before the server shuts down: cleanups run last first)
	holder := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v %v, want a follow-up", res, err)
	}
	tr.open(1)
	eventually(t, "the holder waits for its retry", func() bool { return h.taskState(holder.ID) == asynq.TaskStateRetry })
	if r, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil || r.TaskID != res.TaskID {
		t.Fatalf("enqueue during the retry wait: %+v %v, want folded into the follow-up %s", r, err, res.TaskID)
	}
	if err := h.insp.RunTask(h.queue, holder.ID); err != nil {
		t.Fatal(err)
	}
	var ends []keyRun
	for len(ends) < 3 {
		ends = append(ends, waitFor(t, tr.ends, "runs"))
	}
	if ends[1].id != holder.ID || ends[1].err != nil || ends[2].id != res.TaskID || ends[2].seq != 3 {
		t.Fatalf("runs %+v: want the holder's retry, then the follow-up %s with seq 3", ends, res.TaskID)
	}
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("overlaps: %v", o)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
}
