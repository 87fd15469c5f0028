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

// What the middleware does with a task that finds its key held when it
// starts (busy.go): a task without a lock meets its type's OnBusy (retry,
// fold, drop); a task locked at enqueue is retried, or superseded when a
// task of its type took the key later with a newer payload; on its last
// attempt it is copied rather than archived.

// A busy arrival folded into its holder (BusyFold) is ONE decision: a
// "busy" one naming the task now carrying its payload. It must not also be
// reported (and counted) as an enqueue "replaced" that nobody made.
func TestBusyFoldIsOneDecision(t *testing.T) {
	var rec decisions
	cfg := counterRules(Rule{OnBusy: BusyFold})
	cfg.OnDecision = rec.hook
	h := newHarness(t, cfg)
	holder := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour)) // waiting, holds the key
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	arrival, err := h.asynq.Enqueue(counterTask("k", 2, 2), asynq.Queue(h.queue), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "arrival folded and done", func() bool { return h.taskState(arrival.ID) == asynq.TaskStateCompleted })
	if got := h.payloadOf(holder.ID); got != string(counterTask("k", 2, 2).Payload()) {
		t.Fatalf("holder payload %s, want the arrival's", got)
	}
	heard := rec.all()
	key := h.keyOf(counterTask("k", 0, 0), h.queue)
	want := Decision{Event: "busy", Type: "counter", Queue: h.queue, Key: key, TaskID: holder.ID}
	if len(heard) != 1 || heard[0] != want {
		t.Fatalf("OnDecision heard %+v, want only %+v", heard, want)
	}
	if s := h.d.StatsByType()["counter"]; s.Replaced != 0 || s.Busy != 1 {
		t.Fatalf("counted replaced %d, busy %d: the busy fold counted as an enqueue too", s.Replaced, s.Busy)
	}
}

// BusyFold where it cannot fold (the running holder's lock does not
// defer): the arrival is retried, never dropped, and runs with its own
// payload once the holder is done. No "duplicate" decision is invented for
// an enqueue nobody made.
func TestBusyFoldBehindARunThatDoesNotDeferIsRetriedNotLost(t *testing.T) {
	var rec decisions
	cfg := counterRules(Rule{OnBusy: BusyFold}) // OnRunning: RunningReject
	cfg.OnDecision = rec.hook
	h := newHarness(t, cfg)
	holder := h.enqueue(counterTask("k", 1, 1))
	release := make(chan struct{})
	errs := make(chan error, 100)
	rc := newRecorder(func(r run) error {
		if r.id == holder.ID {
			<-release
		}
		return nil
	})
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { errs <- err })
	})
	if r := waitFor(t, rc.runs, "holder runs"); r.id != holder.ID {
		t.Fatalf("ran %s first", r.id)
	}
	arrival, err := h.asynq.Enqueue(counterTask("k", 2, 2), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if err := waitFor(t, errs, "busy arrival's error"); !errors.Is(err, ErrKeyBusy) {
		t.Fatalf("arrival error %v, want ErrKeyBusy", err)
	}
	close(release)
	r := waitFor(t, rc.runs, "arrival runs after the holder")
	if r.id != arrival.ID || string(r.task.Payload()) != string(counterTask("k", 2, 2).Payload()) {
		t.Fatalf("ran %s with %s, want the arrival %s with its payload", r.id, r.task.Payload(), arrival.ID)
	}
	for _, d := range rec.all() {
		if d.Event != "busy" {
			t.Errorf("decision %+v for a busy arrival that could not fold; want only busy", d)
		}
	}
}

// BusyFold across types sharing a key (a prefix rule with Shared): the
// arrival's payload must not land in the other type's task; it is retried.
func TestBusyFoldNeverCrossesTypes(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"job:": {Key: "k", Shared: true, OnBusy: BusyFold, OnConflict: Replace, OnRunning: RunningDefer}}})
	holder := h.enqueue(asynq.NewTask("job:a", []byte(`{"a":1}`)), asynq.ProcessIn(time.Hour))
	errs := make(chan error, 100)
	rc := newRecorder(nil)
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { errs <- err })
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
	})
	arrival, err := h.asynq.Enqueue(asynq.NewTask("job:b", []byte(`{"b":2}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if err := waitFor(t, errs, "busy arrival's error"); !errors.Is(err, ErrKeyBusy) {
		t.Fatalf("arrival error %v, want ErrKeyBusy", err)
	}
	if got := h.payloadOf(holder.ID); got != `{"a":1}` {
		t.Fatalf("job:b's payload landed in job:a's task: %s", got)
	}
	// (asynq calls its ErrorHandler before it moves the task to retry.)
	eventually(t, "the arrival waits for its retry", func() bool { return h.taskState(arrival.ID) == asynq.TaskStateRetry })
}

// A task enqueued under a per-call key that lost its lock (Release, or
// TTL) and meets that key held by another task when it starts is busy ON
// THAT KEY. BusyFold must fold it into that key's holder, not re-key it by
// the type's rule into a new task that runs beside the holder.
func TestBusyFoldKeepsThePerCallKey(t *testing.T) {
	var rec decisions
	h := newHarness(t, Config{OnDecision: rec.hook, Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}, OnBusy: BusyFold}}})
	ctx := context.Background()
	a := h.enqueue(userTask(1, "a"), Key("tenant-7"))
	if ok, err := h.d.Release(ctx, userTask(1, "a"), a.ID, asynq.Queue(h.queue), Key("tenant-7")); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	b := h.enqueue(userTask(2, "b"), Key("tenant-7"), asynq.ProcessIn(time.Hour)) // now holds tenant-7, waiting
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	eventually(t, "a done", func() bool {
		st := h.taskState(a.ID)
		return st == 0 || st == asynq.TaskStateCompleted
	})
	for _, d := range rec.all() {
		if d.Event == "busy" && d.TaskID != b.ID && h.taskState(b.ID) == asynq.TaskStateScheduled {
			r := waitFor(t, rc.runs, "the task a was folded into")
			t.Errorf("task %s ran %s while %s still holds tenant-7: a was re-keyed by the type's rule", r.id, r.task.Payload(), b.ID)
		}
	}
	if got := h.payloadOf(b.ID); got != string(userTask(1, "a").Payload()) {
		t.Errorf("holder %s of tenant-7 kept %s: a's payload was not folded into it", b.ID, got)
	}
	for _, d := range rec.all() {
		if d.Event == "busy" && d.TaskID != b.ID {
			t.Errorf("busy decision %+v names %s, not tenant-7's holder %s", d, d.TaskID, b.ID)
		}
	}
}

// README (Caveats): "a task that meets a busy key at execution on its
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
	t.Parallel() // mostly waiting: beside the other waiting tests
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
			t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
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

// README: Replace is for "state: only the newest matters … the task
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

// README (tasks that arrive without a lock): "BusyRetry (default: a
// *BusyError matching ErrKeyBusy, retried later without using up retries
// …; never archived for being busy)"; Caveats: "a task that meets a busy
// key at execution on its last attempt is not returned as busy: the
// middleware schedules a copy of it (same message, new task ID) one Lease
// later. Code that tracks such a task by its ID sees it completed and the
// copy run." A Scheduler firing (no lock) of a Replace type carries a newer
// payload than the waiting holder it meets, on its last attempt: its copy
// must still run once the key is free — not be thrown away as
// "superseded", which is meant for a task whose lock a newer task took.
func TestBusyLastAttemptCopyOfAnArrivalStillRuns(t *testing.T) {
	t.Parallel()
	cfg := counterRules(Rule{OnConflict: Replace})
	cfg.heartbeat = (time.Second) / 3 // the copy comes due one Lease later
	h := newHarness(t, cfg)
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	holder := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour))
	if _, err := h.asynq.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.MaxRetry(0)); err != nil {
		t.Fatal(err)
	}
	// The arrival meets the waiting holder (busy, copied), then its copy
	// meets it too, a Lease later.
	eventually(t, "the arrival's copy meets the key", func() bool { s := h.d.Stats(); return s.Busy >= 2 || s.Superseded >= 1 })
	if err := h.insp.RunTask(h.queue, holder.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		s := h.d.Stats()
		t.Fatalf("the arrival's newer payload (seq 2) never ran after the holder %s (seq 1): its last-attempt copy was dropped (busy %d, superseded %d); runs: %+v",
			holder.ID, s.Busy, s.Superseded, tr.runs())
	}
}

// README (lifecycle): "a task locked at enqueue finds its key held by
// another task (its lock was released, or expired) → its type's OnBusy, as
// for a task without a lock, except: a Replace type's does not run
// (superseded: the other task took the key later and carries the newer
// payload)"; Caveats: "Replace, Merge and Defer fold a payload only into a
// task of its own type: with a shared key another type's holder makes the
// call a duplicate". A task of another type that took a shared key carries
// none of this type's payload: the released task must not be dropped as
// superseded by it.
func TestBusySupersededOnlyByATaskThatCarriesItsPayload(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"a7:state": {Key: "tenant-7", Shared: true, OnConflict: Replace},
		"a7:other": {Key: "tenant-7", Shared: true},
	}})
	ctx := context.Background()
	mine := h.enqueue(asynq.NewTask("a7:state", []byte(`{"key":"k","seq":1}`)))
	if ok, err := h.d.Release(ctx, asynq.NewTask("a7:state", nil), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	other := h.enqueue(asynq.NewTask("a7:other", []byte(`{"key":"k","seq":2}`)), asynq.ProcessIn(time.Hour))
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	eventually(t, "the released task meets the other type's holder", metKeyHeld(h.d, 1))
	if err := h.insp.RunTask(h.queue, other.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		t.Fatalf("the other type's task %s never ran", other.ID)
	}
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil {
		t.Fatalf("task %s (type a7:state, the only carrier of its payload) never ran: dropped as superseded (superseded %d) by %s, a task of another type",
			mine.ID, h.d.Stats().Superseded, other.ID)
	}
}

// README (When Redis fails): "Fail-open (FailOpen: true): the task is
// enqueued (or run) without the lock, logged and counted … A fail-open
// enqueue still carries a dd- ID, so the middleware takes the lock when it
// starts"; Replace is for "state: only the newest matters". A newer
// payload enqueued fail-open while an older task of the key waits must not
// be thrown away as "superseded" when it starts: that older task did not
// take the key later, and does not carry the newer payload.
func TestBusyNeverSupersedesAFailOpenNewerPayload(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace})
	h := newHarness(t, cfg)
	ocfg := counterRules(Rule{OnConflict: Replace})
	ocfg.FailOpen = true
	proxy, od := proxiedLockStore(t, h, ocfg)
	producer := od.WrapClient(h.asynq)
	holder := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour))
	proxy.close() // the lock store is down for this producer; asynq is not
	newer, err := producer.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || od.Stats().FailOpen == 0 {
		t.Fatalf("fail-open enqueue: %v %v (fail-open %d)", newer, err, od.Stats().FailOpen)
	}
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	eventually(t, "the fail-open task meets the key", metKeyHeld(h.d, 1))
	if err := h.insp.RunTask(h.queue, holder.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil {
		t.Fatalf("the holder %s never ran", holder.ID)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		t.Fatalf("the newest payload (seq 2, fail-open task %s) never ran: it was dropped as superseded (%d) by the older holder %s (seq 1), which ran last",
			newer.ID, h.d.Stats().Superseded, holder.ID)
	}
}

// README (Lock API): "if another task of the key holds it by then, the
// holder meets its type's OnBusy as a busy task does (never dropped for a
// Merge type)". With SkipBusy (BusyDrop for every type), a released Merge
// task that meets the key's new task must still run its units.
func TestBusyNeverDropsAReleasedMergeTask(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Merge, MergeFunc: addMerge})
	cfg.SkipBusy = true
	h := newHarness(t, cfg)
	ctx := context.Background()
	h.enqueue(counterTask("k", 1, 1))
	if ok, err := h.d.Release(ctx, counterTask("k", 0, 0), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	next := h.enqueue(counterTask("k", 2, 2), asynq.ProcessIn(time.Hour))
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	eventually(t, "the released task meets the key", metKeyHeld(h.d, 1))
	if err := h.insp.RunTask(h.queue, next.ID); err != nil {
		t.Fatal(err)
	}
	ok := within(8*time.Second, func() bool {
		sum := 0
		for _, r := range tr.runs() {
			sum += r.n
		}
		return sum >= 3
	})
	if !ok {
		t.Fatalf("units run: %+v, want 1 + 2 (the released Merge task was dropped)", tr.runs())
	}
}

// README (RunningAllow): "A retry that finds the key taken since runs
// beside a task that waits, and is retried behind one that runs"; (busy)
// "A task locked at enqueue is never dropped or folded"; Caveats: on its
// last attempt "the middleware schedules a copy of it … Code that tracks
// such a task by its ID sees it completed and the copy run". The retry is
// the task's last attempt (MaxRetry 1) and meets a running holder (a task
// of another type on a shared key, RunningReject): it must be retried and
// run once the holder is done, even where its type's OnBusy is BusyDrop.
func TestRunningAllowLastRetryBehindARunningHolderIsNotDropped(t *testing.T) {
	t.Parallel()
	for _, maxRetry := range []int{1, 5} {
		t.Run(fmt.Sprintf("MaxRetry=%d", maxRetry), func(t *testing.T) {
			var mu sync.Mutex
			var heard []Decision
			cfg := Config{heartbeat: (time.Second) / 3, Rules: map[string]Rule{
				"counter":  {Key: "t8", Shared: true, OnRunning: RunningAllow, OnBusy: BusyDrop},
				"a8:other": {Key: "t8", Shared: true},
			}, OnDecision: func(d Decision) { mu.Lock(); heard = append(heard, d); mu.Unlock() }}
			h := newHarness(t, cfg)
			h.client = h.d.NewClient()
			ctx := context.Background()
			retryGate := make(chan struct{})
			tr := newAttemptTracker(func(r trackedAttempt) error {
				if r.seq == 1 && r.retry == 0 {
					return errors.New("first attempt fails")
				}
				return nil
			})
			tr.gate(2, 0)
			t.Cleanup(tr.openAll)
			var once sync.Once
			h.serve(tr.handler(), func(c *asynq.Config) {
				c.RetryDelayFunc = func(n int, err error, _ *asynq.Task) time.Duration {
					if IsFailure(err) {
						once.Do(func() { <-retryGate })
					}
					return 100 * time.Millisecond
				}
			})
			first := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(maxRetry))
			waitFor(t, tr.starts, "the first attempt")
			// The key is free while the first waits for its retry: a task of
			// another type takes it, and runs (held).
			second, err := h.client.Submit(ctx, asynq.NewTask("a8:other", []byte(`{"key":"k","seq":2}`)), asynq.Queue(h.queue))
			if err != nil || second.Outcome != Created {
				t.Fatalf("second: %+v %v", second, err)
			}
			if r := waitAttemptOf(tr.starts, 2, 10*time.Second); r == nil {
				t.Fatal("the second never ran")
			}
			close(retryGate)
			eventually(t, "the retry meets the running holder", func() bool { return h.d.Stats().Busy >= 1 })
			if maxRetry == 1 {
				// The last-attempt copy (due one Lease later) meets the
				// still-running holder too.
				eventually(t, "the copy meets the running holder", func() bool { return h.d.Stats().Busy >= 2 })
			}
			tr.open(2, 0)
			if r := waitAttemptOf(tr.starts, 1, 10*time.Second); r == nil {
				s := h.d.Stats()
				mu.Lock()
				defer mu.Unlock()
				t.Fatalf("the work of %s (seq 1, accepted at enqueue, RunningAllow) never ran again after it met the running holder %s: busy %d; decisions %+v",
					first.ID, second.TaskID, s.Busy, heard)
			}
			if o := tr.overlapsSeen(); len(o) > 0 {
				t.Fatalf("overlaps: %v", o)
			}
		})
	}
}

// A task that arrived without a lock, put back by a shutdown its handler
// outlived, meets that handler (still running) as its key's holder when a
// new server hands it out. Whatever its OnBusy it is returned as busy, and
// archived on its last attempt: the handler does the work. A drop would
// lose the work should that handler fail; a fold (a follow-up behind the
// handler) or a last-attempt copy would run it a second time.
func TestBusyBehindItsOwnGivenUpHandlerIsRetriedWhateverThePolicy(t *testing.T) {
	t.Parallel()
	for _, busy := range []Busy{BusyDrop, BusyFold} {
		for _, maxRetry := range []int{3, 0} {
			t.Run(fmt.Sprintf("%v/MaxRetry(%d)", busy, maxRetry), func(t *testing.T) {
				h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, OnBusy: busy}))
				handler, started, finish := outlivingHandler(t, h)
				_, stop1 := serveRaw(t, h.rdb, h.queue, handler, func(c *asynq.Config) { c.ShutdownTimeout = 200 * time.Millisecond })
				a, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.MaxRetry(maxRetry))
				if err != nil {
					t.Fatal(err)
				}
				waitFor(t, started, "the arrival's first run")
				stop1() // asynq puts the task back; its handler goes on
				serveRaw(t, h.rdb, h.queue, handler, nil)

				want := asynq.TaskStateRetry
				if maxRetry == 0 {
					want = asynq.TaskStateArchived
				}
				eventually(t, "the task meets its own handler and is returned as busy", func() bool { return h.d.Stats().Busy >= 1 })
				eventually(t, "asynq records the busy attempt", func() bool { return h.taskState(a.ID) != asynq.TaskStateActive })
				if got := h.taskState(a.ID); got != want {
					t.Errorf("%s is in state %d after meeting its own running handler (0: gone), want %v", a.ID, int(got), want)
				}
				if n := queueTasks(t, h); n != 1 {
					t.Errorf("the queue holds %d tasks, want only %s: a fold or a copy owes the key a second run", n, a.ID)
				}
				if len(started) > 0 {
					t.Errorf("the task ran again beside its own handler")
				}
				// The handler's late success: asynq gave its attempt up, so the
				// key follows asynq's record of the task: held by it while it
				// waits for its retry (an enqueue folds into it), free for the
				// next enqueue once it is archived.
				finish()
				h.settled(1) // the handler's end
				res, err := h.d.NewClient().Submit(context.Background(), counterTask("k", 2, 2), asynq.Queue(h.queue))
				switch {
				case err != nil:
					t.Errorf("enqueue of the key after the handler ended: %v", err)
				case maxRetry > 0 && (res.Outcome != Replaced || res.TaskID != a.ID):
					t.Errorf("enqueue of the key while %s waits for its retry: %v into %s, want replaced into it", a.ID, res.Outcome, res.TaskID)
				case maxRetry == 0 && res.Outcome != Created:
					t.Errorf("enqueue of the key after %s was archived: %v into %s, want created", a.ID, res.Outcome, res.TaskID)
				}
			})
		}
	}
}
