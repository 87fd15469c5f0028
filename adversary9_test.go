package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Adversarial tests, round 9: free starts (a task NewClient stored with its
// lock ran its first attempt with no start script, its lock tokless; they
// were replaced by begins shared between attempts, begin.go, after these
// attacks) and releases sent off the handler's path (releaser), through the
// public API on a real asynq server and redis-server. Each test quotes the
// README promise it attacks.

// 1. README (Lock lifecycle): "a task locked at enqueue finds its key held
// by another task, or cooling | retried until the key is free, never dropped
// or folded"; the matrix: "the Inspector archives or deletes the task while
// it waits | NewClient: new task at once"; TestLifecycleMatrix "checks
// besides that no key ever had two live tasks or two overlapping runs".
//
// A waiting task A is archived by an operator; the key's next enqueue B
// heals the lock and takes the key (as promised). B runs. The operator then
// runs A again (Inspector.RunTask): A is on its first attempt (asynq's
// archive keeps the retry count), its ID still says its lock lasts an hour,
// so it starts free and runs beside B, with no lock of its own.
func TestArchivedWaitingTaskRunAgainNeverRunsBesideTheNewHolder(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	if err := h.insp.ArchiveTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	b := h.enqueue(counterTask("k", 1, 2)) // heals: A is archived
	tr := newKeyTracker(counterKeyOf, 1, 2)
	t.Cleanup(tr.openAll)
	serveWith(t, h.rdb, h.d, h.queue, tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
	first := waitFor(t, tr.starts, "B runs")
	if first.id != b.ID {
		t.Fatalf("first run %s, want B %s", first.id, b.ID)
	}
	if err := h.insp.RunTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	tr.noSecondStart(t, first, 3*time.Second, "archived task "+a.ID+" run again by an operator while "+b.ID+" holds its key")
}

// 2. Same promises, through asynq's own archiving: a first attempt that
// ends for good with SkipRetry (or an error under MaxRetry(0)) is archived
// with retry count 0 and its key is released, as promised. A task of the
// key B then takes the key and runs; an operator re-runs the archived task
// (the usual fix after a bug). It must meet the key held by B (retried until
// free), never run beside B.
func TestTaskArchivedOnItsFirstAttemptRunAgainNeverRunsBesideTheNewHolder(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []asynq.Option
		err  error
	}{
		{"SkipRetry", nil, fmt.Errorf("bad input: %w", asynq.SkipRetry)},
		{"MaxRetry(0)", []asynq.Option{asynq.MaxRetry(0)}, errors.New("boom")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newDirectHarness(t, Rule{})
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 2)
			t.Cleanup(tr.openAll)
			serveWith(t, h.rdb, h.d, h.queue, tr.handler(func(r keyRun) error {
				if r.seq == 1 && r.retry == 0 && r.id != "" {
					if n, _ := h.rdb.Get(ctx, h.prefix+":a9:ran:"+r.id).Int(); n == 0 {
						h.rdb.Set(ctx, h.prefix+":a9:ran:"+r.id, 1, time.Hour)
						return tc.err
					}
				}
				return nil
			}), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
			a := h.enqueue(counterTask("k", 1, 1), tc.opts...)
			requirePlainID(t, a.ID)
			waitFor(t, tr.starts, "A's first attempt")
			waitFor(t, tr.ends, "A's first attempt ends")
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			eventually(t, "A archived, its key orphaned", func() bool {
				return h.taskState(a.ID) == asynq.TaskStateArchived && h.lockState(key) == store.LockOrphaned
			})
			b := h.enqueue(counterTask("k", 1, 2))
			first := waitFor(t, tr.starts, "B runs")
			if first.id != b.ID {
				t.Fatalf("run %s, want B %s", first.id, b.ID)
			}
			if err := h.insp.RunTask(h.queue, a.ID); err != nil {
				t.Fatal(err)
			}
			tr.noSecondStart(t, first, 3*time.Second, "archived task "+a.ID+" run again while "+b.ID+" runs")
		})
	}
}

// 5. README ("Why not asynq.Unique?"): "leftover handler of an old attempt
// | cannot renew or release: every lock call checks the task ID and the
// attempt (… a first attempt that started free has none, and loses the lock
// to any later attempt, which takes one)"; (Lock lifecycle) "asynq gives
// the attempt up (… shutdown outlived) and the handler returns later,
// whatever it returns | follows the task's record: held while asynq will run
// the task again (retry, requeued by shutdown even on the last attempt)".
//
// Server 1 runs A's first attempt free and shuts down; the handler outlives
// ShutdownTimeout and asynq puts A back, retry count still 0. Server 2 runs
// A again: a "later attempt", but again a first one, so it also starts free
// and takes no token. The leftover on server 1 then returns: its release
// carries no token, like the live attempt's lock, and with MaxRetry(0) (a
// "final" attempt by asynq's count) it deletes the lock of the attempt
// running on server 2: a duplicate is accepted while A runs.
func TestLeftoverOfAShutdownRequeueLeavesTheRunningAttemptsLock(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	started1, leftoverGo, leftoverDone := make(chan string, 4), make(chan struct{}), make(chan struct{})
	var once sync.Once
	_, stop1 := serveRaw(t, h.rdb, h.queue, h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started1 <- id
		<-leftoverGo // ignores its context: outlives ShutdownTimeout
		once.Do(func() { close(leftoverDone) })
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1; c.ShutdownTimeout = 300 * time.Millisecond })
	t.Cleanup(func() {
		select {
		case <-leftoverGo:
		default:
			close(leftoverGo)
		}
	})
	a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
	requirePlainID(t, a.ID)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	waitFor(t, started1, "A on server 1")
	stop1() // returns once ShutdownTimeout passed: A is put back
	eventually(t, "A put back in the queue", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending })

	// Server 2 (another process: a Dedup of its own, same prefix).
	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	started2, hold2 := make(chan string, 4), make(chan struct{})
	t.Cleanup(func() { close(hold2) })
	serveRaw(t, h.rdb, h.queue, d2.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started2 <- id
		<-hold2
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1 })
	if id := waitFor(t, started2, "A on server 2"); id != a.ID {
		t.Fatalf("server 2 ran %s, want %s", id, a.ID)
	}
	if owner := h.lockOwner(key); owner != a.ID {
		t.Fatalf("lock owner %q while A runs on server 2", owner)
	}

	close(leftoverGo) // the leftover on server 1 returns nil, long after asynq gave it up
	<-leftoverDone
	eventually(t, "the leftover's lock settled", func() bool {
		st := h.d.Stats()
		return st.Released+st.Held+st.LockLost+st.RedisErrors > 0
	})
	if h.taskState(a.ID) != asynq.TaskStateActive {
		t.Fatalf("A is %v, want still active on server 2", h.taskState(a.ID))
	}
	if owner := h.lockOwner(key); owner != a.ID {
		t.Errorf("A runs on server 2 but its lock is %q: the leftover attempt on server 1 (stats %+v) released it", owner, h.d.Stats())
	}
	info, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) {
		t.Errorf("enqueue of A's key while A runs on server 2: %v (task %v), want a duplicate of %s", err, info, a.ID)
	}
}

// 7. README (When the key is already taken): RunningDefer "never runs two
// tasks of a key at once. The first enqueue that meets a running key
// creates one follow-up task, and later ones are folded into it … When the
// run ends — success, revoke, or final failure — the follow-up is queued
// and takes the lock"; the brief of free starts: the release of a free
// attempt must hand the key to a follow-up made while it ran (the attempt
// started free, so it never learnt of it).
func TestDeferFollowUpMadeDuringADirectTasksRunGetsTheKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  error
	}{
		{"success", nil},
		{"RevokeTask", asynq.RevokeTask},
		{"SkipRetry", fmt.Errorf("no: %w", asynq.SkipRetry)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newDirectHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 1)
			t.Cleanup(tr.openAll)
			serveWith(t, h.rdb, h.d, h.queue, tr.handler(func(r keyRun) error {
				if r.seq == 1 {
					return tc.end
				}
				return nil
			}), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
			a := h.enqueue(counterTask("k", 1, 1))
			requirePlainID(t, a.ID)
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			waitFor(t, tr.starts, "A runs")
			if owner := h.lockOwner(key); owner != a.ID {
				t.Fatalf("A runs, its key held by %q", owner)
			}
			r2, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || r2.Outcome != Deferred {
				t.Fatalf("enqueue while A runs: %+v, %v; want Deferred", r2, err)
			}
			r3, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
			if err != nil || r3.TaskID != r2.TaskID {
				t.Fatalf("second enqueue while A runs: %+v, %v; want folded into %s", r3, err, r2.TaskID)
			}
			tr.open(1)
			waitFor(t, tr.ends, "A ends")
			next := waitFor(t, tr.starts, "the follow-up runs")
			if next.id != r2.TaskID || next.seq != 3 {
				t.Fatalf("after A ran %s seq %d, want the follow-up %s with seq 3", next.id, next.seq, r2.TaskID)
			}
			waitFor(t, tr.ends, "the follow-up ends")
			eventually(t, "the key free after the follow-up", func() bool {
				return h.rdb.Exists(ctx, key).Val() == 0 && h.rdb.Exists(ctx, modeKeyOf(key)).Val() == 0
			})
			if ov := tr.overlapsSeen(); len(ov) > 0 {
				t.Fatalf("overlaps: %v", ov)
			}
			if st := h.d.Stats(); st.LockLost != 0 || st.Started != 2 || st.Released != 2 {
				t.Fatalf("stats %+v: want 2 started, 2 released, none lost", st)
			}
			select {
			case r := <-tr.starts:
				t.Fatalf("unexpected run %+v", r)
			default:
			}
		})
	}
}

// 8. README (Configuration): "Dedup.Close() stops the heartbeat: call it
// after srv.Shutdown()"; (Failure modes) "graceful shutdown | handlers
// finish, heartbeat stops, nothing leaks"; (Lock lifecycle) "success |
// released". Releases now go out after the handler, in batches: a Close
// right after Shutdown must still send every one, count each once, and
// leave no lock.
func TestCloseRightAfterShutdownSendsEveryQueuedRelease(t *testing.T) {
	const n = 60
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	gate := make(chan struct{})
	started := make(chan string, n)
	_, stop := serveRaw(t, h.rdb, h.queue, d2.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-gate
		return nil
	})), func(c *asynq.Config) { c.Concurrency = n })
	keys := make([]string, n)
	for i := range n {
		info := h.enqueue(counterTask(fmt.Sprint("k", i), 1, i))
		requirePlainID(t, info.ID)
		keys[i] = h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
	}
	for range n {
		waitFor(t, started, "every task running")
	}
	close(gate)
	stop()
	_ = d2.Close()
	st := d2.Stats()
	if st.Started != n || st.Processed != n || st.Released != n || st.LockLost != 0 || st.RedisErrors != 0 {
		t.Errorf("stats after Shutdown and Close: %+v; want %d started, processed and released", st, n)
	}
	left := 0
	for _, k := range keys {
		left += int(h.rdb.Exists(ctx, k).Val())
	}
	if left != 0 {
		t.Errorf("%d of %d locks left after their tasks succeeded, Shutdown and Close", left, n)
	}
}

// 9. README (Failure modes): a hung lock store never fails a task, and a
// plain task's key needs no call of the library's to be freed: asynq's own
// done script, which marks the task done, deletes the lock its record names.
func TestHungLockStoreStillFreesAPlainTasksKeyAtSuccess(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	proxy, sd := proxiedLockStore(t, h, Config{Rules: counterRules(Rule{}).Rules})
	started, gate := make(chan string, 1), make(chan struct{})
	serveRaw(t, h.rdb, h.queue, sd.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-gate
		return nil
	})), nil)
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	waitFor(t, started, "A runs")
	proxy.stall() // the worker's lock store hangs
	t.Cleanup(proxy.resume)
	close(gate)
	eventually(t, "A completed in asynq", func() bool { return h.taskState(a.ID) == 0 })
	eventually(t, "A's key freed by asynq", func() bool { return h.rdb.Exists(ctx, key).Val() == 0 })
	if st := sd.Stats(); st.RedisErrors != 0 {
		t.Errorf("stats %+v: a plain task's end made a call to the hung lock store", st)
	}
}

// 10. README (Lock lifecycle): "success | released"; (Diagnostics) the
// counters count each event once. Many free attempts ending at once share
// done calls: every lock is released once, counted once, none lost, and
// every key takes a new task at once.
func TestBatchedReleasesCountEachOnceAndFreeEveryKey(t *testing.T) {
	const n = 300
	h := newDirectHarness(t, Rule{})
	ended := make(chan string, 2*n)
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ended <- id
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 100 })
	for i := range n {
		h.enqueue(counterTask(fmt.Sprint("k", i), 1, i))
	}
	for range n {
		waitFor(t, ended, "every task runs")
	}
	eventually(t, "every release counted", func() bool { return h.d.Stats().Released >= n })
	if st := h.d.Stats(); st.Started != n || st.Processed != n || st.Released != n || st.LockLost != 0 || st.Held != 0 {
		t.Fatalf("stats %+v; want %d started, processed, released", st, n)
	}
	if left := len(h.locks()); left != 0 {
		t.Fatalf("%d locks left", left)
	}
	for i := range n {
		if _, err := h.client.Enqueue(counterTask(fmt.Sprint("k", i), 1, n+i), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("key %d after its task succeeded: %v", i, err)
		}
	}
}

// 11. README (Lock API): "the holder, if alive, still runs … and takes the
// key again when it starts if the key is free; if a task of its type has
// taken the key since (the release marks the holder so), the holder gives
// way to it"; (Lock lifecycle) "shutdown, the handler outliving
// ShutdownTimeout | back in the queue".
//
// An operator releases the key of A while A runs free (so no header can be
// added: A is active). B takes the key and waits. A's server shuts down,
// the handler outlives ShutdownTimeout, and asynq puts A back with retry
// count 0 and its original message. On the next server A starts free
// again, beside B.
func TestReleasedRunningHolderRequeuedByShutdownNeverRunsBesideTheNewHolder(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	started1, leftoverGo := make(chan string, 4), make(chan struct{})
	_, stop1 := serveRaw(t, h.rdb, h.queue, h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started1 <- id
		<-leftoverGo
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1; c.ShutdownTimeout = 300 * time.Millisecond })
	t.Cleanup(func() { close(leftoverGo) })
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	waitFor(t, started1, "A runs on server 1")
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	b := h.enqueue(counterTask("k", 1, 2)) // the key is free: B takes it, and waits (server 1 is busy)
	stop1()
	eventually(t, "A put back in the queue", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending })

	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	tr := newKeyTracker(counterKeyOf, 1, 2)
	t.Cleanup(tr.openAll)
	serveWith(t, h.rdb, d2, h.queue, tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
	first := waitFor(t, tr.starts, "the key's first run on server 2")
	tr.noSecondStart(t, first, 3*time.Second, "released holder "+a.ID+" and "+b.ID+", which took the key since")
}
