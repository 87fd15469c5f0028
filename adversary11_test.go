package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
)

// Adversarial tests, round 11: the lock's recorded type and key form (ty,
// kf), acquire's renumbered ARGV, RunningAllow's counters, OptIn's
// untouched task IDs and the rule errors, through the public API on a real
// asynq server and redis-server. Each test quotes the promise it attacks.

// lockField reads what the lock at key says of one thing ("" when absent):
// "k" whether it cools ("1"), "id" its holder, any other field its mode
// record's (which keys with modes have: the type and key form among them).
func lockField(h *harness, key, field string) string {
	h.t.Helper()
	ctx := context.Background()
	switch field {
	case "k":
		if store.ParseValue(h.rdb.Get(ctx, key).Val()).Kind == store.HoldCooling {
			return "1"
		}
		return ""
	case "id":
		return h.lockOwner(key)
	}
	return h.rdb.HGet(ctx, modeKeyOf(key), field).Val()
}

// modeRecordOption is a mode that gives a key a mode record (a failure hold), for
// the tests of what the record keeps: a key whose policy acts only at
// enqueue has none.
func modeRecordOption() asynq.Option { return OnFailure(FailHold, time.Hour) }

// 1. Promise (feb5c5c, client.go): "under OptIn a type nothing deduplicates
// keeps asynq's task ID … A server whose rules cover the type guards it as
// any task that arrives without a lock"; (lifecycle) "Once no task with an
// ID exists, the ID can be used again, for any key, as asynq's own client
// allows"; (operations) Release: "a caller-chosen ID keeps its index key".
//
// Attack: a ruled task is enqueued under a caller-chosen ID; an operator
// releases its lock (the index stays, as documented) and deletes the task.
// The ID is reused for a task of a type with no rule (OptIn). Before the
// change the client marked such an ID opt-out in the index; now it writes
// nothing, so the server finds the stale index, takes the RULED key's lock
// for the unrelated, undeduplicated task and holds it while that runs: an
// enqueue of the ruled key is refused as a duplicate of a task that has
// nothing to do with it.
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

// 2. Promise (lifecycle, operations): a key's mode record keeps "how its
// key was chosen"; show's "keyed on" says it. Attack: a task locked at enqueue with
// per-call Fields on a type with no rule; Release frees its key; the task
// starts and takes its key again (as documented). The lock start.lua made
// recorded the server's rule's form (whole payload), not the form the
// fingerprint in the task ID was made with (fields user_id); now it records
// none (shown "-"), as the server cannot know the producer's.
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

// 3. Promise (keys.md): "Per-call options override the type's rule …
// Key or SharedKey beats Fields … KeyFunc beats Key, which beats Fields";
// the lock records the form actually used. Attack: every override
// combination; the recorded form must name the kind the fingerprint used
// (checked by where the lock is: keyOf with the same options) and Lookup
// with the same options finds it.
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

// 4. Promise (operations): "keyed on … by field names": `fields user_id`
// (or `fields user_id, report.kind`). Attack: a path whose member name
// holds a comma (a valid JSON member name, selectable with Fields) is
// recorded exactly as two paths would be: show cannot tell one field "a,b"
// from fields "a" and "b", which are different keys.
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

// 5. Promise (lifecycle): the lock keeps "the task's type and its key form"
// while it changes hands. Attack: a RunningDefer follow-up adopting the
// lock, a Cooldown lock after success, a follow-up handed the lock by
// Release, and a WrapClient call relocated to another queue by its
// enqueuer (with per-call Fields overriding a Key rule).
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

// 6. Promise (operations): a key's mode record keeps its task type,
// verbatim; Lookup finds it. Attack: type names with newlines, commas,
// markup, quotes and 1 KB, locked at enqueue (both clients) and at start
// (tasks from asynq's own client, start.lua).
func TestModeRecordKeepsOddTypeNamesVerbatim(t *testing.T) {
	types := []string{"a11:line\nbreak", "a11:a,b", "<script>alert(1)</script>", "a11:" + strings.Repeat("x", 1024), "a11:\"q\" \t=", "a11:é\u2028"}
	rules := map[string]Rule{}
	for _, typ := range types {
		rules[typ] = Rule{OnFailure: FailHold, FailureHold: time.Hour} // (a mode: the key keeps a mode record)
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

// 7. Promise (operations, 2fcd9c7): "a RunningAllow task now counts
// started, released (only when a lock was actually dropped as it started)
// and processed". Attack: a RunningAllow task from asynq's own client (no
// lock to drop), a RunningAllow task that fails once (its retry finds no
// lock) and one that panics once: exact counts, no release counted for
// nothing, nothing held.
func TestRunningAllowCountsExactly(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"a11:allow": {Fields: []string{"user_id"}, OnRunning: RunningAllow}}})
	var mu sync.Mutex
	tries := map[string]int{}
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		tries[id]++
		n := tries[id]
		mu.Unlock()
		switch {
		case task.Type() == "a11:allow:fail" && n == 1:
			return errors.New("a11: first attempt fails")
		case task.Type() == "a11:allow:panic" && n == 1:
			panic("a11: first attempt panics")
		}
		return nil
	}, nil)
	if _, err := h.asynq.Enqueue(asynq.NewTask("a11:allow:arrival", []byte(`{"user_id":1}`)), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	h.enqueue(asynq.NewTask("a11:allow:fail", []byte(`{"user_id":2}`)))
	if _, err := h.d.NewClient().Enqueue(asynq.NewTask("a11:allow:panic", []byte(`{"user_id":3}`)), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	want := map[string][3]uint64{ // started, processed, released
		"a11:allow:arrival": {1, 1, 0},
		"a11:allow:fail":    {2, 2, 1},
		"a11:allow:panic":   {2, 2, 1},
	}
	eventually(t, "every task done", func() bool {
		by := h.d.StatsByType()
		for typ, w := range want {
			if by[typ].Processed < w[1] {
				return false
			}
		}
		return h.queueSize(h.queue) == 0
	})
	by := h.d.StatsByType()
	for typ, w := range want {
		s := by[typ]
		if s.Started != w[0] || s.Processed != w[1] || s.Released != w[2] || s.Held != 0 || s.Busy != 0 || s.LockLost != 0 {
			t.Errorf("%s: %v; want started %d processed %d released %d, nothing held, busy or lost", typ, s.Map(), w[0], w[1], w[2])
		}
	}
	if len(h.locks()) != 0 {
		t.Errorf("locks left: %v", h.locks())
	}
}

// 8. Promise (feb5c5c): "Rule errors read `dedup: invalid option: rule for
// "x": …` and match ErrInvalidOption". Attack: every way a Rule can be
// invalid, with a type name that needs quoting.
func TestRuleErrorsNameTheRuleAndMatchErrInvalidOption(t *testing.T) {
	h := newHarness(t, Config{})
	merge := func(_, b []byte) ([]byte, error) { return b, nil }
	many := make([]string, 65) // above jsonkey.MaxFields (64)
	for i := range many {
		many[i] = fmt.Sprintf("f%d", i)
	}
	typ := "a11:\"odd\"\nname"
	for i, r := range []Rule{
		{Fields: []string{""}},
		{Fields: []string{"a..b"}},
		{Fields: many},
		{TTL: -time.Second},
		{MaxPending: -1},
		{OnConflict: 99},
		{OnRunning: 99},
		{OnBusy: 99},
		{OnConflict: Merge},
		{MergeFunc: merge},
		{Cooldown: -time.Second},
		{Cooldown: time.Hour, OnRunning: RunningAllow},
		{Debounce: time.Second},
		{Debounce: time.Second, OnConflict: Replace, OnRunning: RunningDefer},
	} {
		_, err := New(context.Background(), h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: map[string]Rule{typ: r}})
		want := fmt.Sprintf("dedup: invalid option: rule for %q: ", typ)
		switch {
		case err == nil:
			t.Errorf("%d: %+v accepted", i, r)
		case !errors.Is(err, ErrInvalidOption):
			t.Errorf("%d: %v does not match ErrInvalidOption", i, err)
		case !strings.HasPrefix(err.Error(), want) || strings.Count(err.Error(), "invalid option") != 1 || strings.HasSuffix(err.Error(), ": "):
			t.Errorf("%d: %q, want %q…", i, err, want)
		}
	}
}

// 9. Promise: the renumbering of acquire's ARGV broke no mode. Attack the
// optional arguments at their far end, where the renumbering moved them:
// Debounce with Merge and caller-chosen IDs on WrapClient (ARGV[20], [21]:
// the due time of a scheduled holder found by its index), MaxPending with a
// RunningDefer follow-up (ARGV[16], [17], [18]), Cooldown with Replace under
// a caller-chosen ID (ARGV[19]).
func TestModesPassedInAcquiresLastArgumentsWork(t *testing.T) {
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

// 10. Promise (feb5c5c): under OptIn a type with no rule keeps asynq's
// task ID, and "A server whose rules cover the type guards it as any task
// that arrives without a lock". Attack: one process enqueues two tasks of
// one user under OptIn without a rule; a server process has a rule for the
// type. Both run, once each, never at once; neither ID was rewritten.
func TestOptInUnruledTaskIsGuardedOnceByARuledServer(t *testing.T) {
	srv := newHarness(t, Config{Rules: map[string]Rule{"a11:g": {Fields: []string{"user_id"}}}})
	prod, err := New(context.Background(), srv.rdb, Config{Prefix: srv.prefix, OptIn: true, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = prod.Close() })
	var ids []string
	for i := range 2 {
		info, err := prod.NewClient().Enqueue(asynq.NewTask("a11:g", fmt.Appendf(nil, `{"user_id":7,"n":%d}`, i)), asynq.Queue(srv.queue))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(info.ID, "dx-") || strings.HasPrefix(info.ID, "dd-") {
			t.Errorf("ID %s rewritten", info.ID)
		}
		ids = append(ids, info.ID)
	}
	var cur, peak atomic.Int32
	var mu sync.Mutex
	runs := map[string]int{}
	first := make(chan struct{})
	var once sync.Once
	srv.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		if c := cur.Add(1); c > peak.Load() {
			peak.Store(c)
		}
		defer cur.Add(-1)
		mu.Lock()
		runs[id]++
		mu.Unlock()
		once.Do(func() {
			close(first)
			eventually(t, "the other task met the busy key", func() bool { return srv.d.Stats().Busy >= 1 })
		})
		return nil
	}, nil)
	<-first
	eventually(t, "both ran", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(runs) == 2
	})
	eventually(t, "queue drained", func() bool { return srv.queueSize(srv.queue) == 0 })
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if runs[id] != 1 {
			t.Errorf("%s ran %d times", id, runs[id])
		}
	}
	if peak.Load() > 1 {
		t.Errorf("two tasks of one key ran at once")
	}
}
