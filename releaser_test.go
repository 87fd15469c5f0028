package dedup

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// README (Dedup.Release): a holder whose lock an operator released still
// runs, and takes the key again when it starts if the key is free; if a task
// of its type took the key since, it gives way. A waiting task NewClient
// stored with its lock does the same.
func TestReleasedNewClientHolderTakesOrGivesWay(t *testing.T) {
	t.Run("key free: it takes the key", func(t *testing.T) {
		h, a := releasedNewClientHolder(t)
		ctx, opts := context.Background(), []asynq.Option{asynq.Queue(h.queue)}
		tr := newKeyTracker(counterKeyOf, 1)
		h.serve(tr.handler(nil), nil)
		t.Cleanup(tr.openAll)
		waitFor(t, tr.starts, "the released task runs")
		if l, found, err := h.d.Lookup(ctx, counterTask("k", 1, 1), opts...); err != nil || !found || l.Holder != a.ID || l.State != "running" {
			t.Fatalf("Lookup while the released task runs: %+v, %v, %v; want running, held by %s", l, found, err, a.ID)
		}
		var dup *DuplicateTaskError
		if _, err := h.client.Enqueue(counterTask("k", 1, 2), opts...); !errors.As(err, &dup) || dup.Holder != a.ID {
			t.Fatalf("duplicate while the released task runs: %v; want one naming %s", err, a.ID)
		}
	})
	t.Run("key taken since: it gives way", func(t *testing.T) {
		h, a := releasedNewClientHolder(t)
		b := h.enqueue(counterTask("k", 1, 2))
		tr := newKeyTracker(counterKeyOf, 1, 2)
		h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
		t.Cleanup(tr.openAll)
		first := waitFor(t, tr.starts, "the key's first run")
		tr.noSecondStart(t, h, first, "tasks "+a.ID+" and "+b.ID+" of one key")
	})
}

// releasedNewClientHolder enqueues a task through NewClient and has an
// operator release its lock (Release without a holder) while it waits.
func releasedNewClientHolder(t *testing.T) (*harness, *asynq.TaskInfo) {
	t.Helper()
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	a := h.enqueue(counterTask("k", 1, 1))
	if ok, err := h.d.Release(context.Background(), counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	return h, a
}

// README (Lock API): Release "deletes the lock with its index key …,
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
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	first := waitFor(t, tr.starts, "the key's first run")
	tr.noSecondStart(t, h, first, fmt.Sprintf("tasks %s and %s of key tenant-7", a.ID, b.ID))
}

// README: Release "deletes the lock with its index key and MaxPending
// entry"; WaitForRoom "waits until there is room or its context ends". An
// operator's forced release of a waiting key frees its slot for a caller
// waiting for room.
func TestForcedReleaseMakesRoomForAWaiter(t *testing.T) {
	t.Parallel()
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

// README: RunningDefer: "When the run ends … the follow-up is queued and
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
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
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

// README (Lock lifecycle): "success | released"; (Diagnostics) the counters
// count each event once. Many attempts ending at once share release calls:
// every lock is released once, counted once, none lost, and every key takes
// a new task at once.
func TestBatchedReleasesCountEachOnceAndFreeEveryKey(t *testing.T) {
	t.Parallel()
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
	// (asynq's done script deletes each lock, after the middleware returned.)
	eventually(t, "every lock gone", func() bool { return len(h.locks()) == 0 })
	for i := range n {
		if _, err := h.client.Enqueue(counterTask(fmt.Sprint("k", i), 1, n+i), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("key %d after its task succeeded: %v", i, err)
		}
	}
}
