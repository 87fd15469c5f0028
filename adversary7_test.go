package dedup

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Adversarial tests, round 7: the code that changed after round 6 — what a
// task that finds its key held does (busy.go), relocation, releases that
// owe a follow-up, MaxPending's pruning, servers of another prefix, the
// caller-ID namespace, clamped durations and definitive refusals — through
// the public API on a real asynq server and redis-server. Each test quotes
// the README promise it checks and fails if the promise breaks.

// ---- helpers ----

// ---- 1. busy.go: a busy arrival's last-attempt copy ----

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

// ---- 2. busy.go: superseded by another type's task ----

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

// ---- 3. busy.go: a fail-open enqueue ----

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

// ---- 4. relocate.go: a relocated task a worker took first ----

// takenFirstEnqueuer is an Enqueuer that puts every task in its own queue and
// returns only once a worker has taken it (a slow decorator on a busy
// server): the relocation finds the task gone from the pending list.
type takenFirstEnqueuer struct {
	c    *asynq.Client
	insp *asynq.Inspector
	q    string
}

func (m takenFirstEnqueuer) Enqueue(t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return m.EnqueueContext(context.Background(), t, opts...)
}

func (m takenFirstEnqueuer) EnqueueContext(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	info, err := m.c.EnqueueContext(ctx, t, append(append([]asynq.Option(nil), opts...), asynq.Queue(m.q))...)
	if err != nil {
		return info, err
	}
	within(10*time.Second, func() bool {
		ti, err := m.insp.GetTaskInfo(m.q, info.ID)
		return err != nil || ti.State != asynq.TaskStatePending
	})
	return info, nil
}

// README (lifecycle, "task lands in another queue than the lock"): "the
// task is taken back out before a worker takes it, and the call is made
// again in that queue … is folded into the key's task there (Replace …).
// A task a worker took first meets its key when it starts." A Replace call
// whose task a worker took first in the other queue, where an older task
// of the key waits, carries the newest payload: it must not be dropped as
// "superseded" by that older task.
func TestRelocatedTaskAWorkerTookFirstKeepsTheNewestPayload(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace}))
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	holder := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour)) // waits in the server's queue
	c := h.d.WrapClient(takenFirstEnqueuer{c: h.asynq, insp: h.insp, q: h.queue})
	res, err := c.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue+"-asked"))
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	eventually(t, "the relocated task meets the key", metKeyHeld(h.d, 1))
	if err := h.insp.RunTask(h.queue, holder.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil {
		t.Fatalf("the holder %s never ran", holder.ID)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		t.Fatalf("the newest payload (seq 2, %+v) never ran: dropped as superseded (%d) by the older holder %s", res, h.d.Stats().Superseded, holder.ID)
	}
}

// ---- 5, 6. prefix.go: a server of another prefix ----

// README: "a server whose prefix differs follows the producer's lock when
// it finds none under its own"; lifecycle: "the key's own follow-up, run
// early by an operator, is retried and runs after the holder";
// RunningDefer "never runs two tasks of a key at once". On a server of
// another prefix, an operator runs the parked follow-up now while its
// holder runs: it must wait for the holder, not run beside it.
func TestServerWithAnotherPrefixMakesAFollowUpRunEarlyWait(t *testing.T) {
	rules := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	tr := newSeqTracker(0)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	first := h.enqueue(counterTask("k", 1, 0))
	if r := waitFor(t, tr.starts, "the holder runs"); r.id != first.ID {
		t.Fatalf("ran %s, want %s", r.id, first.ID)
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(15 * time.Second)
wait:
	for {
		select {
		case r := <-tr.starts:
			t.Fatalf("the follow-up %s (seq %d) started while its holder %s ran (running beside it: %v)", r.id, r.seq, first.ID, r.overlaps)
		case <-tick.C:
			if server.Stats().Busy >= 1 {
				break wait // it met its key held: it waits
			}
		case <-timeout:
			t.Fatal("the follow-up run now was never picked up")
		}
	}
	tr.open(0)
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil {
		t.Fatalf("the follow-up %s never ran after its holder", res.TaskID)
	}
}

// README (Lock API): Release "deletes the lock …, never a task: the
// holder, if alive, still runs … and takes the key again when it starts if
// the key is free; if another task of the key holds it by then, the holder
// meets its type's OnBusy as a busy task does"; "a server whose prefix
// differs follows the producer's lock". On a server of another prefix, a
// released holder that starts while the key's new task runs must meet it
// (busy), not run beside it.
func TestServerWithAnotherPrefixMakesAReleasedHolderMeetTheKey(t *testing.T) {
	rules := counterRules(Rule{}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	released := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour))
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), released.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	next := h.enqueue(counterTask("k", 1, 2))
	tr := newSeqTracker(2)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	if r := waitFor(t, tr.starts, "the key's new task runs"); r.id != next.ID {
		t.Fatalf("ran %s, want %s", r.id, next.ID)
	}
	if err := h.insp.RunTask(h.queue, released.ID); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(15 * time.Second)
	for {
		select {
		case r := <-tr.starts:
			t.Fatalf("the released holder %s started while the key's task %s ran (beside: %v)", r.id, next.ID, r.overlaps)
		case <-tick.C:
			if server.Stats().Busy >= 1 {
				return
			}
		case <-timeout:
			t.Fatal("the released holder was never picked up")
		}
	}
}

// ---- 7. locks.go: a release while the holder runs ----

// README (Lock API): "A follow-up the lock owes that waits is queued now,
// as it carries the newest payload (unless the holder is running: its end
// queues it)." A key released (forced, or owner-checked) while its holder
// runs with a follow-up owed: when the run ends, the follow-up must be
// queued then, not left parked for two leases (a minute by default).
func TestReleaseWhileTheHolderRunsLeavesItsEndToQueueTheFollowUp(t *testing.T) {
	for _, forced := range []bool{true, false} {
		t.Run(fmt.Sprintf("forced=%v", forced), func(t *testing.T) {
			h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
			tr := newSeqTracker(0)
			h.serve(tr.handler(), nil)
			t.Cleanup(tr.openAll)
			ctx := context.Background()
			first := h.enqueue(counterTask("k", 1, 0))
			waitFor(t, tr.starts, "the holder runs")
			res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("update while running: %+v %v, want Deferred", res, err)
			}
			holder := first.ID
			if forced {
				holder = ""
			}
			if ok, err := h.d.Release(ctx, counterTask("k", 1, 0), holder, asynq.Queue(h.queue)); err != nil || !ok {
				t.Fatalf("Release(%q): %v %v", holder, ok, err)
			}
			tr.open(0)
			waitFor(t, tr.ends, "the holder's run ends")
			if r := waitSeqStart(tr, 1, 6*time.Second); r == nil {
				t.Fatalf("the follow-up %s was not queued when its holder's run ended: %s, due in %v (a Release while the holder ran)",
					res.TaskID, taskStateName(h, res.TaskID), dueIn(h, res.TaskID))
			}
		})
	}
}

// ---- 8. Config: durations clamped, never wrapping ----

// README (Configuration): "Every duration (in Config, a Rule or an option,
// and what RetryDelayFunc returns) above dedup.MaxLifetime (100 years) is
// taken as MaxLifetime, and lifetimes add up without wrapping, so
// math.MaxInt64 means 'as long as can be'". Config.ConnectBackoff and
// Config.BreakerBackoff are durations of the Config: "forever" must
// neither panic nor wrap to no wait at all.
func TestForeverBackoffsNeverWrap(t *testing.T) {
	noPanic := func(t *testing.T, what string, f func()) (panicked bool) {
		t.Helper()
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("%s panicked: %v", what, p)
				panicked = true
			}
		}()
		f()
		return false
	}
	t.Run("Backoff.Delay", func(t *testing.T) {
		forever := Backoff{Min: math.MaxInt64, Max: math.MaxInt64}
		noPanic(t, "Backoff{MaxInt64, MaxInt64}.Delay(0)", func() { _ = forever.Delay(0) })
		long := Backoff{Min: time.Hour, Max: math.MaxInt64}
		zero := 0
		for range 20 {
			if long.Delay(40) == 0 {
				zero++
			}
		}
		if zero == 20 {
			t.Errorf("Backoff{Min: 1h, Max: MaxInt64}.Delay(40) is always 0: the doubling wrapped (want a wait up to MaxLifetime)")
		}
	})
	t.Run("New with ConnectBackoff forever", func(t *testing.T) {
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		var err error
		if noPanic(t, "New with ConnectBackoff{MaxInt64, MaxInt64}", func() {
			_, err = New(ctx, rdb, Config{ConnectAttempts: 3, ConnectBackoff: Backoff{Min: math.MaxInt64, Max: math.MaxInt64}, Logger: quietLogger()})
		}) {
			return
		}
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("New against no Redis: %v, want ErrUnavailable", err)
		}
	})
}

// ---- 9. busy.go + again.lua: a follow-up run early on its last attempt ----

// README (lifecycle): "the key's own follow-up, run early by an operator,
// is retried and runs after the holder"; "a last-attempt busy task is
// copied as da-<fingerprint>-…, and a follow-up's copy takes its place in
// the lock" (the brief); RunningDefer "never runs two tasks of a key at
// once … When the run ends … the follow-up is queued". A follow-up that
// inherits MaxRetry(0) and is run now while its holder runs: its payload
// runs once, after the holder, never beside it.
func TestFollowUpRunEarlyOnItsLastAttemptRunsOnceAfterTheHolder(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.heartbeat = (1500 * time.Millisecond) / 3
	h := newHarness(t, cfg)
	tr := newSeqTracker(0)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	ctx := context.Background()
	first := h.enqueue(counterTask("k", 1, 0), asynq.MaxRetry(0))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follow-up meets its running holder", metKeyHeld(h.d, 1))
	// Let the copy's first due time (one Lease) pass while the holder runs.
	select {
	case r := <-tr.starts:
		t.Fatalf("%s (seq %d) started while the holder %s ran (beside: %v)", r.id, r.seq, first.ID, r.overlaps)
	case <-time.After(2 * 3 * cfg.heartbeat): // time under test: the copy's due time passing
	}
	tr.open(0)
	r := waitSeqStart(tr, 1, 8*time.Second)
	if r == nil {
		t.Fatalf("the follow-up's payload (seq 1) never ran after the holder; follow-up %s is %s", res.TaskID, taskStateName(h, res.TaskID))
	}
	if len(r.overlaps) > 0 {
		t.Fatalf("%s ran beside %v", r.id, r.overlaps)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	n := 0
	for _, x := range tr.runs() {
		if x.seq == 1 {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("the follow-up's payload ran %d times, want once: %+v", n, tr.runs())
	}
}

// ---- 10. busy.go: a Merge type is never dropped ----

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

// ---- 11. heartbeat.go: the watch, for a caller-chosen ID ----

// README (RunningDefer): "After a failure with retries left it waits for
// the retry …; if an operator then deletes or archives the waiting task,
// the server that held it queues the follow-up within a heartbeat". The
// holder here has a caller-chosen ID (its lock found through its index).
func TestFollowUpQueuedWhenItsRetryingCallerIDHolderIsDeleted(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 2})
	cfg.heartbeat = (1500 * time.Millisecond) / 3
	h := newHarness(t, cfg)
	fail := make(chan struct{})
	rc := newRecorder(func(r run) error {
		if decodeCounter(r.task).Seq == 0 {
			<-fail
			return errors.New("try again later")
		}
		return nil
	})
	h.serve(rc.handler(), retryInAnHour)
	ctx := context.Background()
	id := "a7-" + uniq(t)
	h.enqueue(counterTask("k", 1, 0), asynq.TaskID(id))
	waitFor(t, rc.runs, "the first attempt")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	close(fail)
	h.settled(1)
	eventually(t, "asynq schedules the retry", func() bool { return h.taskState(id) == asynq.TaskStateRetry })
	if err := h.insp.DeleteTask(h.queue, id); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-rc.runs:
		if r.id != res.TaskID || decodeCounter(r.task).Seq != 1 {
			t.Fatalf("ran %s seq %d, want the follow-up %s", r.id, decodeCounter(r.task).Seq, res.TaskID)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("the follow-up %s was not queued within a heartbeat (%v) of its holder's deletion: %s, due in %v",
			res.TaskID, 3*cfg.heartbeat/3, taskStateName(h, res.TaskID), dueIn(h, res.TaskID))
	}
}

// ---- 13. acquire / exec: a definitive refusal on the direct path ----

// README (Failure modes): "Redis refuses the call before running it, for a
// reason that refuses any copy too (NOPERM, …) → nothing was stored, and a
// late copy would be refused as well: not 'outcome unknown' → ErrUnavailable
// wrapping Redis's reply". A user whose ACL lacks asynq's task keys (the
// README's ACL guidance not followed) is refused NOPERM on NewClient's
// direct path: that is no unknown outcome.
func TestNoPermOnTheDirectPathIsUnavailableNotUnknown(t *testing.T) {
	needRealRedis(t)
	admin := newRDB(t)
	ctx := context.Background()
	name := "a7-" + uniq(t)
	prefix := "a7p-" + name
	if err := admin.Do(ctx, "ACL", "SETUSER", name, "on", ">pw", "~"+prefix+":*", "~dedup:*", "~asynq:queues", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", name) })
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), Username: name, Password: "pw"})
	t.Cleanup(func() { _ = rdb.Close() })
	h := newHarnessOn(t, rdb, Config{Prefix: prefix, Rules: counterRules(Rule{}).Rules})
	_, err := h.d.NewClient().Enqueue(counterTask("k", 1, 0), asynq.Queue(h.queue))
	var re redis.Error
	switch {
	case err == nil:
		t.Fatal("enqueue succeeded without access to asynq's keys")
	case !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown):
		t.Fatalf("enqueue refused NOPERM: %v, want ErrUnavailable and not ErrOutcomeUnknown", err)
	case !errors.As(err, &re):
		t.Fatalf("enqueue refused NOPERM: %v, want Redis's reply kept as the cause", err)
	}
	if n := admin.LLen(ctx, store.PendingKey(h.queue)).Val(); n != 0 {
		t.Fatalf("%d tasks stored", n)
	}
}

// ---- 14. prefix.go: an opted-out caller ID on a server of another prefix ----

// README (Choosing the key): Skip: "none: no lock at enqueue or at
// execution"; "a server whose prefix differs follows the producer's lock
// when it finds none under its own — a task locked at enqueue, or a
// caller-chosen ID with an index under the other prefix"; Key layout:
// "dedup:{<queue>}:i:<task ID> | lock of a caller-chosen task ID (or its
// opt-out mark)". A task enqueued with Skip() under a caller-chosen ID must
// run unguarded on a server of another prefix too: not be dropped as busy
// (BusyDrop) because an unrelated arrival of its key runs.
func TestServerWithAnotherPrefixRunsASkippedCallerIDUnguarded(t *testing.T) {
	rules := counterRules(Rule{OnBusy: BusyDrop}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	h.enqueue(counterTask("other", 1, 9), asynq.ProcessIn(time.Hour)) // registers the producer's prefix for the queue
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	tr := newSeqTracker(1)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	// An arrival without a lock (a Scheduler firing) of key k runs, held.
	if _, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, tr.starts, "the arrival runs")
	id := "a7-skip-" + uniq(t)
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id), Skip()); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		t.Fatalf("the task %s enqueued with Skip() never ran: guarded at execution and dropped as busy (busy %d)", id, server.Stats().Busy)
	}
}

// ---- 15. acquire.lua / call.go: the package's own ID forms ----

// IDs of the library's own forms (dd-, dx-, df-, dk- and 20 hex digits;
// da-<fingerprint>-…; a leading '~') are what the middleware reads a task's
// lock from, so a caller may not choose one: ErrInvalidOption before any
// lock is taken or task stored, whether given to the call or to
// asynq.NewTask, on both paths, with Skip() too. Any other ID is the
// caller's, even one that resembles an old form.
func TestOwnIDFormsAreRefusedBeforeAnyLock(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		task := counterTask("k", 1, 0)
		fp := fpOfKey(h.keyOf(task, h.queue))
		rnd := "0123456789abcdef0123"
		for _, id := range []string{"dd-" + rnd, "dx-" + rnd, "df-" + rnd, "dk-" + rnd, "da-" + fp + "-" + rnd, "~w1:x"} {
			for _, viaNewTask := range []bool{false, true} {
				for _, skip := range []bool{false, true} {
					tk, opts := task, []asynq.Option{asynq.Queue(h.queue)}
					if viaNewTask {
						tk = asynq.NewTask(task.Type(), task.Payload(), asynq.TaskID(id))
					} else {
						opts = append(opts, asynq.TaskID(id))
					}
					if skip {
						opts = append(opts, Skip())
					}
					if _, err := h.client.Submit(ctx, tk, opts...); !errors.Is(err, ErrInvalidOption) {
						t.Errorf("caller ID %q (NewTask %v, Skip %v): %v, want ErrInvalidOption", id, viaNewTask, skip, err)
					}
					if ls := h.locks(); len(ls) != 0 {
						t.Fatalf("caller ID %q (NewTask %v, Skip %v): locks taken: %v", id, viaNewTask, skip, ls)
					}
				}
			}
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Fatalf("%d tasks stored for refused calls", n)
		}
		own := "dd-" + fp + "-" + rnd
		res, err := h.client.Submit(ctx, task, asynq.Queue(h.queue), asynq.TaskID(own))
		if err != nil || res.TaskID != own {
			t.Fatalf("an ID of no form of the library's: %+v %v, want it honoured", res, err)
		}
		if dup := h.duplicateOf(counterTask("k", 1, 1)); dup.TaskID != own {
			t.Fatalf("the key is held by %s, want %s", dup.TaskID, own)
		}
	})
}

// ---- 16. debounce: a Merge fold ----

// README (Debounce): "every enqueue folded into it while it is still
// scheduled moves its due time to d after that enqueue … rounded up: the
// task never comes due before d has passed since the last fold … A fold
// never moves a due time earlier (a holder scheduled later by its own
// ProcessIn keeps it)". Through Merge's compare-and-set path (coalesce).
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

// ---- 17. relocate.go: a debounced call made again in its task's queue ----

// README (lifecycle): the relocated call is made again in the queue its
// task landed in "with its own policy, as if it had named it: … is folded
// into the key's task there (Replace …)"; Debounce: "every enqueue folded
// into it while it is still scheduled moves its due time to d after that
// enqueue". A debounced Replace whose Enqueuer puts it in the queue where
// the key's debounced task waits: replaced into that task, whose due time
// moves to d after this call, and no second task is left behind.
func TestRelocatedDebouncedReplaceMovesTheDueTime(t *testing.T) {
	rule := Rule{Fields: []string{"key"}, OnConflict: Replace, Debounce: 3 * time.Second}
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": rule}})
	ctx := context.Background()
	holder := h.enqueue(counterTask("k", 1, 1))
	c := h.d.WrapClient(queueMover{c: h.asynq, q: h.queue})
	before := time.Now()
	res, err := c.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue+"-asked"))
	if err != nil || res.Outcome != Replaced || res.TaskID != holder.ID {
		t.Fatalf("relocated debounced call: %+v %v, want Replaced into %s", res, err, holder.ID)
	}
	score, err := h.rdb.ZScore(ctx, store.ScheduledKey(h.queue), holder.ID).Result()
	if err != nil {
		t.Fatal(err)
	}
	if due := time.Unix(int64(score), 0); due.Before(before.Add(3 * time.Second)) {
		t.Fatalf("the debounced task is due at %v, earlier than 3 s after the relocated fold at %v", due.Format(time.StampMilli), before.Format(time.StampMilli))
	}
	if n := h.queueSize(h.queue); n != 1 {
		t.Fatalf("%d tasks in the queue, want 1 (the relocated call's own task taken back out)", n)
	}
	if p := decodeCounter(asynq.NewTask("counter", []byte(h.payloadOf(holder.ID)))); p.Seq != 2 {
		t.Fatalf("the waiting task carries seq %d, want 2", p.Seq)
	}
}
