package dedup

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

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
