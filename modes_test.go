package dedup

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// A key's mode record (modes.go): a key whose policy acts when its task
// starts or ends keeps one, with, among its modes' state, the task's type
// and how its key was chosen (its key form), which operators read (Lookup,
// dedupctl show and lookup, the lock browser).

// lockField reads what the lock at key says of one thing ("" when absent):
// "k" whether it cools ("1"), "id" its holder, any other field its mode
// record's (which keys with modes have: the type and key form among them).
func lockField(h *harness, key, field string) string {
	h.t.Helper()
	ctx := context.Background()
	switch field {
	case "k": // cooling: after a settle, or kept by asynq's record of the success
		p := store.ParseValue(h.rdb.Get(ctx, key).Val())
		if p.Kind == store.HoldCooling || p.Kind == store.HoldKept && h.taskState(p.Holder) == asynq.TaskStateCompleted {
			return "1"
		}
		return ""
	case "id":
		return h.lockOwner(key)
	}
	return h.rdb.HGet(ctx, modeKeyOf(key), field).Val()
}

// modeRecordOption is a mode that gives a key a mode record (a failure
// hold), for the tests of what the record keeps: a key whose policy acts
// only at enqueue has none.
func modeRecordOption() asynq.Option { return OnFailure(FailHold, time.Hour) }

// README (lifecycle, operations): a key's mode record keeps "how its key was
// chosen"; show's "keyed on" says it. A task locked at enqueue with per-call
// Fields on a type with no rule; Release frees its key; the task starts and
// takes its key again (as documented). The lock retaken at start records
// the form the fingerprint in the task ID was made with (fields user_id) or
// none (shown "-", as the server cannot know the producer's), never the
// server's rule's form (whole payload).
func TestModeRecordKeyFormOfALockRetakenAtStartIsNeverWrong(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	ctx := context.Background()
	task := asynq.NewTask("a11:retake", []byte(`{"user_id":7,"trace":"x"}`))
	info := h.enqueue(task, Fields("user_id"), modeRecordOption())
	key := h.keyOf(task, h.queue, Fields("user_id"))
	if got := lockField(h, key, "kf"); got != "f:user_id" {
		t.Fatalf("at enqueue kf %q, want f:user_id", got)
	}
	if ok, err := h.d.Release(ctx, task, "", Fields("user_id"), asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	running, gate := make(chan struct{}, 1), make(chan struct{})
	h.serve(func(context.Context, *asynq.Task) error { running <- struct{}{}; <-gate; return nil }, nil)
	defer close(gate)
	waitFor(t, running, "the task runs")
	if o := h.lockOwner(key); o != info.ID {
		t.Fatalf("lock owner %q, want %s (it retakes its key)", o, info.ID)
	}
	// The server cannot know the producer's key form: unknown ("-"), never a wrong one.
	if got := lockField(h, key, "kf"); got != "f:user_id" && got != "" {
		t.Errorf("the lock %s retaken at start records kf %q (shown as %q); its fingerprint was made from fields user_id",
			key, got, store.DescribeKeyForm(got))
	}
	if got := lockField(h, key, "ty"); got != "a11:retake" {
		t.Errorf("ty %q", got)
	}
}

// keys.md: "Per-call options override the type's rule … Key or SharedKey
// beats Fields … KeyFunc beats Key, which beats Fields"; the lock records the
// form actually used. For every override combination the recorded form
// names the kind the fingerprint used (checked by where the lock is: keyOf
// with the same options), and Lookup with the same options finds it.
func TestModeRecordKeyFormIsTheOneTheFingerprintUsed(t *testing.T) {
	fn := func(_ string, p []byte) (string, error) { return "fn-" + string(p), nil }
	h := newHarness(t, Config{Rules: map[string]Rule{
		"a11:key":    {Key: "k-rule"},
		"a11:fields": {Fields: []string{"user_id", "tenant.id"}},
		"a11:fn":     {KeyFunc: fn},
		"a11:sfn":    {KeyFunc: fn, Shared: true},
		"a11:shared": {Key: "s-rule", Shared: true},
		"a11:sfld":   {Fields: []string{"user_id"}, Shared: true},
	}})
	h.client = h.d.NewClient()
	ctx := context.Background()
	for i, tc := range []struct {
		typ  string
		opts []asynq.Option
		want string
	}{
		{"a11:key", nil, "k"},
		{"a11:key", []asynq.Option{Fields("user_id")}, "f:user_id"},
		{"a11:fields", nil, "f:tenant.id\x00user_id"},
		{"a11:fields", []asynq.Option{Key("k1")}, "k"},
		{"a11:fields", []asynq.Option{Key("k2"), Fields("user_id")}, "k"},
		{"a11:fields", []asynq.Option{Fields("user_id"), Key("k3")}, "k"},
		{"a11:fields", []asynq.Option{Fields("user_id"), SharedKey("s1")}, "s"},
		{"a11:fields", []asynq.Option{Fields("tenant.id", "user_id")}, "f:tenant.id\x00user_id"},
		{"a11:fields", []asynq.Option{Fields("user_id", "tenant.id")}, "f:tenant.id\x00user_id"},
		{"a11:fn", nil, "fn"},
		{"a11:fn", []asynq.Option{Fields("user_id")}, "f:user_id"},
		{"a11:fn", []asynq.Option{Key("k4")}, "k"},
		{"a11:sfn", nil, "sfn"},
		{"a11:sfn", []asynq.Option{Key("k5")}, "k"},
		{"a11:shared", nil, "s"},
		{"a11:shared", []asynq.Option{Key("k6")}, "k"},
		{"a11:shared", []asynq.Option{Fields("user_id")}, "f:user_id"},
		{"a11:key", []asynq.Option{SharedKey("s2")}, "s"},
		{"a11:sfld", nil, "f:user_id"},
		{"a11:none", nil, "p"},
		{"a11:none", []asynq.Option{Fields("tenant.id")}, "f:tenant.id"},
		{"a11:none", []asynq.Option{TTL(time.Minute)}, "p"},
	} {
		task := asynq.NewTask(tc.typ, fmt.Appendf(nil, `{"user_id":%d,"tenant":{"id":"t%d"}}`, i, i))
		opts := append([]asynq.Option{asynq.Queue(h.queue), modeRecordOption()}, tc.opts...)
		if _, err := h.client.Enqueue(task, opts...); err != nil {
			t.Errorf("%d %s %v: %v", i, tc.typ, tc.opts, err)
			continue
		}
		key := h.keyOf(task, h.queue, tc.opts...)
		if got := lockField(h, key, "kf"); got != tc.want {
			t.Errorf("%d %s %v: lock %s kf %q, want %q", i, tc.typ, tc.opts, key, got, tc.want)
		}
		if got := lockField(h, key, "ty"); got != tc.typ {
			t.Errorf("%d %s: ty %q", i, tc.typ, got)
		}
		if l, found, err := h.d.Lookup(ctx, task, opts...); err != nil || !found || l.Key != key {
			t.Errorf("%d %s %v: Lookup %+v %v %v, want %s", i, tc.typ, tc.opts, l, found, err, key)
		}
	}
}

// README (operations): "keyed on … by field names": `fields user_id` (or
// `fields user_id, report.kind`). A path whose member name holds a comma (a
// valid JSON member name, selectable with Fields) is recorded, and shown,
// apart from two paths: one field "a,b" and fields "a" and "b" are
// different keys.
func TestModeRecordTellsACommaInAFieldPathFromTwoFields(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	one := asynq.NewTask("a11:comma", []byte(`{"a,b":1,"a":1,"b":1}`))
	two := asynq.NewTask("a11:comma", []byte(`{"a,b":2,"a":2,"b":2}`))
	h.enqueue(one, Fields("a,b"), modeRecordOption())
	h.enqueue(two, Fields("a", "b"), modeRecordOption())
	kOne, kTwo := h.keyOf(one, h.queue, Fields("a,b")), h.keyOf(two, h.queue, Fields("a", "b"))
	f1, f2 := lockField(h, kOne, "kf"), lockField(h, kTwo, "kf")
	if f1 == "" || f2 == "" {
		t.Fatalf("kf %q %q", f1, f2)
	}
	if f1 == f2 || store.DescribeKeyForm(f1) == store.DescribeKeyForm(f2) {
		t.Errorf("one field %q and two fields \"a\", \"b\" record the same key form %q (shown %q)", "a,b", f1, store.DescribeKeyForm(f1))
	}
}

// README (lifecycle): the lock keeps "the task's type and its key form"
// while it changes hands: a RunningDefer follow-up adopting the lock, a
// Cooldown lock after success, a follow-up handed the lock by Release, and a
// WrapClient call relocated to another queue by its enqueuer (with per-call
// Fields overriding a Key rule).
func TestModeRecordTypeAndKeyFormSurviveHandOvers(t *testing.T) {
	ctx := context.Background()
	t.Run("follow-up", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:defer": {Fields: []string{"user_id"}, OnConflict: Replace, OnRunning: RunningDefer}}})
		h.client = h.d.NewClient()
		started := make(chan int, 4)
		gates := []chan struct{}{make(chan struct{}), make(chan struct{})}
		var n atomic.Int32
		h.serve(func(context.Context, *asynq.Task) error {
			i := int(n.Add(1)) - 1
			started <- i
			if i < len(gates) {
				<-gates[i]
			}
			return nil
		}, nil)
		defer func() {
			for _, g := range gates {
				select {
				case <-g:
				default:
					close(g)
				}
			}
		}()
		a := asynq.NewTask("a11:defer", []byte(`{"user_id":1,"v":1}`))
		h.enqueue(a)
		waitFor(t, started, "A runs")
		res, err := h.client.Submit(ctx, asynq.NewTask("a11:defer", []byte(`{"user_id":1,"v":2}`)), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("B: %+v %v", res, err)
		}
		close(gates[0])
		waitFor(t, started, "the follow-up runs")
		key := h.keyOf(a, h.queue)
		if o := h.lockOwner(key); o != res.TaskID {
			t.Fatalf("owner %s, want the follow-up %s", o, res.TaskID)
		}
		if ty, kf := lockField(h, key, "ty"), lockField(h, key, "kf"); ty != "a11:defer" || kf != "f:user_id" {
			t.Errorf("the follow-up's lock: ty %q kf %q", ty, kf)
		}
	})
	t.Run("cooldown", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:cool": {Key: "weekly", Cooldown: time.Hour}}})
		h.client = h.d.NewClient()
		task := asynq.NewTask("a11:cool", []byte(`x`))
		h.enqueue(task, Fields("user_id"), Skip(), Key("override"))
		// (Skip beats everything: no lock.) Now the real one, per-call Key over the rule's.
		h.enqueue(task, Key("override"))
		h.serve(func(context.Context, *asynq.Task) error { return nil }, nil)
		key := h.keyOf(task, h.queue, Key("override"))
		eventually(t, "the key cools", func() bool { return lockField(h, key, "k") != "" })
		if ty, kf := lockField(h, key, "ty"), lockField(h, key, "kf"); ty != "a11:cool" || kf != "k" {
			t.Errorf("cooling lock: ty %q kf %q", ty, kf)
		}
	})
	t.Run("release-hands-to-follow-up", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:rel": {Fields: []string{"user_id"}, OnConflict: Replace, OnRunning: RunningDefer}}})
		h.client = h.d.NewClient()
		started, gate := make(chan string, 4), make(chan struct{})
		h.serve(func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			started <- id
			<-gate
			return nil
		}, nil)
		defer close(gate)
		a := asynq.NewTask("a11:rel", []byte(`{"user_id":3,"v":1}`))
		h.enqueue(a)
		waitFor(t, started, "A runs")
		res, err := h.client.Submit(ctx, asynq.NewTask("a11:rel", []byte(`{"user_id":3,"v":2}`)), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("B: %+v %v", res, err)
		}
		if ok, err := h.d.Release(ctx, a, "", asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("Release: %v %v", ok, err)
		}
		key := h.keyOf(a, h.queue)
		if id := waitFor(t, started, "the follow-up runs"); id != res.TaskID {
			t.Fatalf("ran %s, want the follow-up %s", id, res.TaskID)
		}
		if ty, kf := lockField(h, key, "ty"), lockField(h, key, "kf"); ty != "a11:rel" || kf != "f:user_id" && kf != "" { // (unknown, never wrong)
			t.Errorf("lock handed to the follow-up by Release: ty %q kf %q (owner %s)", ty, kf, h.lockOwner(key))
		}
	})
	t.Run("relocated", func(t *testing.T) {
		h := newHarness(t, Config{Rules: map[string]Rule{"a11:reloc": {Key: "rule-key"}}})
		other := h.queue + "-other"
		c := h.d.WrapClient(queueMover{c: h.asynq, q: other})
		task := asynq.NewTask("a11:reloc", []byte(`{"user_id":9}`))
		res, err := c.Submit(ctx, task, asynq.Queue(h.queue), Fields("user_id"), modeRecordOption())
		if err != nil || res.Outcome != Created {
			t.Fatalf("submit: %+v %v", res, err)
		}
		key := h.keyOf(task, other, Fields("user_id"))
		if o := h.lockOwner(key); o != res.TaskID {
			t.Fatalf("lock in %s owned by %q, want %s", other, o, res.TaskID)
		}
		if ty, kf := lockField(h, key, "ty"), lockField(h, key, "kf"); ty != "a11:reloc" || kf != "f:user_id" {
			t.Errorf("relocated lock: ty %q kf %q", ty, kf)
		}
		if left := h.lockOwner(h.keyOf(task, h.queue, Fields("user_id"))); left != "" {
			t.Errorf("lock left in the first queue, owned by %s", left)
		}
	})
}

// README (operations): a key's mode record keeps its task type, verbatim;
// Lookup finds it. Type names with newlines, commas, markup, quotes and
// 1 KB, locked at enqueue (both clients) and at start (tasks from asynq's
// own client, start.lua).
func TestModeRecordKeepsOddTypeNamesVerbatim(t *testing.T) {
	types := []string{"a11:line\nbreak", "a11:a,b", "<script>alert(1)</script>", "a11:" + strings.Repeat("x", 1024), "a11:\"q\" \t=", "a11:é\u2028"}
	rules := map[string]Rule{}
	for _, typ := range types {
		rules[typ] = Rule{OnFailure: FailHold, FailHoldFor: time.Hour} // (a mode: the key keeps a mode record)
	}
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	direct := h.d.NewClient()
	for i, typ := range types {
		for j, c := range []*Client{h.client, direct} {
			task := asynq.NewTask(typ, fmt.Appendf(nil, "%d-%d", i, j))
			if _, err := c.Enqueue(task, asynq.Queue(h.queue)); err != nil {
				t.Fatalf("%q: %v", typ, err)
			}
			key := h.keyOf(task, h.queue)
			if got := lockField(h, key, "ty"); got != typ {
				t.Errorf("%q via client %d: ty %q", typ, j, got)
			}
			if l, found, err := h.d.Lookup(ctx, task, asynq.Queue(h.queue)); err != nil || !found || l.Key != key {
				t.Errorf("%q: Lookup %v %v", typ, found, err)
			}
		}
	}
	// Arrivals without a lock: start.lua records the type.
	running := make(chan string, len(types))
	gate := make(chan struct{})
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		if strings.HasPrefix(id, "a11-arrival") {
			running <- task.Type()
			<-gate
		}
		return nil
	}, nil)
	defer close(gate)
	for i, typ := range types {
		if _, err := h.asynq.Enqueue(asynq.NewTask(typ, []byte("arrival")), asynq.Queue(h.queue), asynq.TaskID(fmt.Sprintf("a11-arrival-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	for range types {
		typ := waitFor(t, running, "an arrival runs")
		key := h.keyOf(asynq.NewTask(typ, []byte("arrival")), h.queue)
		if got, kf := lockField(h, key, "ty"), lockField(h, key, "kf"); got != typ || kf != "p" {
			t.Errorf("arrival %q: ty %q kf %q", typ, got, kf)
		}
	}
}
