package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// profileSync is the debounced task of these tests, keyed on user_id.
// dueSecond is the whole unix second a debounce due at t is stored as:
// rounded up, so the task never runs early.
func dueSecond(t time.Time) int64 {
	s := t.Unix()
	if t.After(time.Unix(s, 0)) {
		s++
	}
	return s
}

func profileSync(typ string, user, seq int) *asynq.Task {
	return asynq.NewTask(typ, fmt.Appendf(nil, `{"user_id":%d,"seq":%d}`, user, seq))
}

// A burst of 1,000 Replace enqueues of one key, with Debounce, runs once,
// with the burst's last payload, Debounce after the last enqueue (within
// asynq's default 5 s scheduler tick), on both enqueue paths. The burst is
// paced to last longer than Debounce, so a due time that did not move with
// each enqueue would run the task in the middle of it.
func TestDebounceBurstRunsOnceWithTheLastPayload(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	const (
		typ   = "profile:sync"
		d     = 2 * time.Second
		burst = 1000
		tick  = 5 * time.Second // asynq's default DelayedTaskCheckInterval
		pace  = 3 * time.Millisecond
	)
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: d}}})
	type ran struct {
		id, payload string
		at          time.Time
	}
	runs := make(chan ran, 16)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		runs <- ran{id: id, payload: string(task.Payload()), at: time.Now()}
		return nil
	}, func(c *asynq.Config) { c.DelayedTaskCheckInterval = tick })

	type sent struct {
		id   string
		last time.Time
	}
	var wg sync.WaitGroup
	sents := make([]sent, 2)
	start := time.Now()
	for i, c := range []*Client{h.client, h.d.NewClient()} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := 1; seq <= burst; seq++ {
				time.Sleep(pace) // the time under test: the burst outlasts d
				res, err := c.Submit(context.Background(), profileSync(typ, i, seq), asynq.Queue(h.queue))
				want := Replaced
				if seq == 1 {
					want = Created
					sents[i].id = res.TaskID
				}
				if err != nil || res.Outcome != want || res.TaskID != sents[i].id {
					t.Errorf("user %d, enqueue %d: %+v, %v; want %v into %s", i, seq, res, err, want, sents[i].id)
					return
				}
			}
			sents[i].last = time.Now()
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	t.Logf("bursts lasted about %v", time.Since(start).Round(time.Millisecond))
	seen := map[string]ran{}
	for len(seen) < 2 {
		r := waitFor(t, runs, "the debounced runs")
		if _, dup := seen[r.id]; dup {
			t.Fatalf("task %s ran twice", r.id)
		}
		seen[r.id] = r
	}
	for i, s := range sents {
		r, ok := seen[s.id]
		var p struct{ UserID, Seq int }
		_ = json.Unmarshal([]byte(r.payload), &p)
		switch {
		case !ok:
			t.Fatalf("user %d: %s never ran; runs %v", i, s.id, seen)
		case p.Seq != burst:
			t.Errorf("user %d ran with payload %s, want the last (seq %d)", i, r.payload, burst)
		case r.at.Before(s.last.Add(d - time.Second)): // asynq's due times are whole seconds
			t.Errorf("user %d ran %v after the last enqueue, before the debounce of %v", i, r.at.Sub(s.last), d)
		case r.at.After(s.last.Add(d + tick + time.Second)):
			t.Errorf("user %d ran %v after the last enqueue, want within %v + one %v tick", i, r.at.Sub(s.last), d, tick)
		}
		t.Logf("user %d: ran %v after the burst's last enqueue", i, r.at.Sub(s.last).Round(time.Millisecond))
	}
	// Exactly once: every enqueue went into the one task, which is done,
	// and nothing of the type is left to run.
	h.settled(2)
	for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){h.insp.ListPendingTasks, h.insp.ListScheduledTasks, h.insp.ListRetryTasks} {
		if left, err := list(h.queue); err != nil || len(left) != 0 {
			t.Fatalf("tasks left: %v, %v", left, err)
		}
	}
}

// Each fold into a scheduled task moves its due time to Debounce after
// the fold (Replace and Merge), lengthening the lock; a task already due
// takes the payload but keeps its place; a debounced fold does not name
// its own ProcessIn as not applied.
func TestDebounceMovesTheDueTimeOfAScheduledTask(t *testing.T) {
	const d = time.Hour
	h := newHarness(t, Config{Rules: map[string]Rule{
		"deb:replace": {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: d},
		"deb:merge":   {Fields: []string{"key"}, OnConflict: Merge, MergeFunc: addMerge, Debounce: d},
	}})
	ctx := context.Background()
	due := func(id string) int64 {
		t.Helper()
		score, err := h.rdb.ZScore(ctx, "asynq:{"+h.queue+"}:scheduled", id).Result()
		if err != nil {
			t.Fatalf("ZSCORE %s: %v", id, err)
		}
		return int64(score)
	}
	tasks := map[string]func(seq int) *asynq.Task{
		"deb:replace": func(seq int) *asynq.Task { return profileSync("deb:replace", 1, seq) },
		"deb:merge": func(seq int) *asynq.Task {
			b, _ := json.Marshal(counterPayload{Key: "k", N: 1, Seq: seq})
			return asynq.NewTask("deb:merge", b)
		},
	}
	for typ, task := range tasks {
		for _, c := range []*Client{h.client, h.d.NewClient()} {
			before := time.Now()
			res, err := c.Submit(ctx, task(1), asynq.Queue(h.queue), asynq.ProcessIn(time.Minute))
			if err != nil || res.Outcome != Created {
				t.Fatalf("%s: first: %+v %v", typ, res, err)
			}
			if got := due(res.TaskID); got < before.Add(d).Unix() {
				t.Fatalf("%s: created due at %d, want Debounce (%v) from the enqueue, not its ProcessIn", typ, got, d)
			}
			h.rdb.ZAdd(ctx, "asynq:{"+h.queue+"}:scheduled", redis.Z{Score: float64(before.Unix() + 60), Member: res.TaskID}) // as if it had been due sooner
			h.rdb.PExpire(ctx, h.keyOf(task(1), h.queue), time.Minute)
			before = time.Now()
			fold, err := c.Submit(ctx, task(2), asynq.Queue(h.queue), asynq.ProcessIn(time.Second))
			if err != nil || fold.TaskID != res.TaskID || fold.NotApplied != nil {
				t.Fatalf("%s: fold: %+v %v; want folded into %s, nothing not applied", typ, fold, err, res.TaskID)
			}
			if got, lo, hi := due(res.TaskID), dueSecond(before.Add(d)), dueSecond(time.Now().Add(d)); got < lo || got > hi {
				t.Fatalf("%s: due at %d after the fold, want in [%d, %d]", typ, got, lo, hi)
			}
			if ttl := h.rdb.PTTL(ctx, h.keyOf(task(1), h.queue)).Val(); ttl < d {
				t.Fatalf("%s: lock lives %v after the fold, want at least the debounce %v", typ, ttl, d)
			}
			// Due now (pending): a fold lands but does not move it back.
			if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
				t.Fatal(err)
			}
			if fold, err := c.Submit(ctx, task(3), asynq.Queue(h.queue)); err != nil || fold.TaskID != res.TaskID || fold.Info.State != asynq.TaskStatePending {
				t.Fatalf("%s: fold into the pending task: %+v %v", typ, fold, err)
			}
			if err := h.insp.DeleteTask(h.queue, res.TaskID); err != nil {
				t.Fatal(err)
			}
			if _, err := h.d.Release(ctx, task(1), "", asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A debounced task under a caller-chosen ID keeps the index to its lock as
// long as the lock, however long the folds keep it waiting: when it runs,
// the middleware finds its lock (here keyed by a per-call Key, which the
// task's type rule could not recompute) and releases it after success.
func TestDebounceKeepsACallerChosenIDsIndex(t *testing.T) {
	t.Parallel()
	const typ = "deb:index"
	// (TTL is what the lock has left once the task is due: it covers asynq's
	// forwarder, which moves the task to pending every 100 ms here.)
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {OnConflict: Replace, Debounce: 500 * time.Millisecond}}})
	ctx := context.Background()
	id := "deb-" + uniq(t)
	opts := []asynq.Option{asynq.Queue(h.queue), Key("acct-7"), TTL(500 * time.Millisecond)}
	for seq := 1; seq <= 8; seq++ {
		callOpts := opts
		if seq == 1 {
			callOpts = append(opts[:len(opts):len(opts)], asynq.TaskID(id))
		} else {
			time.Sleep(250 * time.Millisecond) // the time under test: longer than TTL + Debounce in all
		}
		res, err := h.client.Submit(ctx, profileSync(typ, 1, seq), callOpts...)
		if err != nil || res.TaskID != id {
			t.Fatalf("enqueue %d: %+v %v", seq, res, err)
		}
	}
	if ttl := h.rdb.PTTL(ctx, taskLock(t, h.rdb, h.queue, id)).Val(); ttl < 500*time.Millisecond {
		t.Fatalf("lock PTTL %v after the folds, want TTL + Debounce from the last fold", ttl)
	}
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	if r := waitFor(t, rc.runs, "the debounced task runs"); r.id != id {
		t.Fatalf("ran %s", r.id)
	}
	h.settled(1)
	if ls := h.locks(); len(ls) != 0 {
		t.Fatalf("locks left after the success: %v", ls)
	}
	if s := h.d.Stats(); s.Released != 1 || s.Started != 1 {
		t.Fatalf("stats %+v: want the task run under its own lock and released", s)
	}
}

// Debounce + Merge under concurrent producers: every enqueue merged, the
// key runs once, after the burst.
func TestDebounceMergeOfConcurrentProducersRunsOnce(t *testing.T) {
	t.Parallel()
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
				_, err := clients[p%2].Submit(context.Background(), asynq.NewTask(typ, b), asynq.Queue(h.queue))
				for errors.Is(err, ErrContention) { // (documented: it changed nothing; the caller tries again)
					_, err = clients[p%2].Submit(context.Background(), asynq.NewTask(typ, b), asynq.Queue(h.queue))
				}
				if err != nil {
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
	if !errors.As(err, &dup) || dup.Holder != res.TaskID {
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
	t.Parallel()
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

// Debounce + MaxPending: a key whose folds keep it waiting (each moving its
// due time and lengthening its lock) still counts as waiting: a second key
// beyond the bound is refused for as long as the first waits.
func TestDebounceKeyStaysCountedByMaxPending(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
	const typ = "deb:id"
	// (TTL covers asynq's forwarder once the task is due: see
	// TestDebounceKeepsACallerChosenIDsIndex.)
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: 500 * time.Millisecond}}})
	rc := newRecorder(nil)
	ctx := context.Background()
	id := "deb-" + uniq(t)
	opts := []asynq.Option{asynq.Queue(h.queue), Key("acct-7"), TTL(500 * time.Millisecond)}
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

// README: "A folded call's payload lands in a task that keeps its own
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

// README (Debounce): "every enqueue folded into it while it is still
// scheduled moves its due time to d after that enqueue … rounded up: the
// task never comes due before d has passed since the last fold … A fold
// never moves a due time earlier (a holder scheduled later by its own
// ProcessIn keeps it)". Through Merge's compare-and-set path (fold).
func TestDebounceMergeFoldsMoveTheDueTimeOnlyLater(t *testing.T) {
	rule := Rule{Fields: []string{"key"}, OnConflict: Merge, MergeFunc: addMerge, Debounce: 1500 * time.Millisecond}
	bothPaths(t, Config{Rules: map[string]Rule{"counter": rule}}, func(t *testing.T, h *harness) {
		ctx := context.Background()
		due := func(id string) time.Time {
			t.Helper()
			score, err := h.rdb.ZScore(ctx, store.ScheduledKey(h.queue), id).Result()
			if err != nil {
				t.Fatalf("%s not scheduled: %v", id, err)
			}
			return time.Unix(int64(score), 0)
		}
		first := h.enqueue(counterTask("k", 1, 1))
		for seq := 2; seq <= 4; seq++ {
			before := time.Now()
			res, err := h.client.Submit(ctx, counterTask("k", 1, seq), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Merged || res.TaskID != first.ID {
				t.Fatalf("fold %d: %+v %v, want Merged into %s", seq, res, err, first.ID)
			}
			if d := due(first.ID); d.Before(before.Add(1500 * time.Millisecond)) {
				t.Fatalf("fold %d at %v: due at %v, earlier than 1.5 s later", seq, before.Format(time.StampMilli), d.Format(time.StampMilli))
			}
		}
		late := h.enqueue(counterTask("late", 1, 1), asynq.ProcessIn(time.Hour), Debounce(time.Hour)) // due in an hour
		was := due(late.ID)
		if _, err := h.client.Submit(ctx, counterTask("late", 1, 2), asynq.Queue(h.queue), Debounce(time.Second)); err != nil {
			t.Fatal(err)
		}
		if now := due(late.ID); now.Before(was) {
			t.Fatalf("a fold with a shorter Debounce moved the due time from %v to %v", was, now)
		}
	})
}
