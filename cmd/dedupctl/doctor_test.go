package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// doctor finds a lock whose holder is gone and one whose holder's record
// says pending while no list holds it (what a forced slot migration
// leaves), leaves alone a healthy waiting lock, a running one and a
// cooling one, and with --fix releases exactly the two it found.
func TestDoctorFindsAndFixesLocksWhoseHolderCannotRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour},
		"report:build":  {Fields: []string{"user_id"}},
	}})
	ctx := context.Background()
	healthy := f.enqueue(f.qa, "email:welcome", 1)
	orphan := f.enqueue(f.qa, "email:welcome", 2)
	lost := f.enqueue(f.qa, "email:welcome", 3)
	if err := f.insp.DeleteTask(orphan.Queue, orphan.ID); err != nil {
		t.Fatal(err)
	}
	if err := f.rdb.LRem(ctx, store.PendingKey(lost.Queue), 0, lost.ID).Err(); err != nil { // the list lost it
		t.Fatal(err)
	}
	cooling := f.enqueue(f.qb, "digest:weekly", 4)
	started, finish := f.startServer(f.qb)
	<-started
	finish()
	running := f.enqueue(f.qb, "report:build", 5)
	started, _ = f.startServer(f.qb)
	<-started
	f.waitRunning(f.lockOf(running))

	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0"))
	got := map[string]string{}
	for _, x := range out.Findings {
		got[x.Holder] = x.Problem
	}
	if len(got) != 2 || got[orphan.ID] != "gone" || got[lost.ID] != "lost" || out.Checked != 5 {
		t.Fatalf("doctor found %v in %d locks; want %s gone and %s lost of 5 (healthy %s, cooling %s, running %s left alone)",
			got, out.Checked, orphan.ID, lost.ID, healthy.ID, cooling.ID, running.ID)
	}
	r := f.ok("doctor", "--grace", "0")
	if !strings.Contains(r.stdout, "but not in asynq's pending list or set") || !strings.Contains(r.stdout, "5 locks checked, 2 locks whose holder cannot run; run with --fix") {
		t.Errorf("doctor text:\n%s", r.stdout)
	}
	// An orphan younger than --grace is left alone (a WrapClient lock: its
	// task may not be stored yet), and doctor says so.
	if out := decode[doctorOutput](t, f.ok("--json", "doctor")); len(out.Findings) != 1 || out.Findings[0].Holder != lost.ID ||
		len(out.Young) != 1 || out.Young[0].Holder != orphan.ID {
		t.Errorf("doctor with the default grace: found %+v, left alone %+v; want the lost lock found and the orphan left alone", out.Findings, out.Young)
	}
	r = f.ok("doctor")
	if !strings.Contains(r.stdout, "5 locks checked, 1 lock whose holder cannot run, 1 orphan younger than --grace 1m00s left alone; run with --fix to release it") ||
		!strings.Contains(r.stdout, orphan.ID) {
		t.Errorf("doctor text with the default grace:\n%s", r.stdout)
	}

	f.pastTheSecond(orphan)
	fixed := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0", "--fix"))
	if fixed.Released != 2 {
		t.Fatalf("--fix released %d: %+v", fixed.Released, fixed.Findings)
	}
	for _, id := range []string{orphan.ID, lost.ID} {
		if f.exists(f.lockOf(&asynq.TaskInfo{ID: id, Queue: f.qa})) {
			t.Errorf("lock of %s still there after --fix", id)
		}
	}
	for _, ti := range []struct{ id, queue string }{{healthy.ID, f.qa}, {cooling.ID, f.qb}, {running.ID, f.qb}} {
		if !f.exists(f.lockOf(&asynq.TaskInfo{ID: ti.id, Queue: ti.queue})) {
			t.Errorf("lock of %s released by --fix", ti.id)
		}
	}
	if again := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0")); len(again.Findings) != 0 {
		t.Errorf("after --fix: %+v", again.Findings)
	}
}

// holds are locks a policy keeps past their task, whose holders cannot
// run: what doctor --fix must leave alone.
type holds struct {
	cooling    string   // a success under a one-hour Cooldown, its record gone
	failed     string   // a fail hold (FailHoldUntilReleased), its holder archived
	failedGone string   // the same, its archived holder since deleted by an operator
	firings    []string // Scheduler firings' keys, their tasks deleted
}

func (h holds) all() []string {
	return append([]string{h.cooling, h.failed, h.failedGone}, h.firings...)
}

// makeHolds makes the holds in queue, through a real asynq server with the
// middleware and a Scheduler, once each is in its state.
func (f *fixture) makeHolds(queue string) holds {
	f.t.Helper()
	cool := f.enqueue(queue, "digest:weekly", 1, dedup.Cooldown(time.Hour))
	failed := f.enqueue(queue, "sync:hard", 2, dedup.OnFailure(dedup.FailHoldUntilReleased, 0))
	gone := f.enqueue(queue, "sync:hard", 3, dedup.OnFailure(dedup.FailHoldUntilReleased, 0))
	mux := asynq.NewServeMux()
	mux.Use(f.d.Middleware())
	mux.HandleFunc("digest:weekly", func(context.Context, *asynq.Task) error { return nil })
	mux.HandleFunc("sync:hard", func(context.Context, *asynq.Task) error { return fmt.Errorf("403 forbidden: %w", asynq.SkipRetry) })
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{Concurrency: 4, Queues: map[string]int{queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: dedup.IsFailure})
	if err := srv.Start(mux); err != nil {
		f.t.Fatal(err)
	}
	f.waitState(f.lockOf(cool), store.LockCooling)
	f.waitState(f.lockOf(failed), store.LockFailed)
	f.waitState(f.lockOf(gone), store.LockFailed)
	srv.Shutdown()
	if err := f.insp.DeleteTask(queue, gone.ID); err != nil {
		f.t.Fatal(err)
	}
	f.waitState(f.lockOf(gone), store.LockFailed)
	return holds{cooling: f.lockOf(cool), failed: f.lockOf(failed), failedGone: f.lockOf(gone), firings: f.firings(queue)}
}

// firings runs a Scheduler entry in queue until it fired, deletes the
// tasks it enqueued, and returns the keys of its firings.
func (f *fixture) firings(queue string) []string {
	f.t.Helper()
	s := dedup.NewScheduler(f.d, nil)
	if _, err := s.Register("@every 1s", asynq.NewTask("job:tick", nil), asynq.Queue(queue)); err != nil {
		f.t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		f.t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(f.heldAs(queue, store.HoldFiring)) == 0 {
		if time.Now().After(deadline) {
			f.t.Fatal("the Scheduler never fired")
		}
		time.Sleep(20 * time.Millisecond) // the Scheduler's firing signals nothing
	}
	s.Shutdown()
	keys := f.heldAs(queue, store.HoldFiring)
	for k, holder := range keys {
		if err := f.insp.DeleteTask(queue, holder); err != nil {
			f.t.Fatalf("delete the firing task of %s: %v", k, err)
		}
	}
	return slices.Sorted(maps.Keys(keys))
}

// heldAs maps the locks of queue whose value is of kind to their holders.
func (f *fixture) heldAs(queue string, kind store.Hold) map[string]string {
	f.t.Helper()
	ctx := context.Background()
	all, err := f.rdb.Keys(ctx, store.NewKeys(f.prefix).LockPattern(queue)).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	out := map[string]string{}
	for _, k := range all {
		if v, err := f.rdb.Get(ctx, k).Result(); err == nil && store.ParseValue(v).Kind == kind {
			out[k] = store.ParseValue(v).Holder
		}
	}
	return out
}

// values reads the values of keys ("" for a key that is gone).
func (f *fixture) values(keys []string) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i], _ = f.rdb.Get(context.Background(), k).Result()
	}
	return out
}

// doctor --fix never releases a lock a policy keeps, though its holder
// cannot run: a cooling key, a fail hold (its holder archived, or
// deleted since) and a Scheduler firing's key stay, with their values,
// while a true orphan (its holder vanished) is released. The releasing
// script checks again: asked to release a hold as stuck, it keeps it.
func TestDoctorFixLeavesHoldsAlone(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	h := f.makeHolds(f.qb)
	before := f.values(h.all())
	orphan := f.orphaned(f.qa, "email:welcome", 1)
	for key, state := range map[string]string{h.cooling: "cooling", h.failed: "failed", h.failedGone: "failed", h.firings[0]: "cooling"} {
		if o := decode[showOutput](t, f.ok("--json", "show", key)); o.State != state {
			t.Errorf("show %s: state %s, want %s (%+v)", key, o.State, state, o.HolderTask)
		}
	}
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0", "--fix"))
	if len(out.Findings) != 1 || out.Findings[0].Key != f.lockOf(orphan) || !out.Findings[0].Released || out.Released != 1 || len(out.Young) != 0 {
		t.Fatalf("doctor --fix: %+v; want the orphan %s alone found and released", out, f.lockOf(orphan))
	}
	if f.exists(f.lockOf(orphan)) {
		t.Error("the orphan's lock is still there")
	}
	if after := f.values(h.all()); !slices.Equal(after, before) {
		t.Errorf("doctor --fix changed the holds: %q, were %q", after, before)
	}
	r := f.ok("doctor", "--grace", "0", "--fix")
	if want := fmt.Sprintf("%d locks checked, 0 locks whose holder cannot run, 0 released\n", len(h.all())); r.stdout != want {
		t.Errorf("second doctor --fix: %q, want %q", r.stdout, want)
	}
	ls, err := store.ReadLocks(context.Background(), f.rdb, store.NewKeys(f.prefix), h.all())
	if err != nil || len(ls) != len(h.all()) {
		t.Fatalf("read the holds: %d, %v", len(ls), err)
	}
	for _, l := range ls {
		res, err := store.ReleaseKey(context.Background(), f.rdb, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: store.ReleaseStuck, Holder: l.Owner})
		if err != nil || res.Released || res.Kept == "" {
			t.Errorf("release %s (%s) as stuck: %+v, %v; want kept", l.Key, l.State(), res, err)
		}
	}
	if after := f.values(h.all()); !slices.Equal(after, before) {
		t.Errorf("releasing them as stuck changed the holds: %q, were %q", after, before)
	}
}

// README (operations): "An orphan younger than --grace … doctor lists it
// too, marked left alone, and counts it in its summary"; "--fix never
// releases a young one"; a lock show calls orphaned is reported or
// explained; the summary says "it" for one. With one young orphan
// (WrapClient, holder deleted: show says its task may not be stored yet), one
// old orphan (NewClient, written with its task, which vanished without
// asynq's scripts: they would release the lock its record names) and a
// healthy lock: doctor, doctor --json and doctor --fix.
func TestDoctorExplainsEveryOrphanAndFixesNoYoungOne(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	young := f.enqueue(f.qa, "a11:doc", 1)
	healthy := f.enqueue(f.qa, "a11:doc", 2)
	old := f.orphaned(f.qa, "a11:doc", 3)
	if err := f.insp.DeleteTask(f.qa, young.ID); err != nil {
		t.Fatal(err)
	}
	if r := f.ok("show", f.lockOf(young)); !strings.Contains(r.stdout, "state            orphaned") ||
		!strings.Contains(r.stdout, "missing (or not stored yet: the lock was taken before its task") {
		t.Fatalf("show %s:\n%s", young.ID, r.stdout)
	}
	if r := f.ok("show", f.lockOf(old)); !strings.Contains(r.stdout, "state            orphaned") {
		t.Fatalf("show %s:\n%s", old.ID, r.stdout)
	}
	r := f.ok("doctor")
	want := "3 locks checked, 1 lock whose holder cannot run, 1 orphan younger than --grace 1m00s left alone; run with --fix to release it\n"
	if !strings.HasSuffix(r.stdout, want) || !strings.Contains(r.stdout, young.ID) || !strings.Contains(r.stdout, "left alone") || !strings.Contains(r.stdout, old.ID) {
		t.Errorf("doctor:\n%s\nwant it to end %q", r.stdout, want)
	}
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix"))
	if out.Released != 1 || len(out.Findings) != 1 || out.Findings[0].Holder != old.ID || len(out.Young) != 1 || out.Young[0].Holder != young.ID || out.Grace != "1m00s" {
		t.Errorf("doctor --fix: %+v", out)
	}
	if !f.exists(f.lockOf(young)) || !f.exists(f.lockOf(healthy)) || f.exists(f.lockOf(&asynq.TaskInfo{ID: old.ID, Queue: old.Queue})) {
		t.Errorf("after --fix: young %v healthy %v old %v; want the old orphan alone released", f.exists(f.lockOf(young)), f.exists(f.lockOf(healthy)), f.exists(f.lockOf(old)))
	}
	r = f.ok("doctor", "--fix")
	if !strings.Contains(r.stdout, "2 locks checked, 0 locks whose holder cannot run, 1 orphan younger than --grace 1m00s left alone, 0 released") {
		t.Errorf("second doctor --fix:\n%s", r.stdout)
	}
}

// doctor --fix runs Diagnose, then releases each lock found, "holder
// checked". With a caller-chosen task ID, a producer that enqueues the key
// again under the same ID between the two (the old holder's record was lost,
// so the next enqueue heals the lock and takes it again, under the same
// holder ID) must not have its live lock released: its task is pending and
// will run, and a release would let the key's next enqueue in, a duplicate.
// This test performs runDoctor's two steps with the enqueue between them.
func TestDoctorFixLeavesALockRetakenUnderTheSameCallerChosenID(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	direct := f.d.NewClient()
	id := "job-" + randHex(4)
	task := asynq.NewTask("email:welcome", []byte(`{"user_id":7}`))
	opts := []asynq.Option{asynq.Queue(f.qa), dedup.Fields("user_id")}
	if _, err := direct.EnqueueContext(ctx, task, append(opts, asynq.TaskID(id))...); err != nil {
		t.Fatal(err)
	}
	// A lossy failover lost the task (record and list), not its lock.
	if err := f.rdb.Del(ctx, store.TaskKey(f.qa, id)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := f.rdb.LRem(ctx, store.PendingKey(f.qa), 0, id).Err(); err != nil {
		t.Fatal(err)
	}
	// doctor --fix, first step: find.
	ls, err := store.ReadLocks(ctx, f.rdb, store.NewKeys(f.prefix), f.lockKeys())
	if err != nil {
		t.Fatal(err)
	}
	ds, _, err := store.Diagnose(ctx, f.rdb, ls, 0, time.Now())
	if err != nil || len(ds) != 1 || ds[0].Problem != store.ProblemGone {
		t.Fatalf("diagnose: %+v %v, want the one lock gone", ds, err)
	}
	// Meanwhile the producer enqueues the key again, under the same ID.
	res, err := direct.EnqueueContext(ctx, task, append(opts, asynq.TaskID(id))...)
	if err != nil {
		t.Fatalf("re-enqueue under the same ID: %v", err)
	}
	t.Logf("re-enqueue: %+v", res)
	// doctor --fix, second step: release, as runDoctor does (ReleaseStuck,
	// which re-checks the holder).
	l := ds[0].Lock
	rr, err := store.ReleaseKey(ctx, f.rdb, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: store.ReleaseStuck, Holder: l.Owner})
	if err != nil {
		t.Fatal(err)
	}
	if rr.Released {
		// Show the consequence: the key's duplicate is admitted while its task waits.
		_, derr := direct.EnqueueContext(ctx, task, opts...)
		t.Fatalf("doctor --fix released the live lock of task %s, re-enqueued after the diagnosis under the same ID "+
			"(release checks only the holder ID, not the lock's creation); a duplicate of the waiting task then gets: %v", id, derr)
	}
}

// doctor reports no lock whose holder can run: a scheduled task, a task
// with a caller-chosen ID (WrapClient and NewClient), a grouped
// (aggregating) task, a task in retry, and a task that is running.
func TestDoctorReportsNoLockWhoseOwnerCanRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	type one struct {
		name string
		id   string
	}
	var made []one
	add := func(name string, c interface {
		EnqueueContext(context.Context, *asynq.Task, ...asynq.Option) (*asynq.TaskInfo, error)
	}, user int, opts ...asynq.Option) {
		opts = append([]asynq.Option{asynq.Queue(f.qa), dedup.Fields("user_id")}, opts...)
		info, err := c.EnqueueContext(ctx, asynq.NewTask("email:welcome", fmt.Appendf(nil, `{"user_id":%d}`, user)), opts...)
		if err != nil {
			t.Logf("%s: enqueue refused: %v (left out)", name, err)
			return
		}
		made = append(made, one{name, info.ID})
	}
	add("scheduled", f.client, 1, asynq.ProcessIn(time.Hour))
	add("caller ID (wrap)", f.client, 2, asynq.TaskID("wrap-"+randHex(4)))
	add("caller ID (direct)", directEnq{f.d.NewClient()}, 3, asynq.TaskID("direct-"+randHex(4)))
	add("grouped", f.client, 4, asynq.Group("g1"))
	add("direct scheduled", directEnq{f.d.NewClient()}, 5, asynq.ProcessIn(time.Hour))
	add("wrap retention", f.client, 6, asynq.Retention(time.Hour))
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0"))
	if len(out.Findings) > 0 {
		t.Fatalf("doctor reported locks whose holder can run: %+v (made %+v)", out.Findings, made)
	}
	if out.Checked != len(made) {
		t.Errorf("doctor checked %d locks, want %d (%+v)", out.Checked, len(made), made)
	}
}

type directEnq struct{ c *dedup.Client }

func (d directEnq) EnqueueContext(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return d.c.EnqueueContext(ctx, t, opts...)
}

// README (dedupctl doctor): "--fix releases them holder-checked … tasks are
// never touched, but for a RunningDefer follow-up the lock owes that still
// waits: it takes the key and is queued now, as the end of its holder's run
// would have done". The holder here has a caller-chosen ID (its lock found
// through the lock header its record carries), failed once (held for its
// retry an hour away) and was archived by an operator after its server
// stopped.
func TestDoctorFixHandsACallerIDOwnersKeyToItsFollowUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
	}})
	ctx := context.Background()
	release := make(chan struct{})
	started := make(chan string, 10)
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{
		Concurrency: 2, Queues: map[string]int{f.qa: 1}, LogLevel: asynq.FatalLevel,
		TaskCheckInterval: 20 * time.Millisecond, ShutdownTimeout: 5 * time.Second,
		IsFailure:      dedup.IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour },
	})
	if err := srv.Start(f.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-release
		return errors.New("try again later")
	}))); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(func() { close(release); srv.Shutdown() }) }
	t.Cleanup(stop)
	holder := "a7-holder-" + randHex(4)
	if _, err := f.client.EnqueueContext(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":0}`)), asynq.Queue(f.qa), asynq.TaskID(holder)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the holder never ran")
	}
	res, err := f.client.Submit(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":1}`)), asynq.Queue(f.qa))
	if err != nil || res.Outcome != dedup.Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	stop() // the attempt fails (retry in an hour) and the server stops: nobody watches the lock
	deadline := time.Now().Add(10 * time.Second)
	for f.taskState(f.qa, holder) != "retry" {
		if time.Now().After(deadline) {
			t.Fatalf("holder %s is %s, want retry", holder, f.taskState(f.qa, holder))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := f.insp.ArchiveTask(f.qa, holder); err != nil {
		t.Fatal(err)
	}
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix", "--queue", f.qa))
	if len(out.Findings) != 1 || !out.Findings[0].Released || out.Findings[0].FollowUp != res.TaskID {
		t.Fatalf("doctor --fix: %+v, want the archived holder's lock released to its follow-up %s", out.Findings, res.TaskID)
	}
	if st := f.taskState(f.qa, res.TaskID); st != "pending" {
		t.Fatalf("follow-up %s is %s, want pending (queued now)", res.TaskID, st)
	}
	again, err := f.client.Submit(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":2}`)), asynq.Queue(f.qa))
	if err != nil || again.TaskID != res.TaskID || again.Outcome != dedup.Replaced {
		t.Fatalf("the key's next update: %+v %v, want Replaced into the follow-up %s, which holds the key", again, err, res.TaskID)
	}
}

// owedKey writes, straight into Redis, what a RunningDefer holder's quiet
// success leaves when the owed signal missed its follow-up: no lock, and a
// mode record naming the holder (a plain ID; stored pending when live,
// else with no record) and the follow-up it owed, stored scheduled (parked
// an hour away) in asynq's scheduled set. It returns the lock key, the
// holder and the follow-up.
func (f *fixture) owedKey(queue, typ string, live bool) (lock, holder, follow string) {
	f.t.Helper()
	ctx := context.Background()
	lock = store.NewKeys(f.prefix).Lock(queue, randHex(8))
	raw := asynq.NewClientFromRedisClient(f.rdb)
	holder, follow = store.NewPlainID(), store.NewFollowID()
	if live {
		if _, err := raw.EnqueueContext(ctx, asynq.NewTask(typ, []byte(`{"seq":0}`)), asynq.Queue(queue), asynq.TaskID(holder)); err != nil {
			f.t.Fatal(err)
		}
	}
	if _, err := raw.EnqueueContext(ctx, asynq.NewTask(typ, []byte(`{"seq":1}`)), asynq.Queue(queue), asynq.TaskID(follow), asynq.ProcessIn(time.Hour)); err != nil {
		f.t.Fatal(err)
	}
	mode := store.ModeOf(lock)
	if err := f.rdb.HSet(ctx, mode, store.FieldHolder, holder, store.FieldType, typ, store.FieldRunning, "d", store.FieldFollow, follow).Err(); err != nil {
		f.t.Fatal(err)
	}
	f.rdb.Expire(ctx, mode, time.Hour)
	return lock, holder, follow
}

// The owed signal can miss that a RunningDefer holder's quiet success owed
// a follow-up (docs/lifecycle.md): asynq's done deleted the lock, and the
// follow-up stays parked in the scheduled set until its parking time.
// doctor finds the key by its mode record, and --fix queues the follow-up
// now; --type and --queue narrow the search as they do for locks.
func TestDoctorFindsAFollowUpOwedByAKeyWithNoLockAndFixQueuesIt(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	lock, holder, follow := f.owedKey(f.qa, "report:build", false)

	out := decode[doctorOutput](t, f.ok("--json", "doctor"))
	if len(out.Findings) != 1 || out.Findings[0].Problem != store.ProblemOwed || out.Findings[0].Key != lock ||
		out.Findings[0].Holder != holder || out.Findings[0].Type != "report:build" || out.Findings[0].Queue != f.qa ||
		!strings.Contains(out.Findings[0].Detail, follow) || out.Findings[0].Released {
		t.Fatalf("doctor: %+v; want key %s owing follow-up %s, holder %s", out.Findings, lock, follow, holder)
	}
	r := f.ok("doctor")
	if want := "follow-up " + follow + " (scheduled) is owed, but the key has no lock: it waits until its parking time"; !strings.Contains(r.stdout, want) ||
		!strings.Contains(r.stdout, "owed") || !strings.Contains(r.stdout, "run with --fix") {
		t.Errorf("doctor text, want %q:\n%s", want, r.stdout)
	}
	for _, narrow := range [][]string{{"--type", "other:type"}, {"--queue", f.qb}} {
		if n := decode[doctorOutput](t, f.ok(append([]string{"--json", "doctor"}, narrow...)...)); len(n.Findings) != 0 {
			t.Errorf("doctor %v: %+v; want nothing", narrow, n.Findings)
		}
	}
	if st := f.taskState(f.qa, follow); st != "scheduled" {
		t.Fatalf("follow-up %s is %s before --fix, want scheduled (doctor alone changes nothing)", follow, st)
	}

	fixed := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix", "--type", "report:build", "--queue", f.qa))
	if fixed.Released != 1 || len(fixed.Findings) != 1 || !fixed.Findings[0].Released || fixed.Findings[0].FollowUp != follow {
		t.Fatalf("doctor --fix: %+v; want follow-up %s queued", fixed, follow)
	}
	if st := f.taskState(f.qa, follow); st != "pending" {
		t.Fatalf("follow-up %s is %s after --fix, want pending (queued now)", follow, st)
	}
	// It holds the key from now, as a follow-up queued at its holder's end
	// does: an enqueue of the key meanwhile meets it (a fold, or a
	// duplicate), rather than making a second task that would run first.
	ctx := context.Background()
	if v := f.rdb.Get(ctx, lock).Val(); store.ParseValue(v).Holder != follow || f.rdb.PTTL(ctx, lock).Val() <= 0 {
		t.Fatalf("after --fix the lock is %q (TTL %v), want held by the follow-up %s, with a lifetime", v, f.rdb.PTTL(ctx, lock).Val(), follow)
	}
	if id := f.rdb.HGet(ctx, store.ModeOf(lock), store.FieldHolder).Val(); id != follow {
		t.Fatalf("after --fix the mode record names %q, want the follow-up %s", id, follow)
	}
	if again := decode[doctorOutput](t, f.ok("--json", "doctor")); len(again.Findings) != 0 {
		t.Errorf("doctor after --fix: %+v; want nothing owed", again.Findings)
	}
}

// A key with no lock whose holder still waits (or runs) is not reported,
// though its mode record names a follow-up: the holder hands the key on at
// its end. --fix touches neither task.
func TestDoctorLeavesAFollowUpOwedByAHolderThatCanStillRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	_, holder, follow := f.owedKey(f.qa, "report:build", true)
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix"))
	if len(out.Findings) != 0 || out.Released != 0 {
		t.Fatalf("doctor --fix: %+v; want nothing found (holder %s pending)", out, holder)
	}
	if h, fu := f.taskState(f.qa, holder), f.taskState(f.qa, follow); h != "pending" || fu != "scheduled" {
		t.Fatalf("after doctor --fix: holder %s, follow-up %s; want pending and scheduled", h, fu)
	}
}
