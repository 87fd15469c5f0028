package dedup

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Relocation (relocate.go): the lock is taken in the queue the call names,
// else the one given to asynq.NewTask, else the one tasks of the type last
// landed in; when an Enqueuer puts the task elsewhere, the task is taken
// back out and the call is made again in the queue it landed in, with its
// own policy. A task a worker took first meets its key when it starts.

// A duplicate found when the lock moves to the queue the task named in
// asynq.NewTask is a duplicate like any other: OnDecision hears it
// ("called for every duplicate").
func TestRelocatedDuplicateIsHeardByOnDecision(t *testing.T) {
	var rec decisions
	h := newHarness(t, Config{OnDecision: rec.hook})
	first := h.enqueue(userTask(7, "")) // explicit asynq.Queue: not remembered
	again := asynq.NewTask("user:reindex", userTask(7, "").Payload(), asynq.Queue(h.queue))
	_, err := h.client.Enqueue(again)
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("enqueue with the queue in NewTask: %v, want a duplicate of %s", err, first.ID)
	}
	heard := rec.all()
	if len(heard) != 1 || heard[0].Event != "duplicate" || heard[0].TaskID != first.ID {
		t.Fatalf("OnDecision heard %+v, want one duplicate of %s", heard, first.ID)
	}
}

// README: Replace "writes the new payload into the waiting task"; "a
// newer payload for a waiting task: replaced … in place"; lifecycle:
// "Enqueue, key held by a live task → … (with Replace/Merge/Defer: the
// payload is folded in)". A second process whose Enqueuer puts the task in
// another queue than the lock's first guess still replaces the payload of
// the key's waiting task there, rather than getting a duplicate.
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

// A queue set in NewTask with RunningDefer must not create a follow-up
// without an ID (once, when the lock moved to that queue after the enqueue).
func TestRelocatedDeferNeverCreatesAFollowUpWithoutAnID(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnRunning: RunningDefer}}})
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(r run) error { <-release; return nil })
	// One worker, busy with the holder: the relocated duplicate stays pending
	// until the wrapper deletes it (an active one could not be deleted).
	h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = 1 })
	holder := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, rc.runs, "holder runs")
	// The lock is taken in NewTask's queue at once (no relocation any
	// more), so the call meets the running holder and defers behind it.
	res, err := h.client.Submit(context.Background(), asynq.NewTask("counter", counterTask("k", 1, 1).Payload(), asynq.Queue(h.queue)))
	if err != nil || res.Outcome != Deferred || !res.FollowUp || res.TaskID == "" {
		t.Fatalf("%+v, %v; want a follow-up of the running %s", res, err, holder.ID)
	}
	if n, _ := h.rdb.Exists(context.Background(), asynqTaskKeyPrefix(h.queue)).Result(); n != 0 {
		t.Fatal("a task record with an empty ID was written")
	}
	if n := h.queueSize(h.queue); n != 2 {
		t.Fatalf("queue holds %d tasks, want the running one and its follow-up", n)
	}
}

// README (lifecycle): "A task a worker took first meets its key when it
// starts", and holds it while it runs: with a caller-chosen ID too, whose
// stored message names the lock of the queue the call asked for, not the
// one it runs in. An enqueue of the key meanwhile is a duplicate; it must
// not take the key as though the running holder were another key's task
// (seen once in TestOptionSpace, seed 623093282: two handlers of one key).
func TestRelocatedCallerIDTaskAWorkerTookFirstHoldsItsKeyWhileItRuns(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	tr := newSeqTracker(1)
	h.serve(tr.handler(), nil)
	c := h.d.WrapClient(takenFirstEnqueuer{c: h.asynq, insp: h.insp, q: h.queue})
	res, err := c.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue+"-asked"), asynq.TaskID("caller-1"))
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil || r.id != "caller-1" {
		t.Fatalf("the relocated task %+v never ran (%+v)", res, r)
	}
	defer tr.openAll()
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	if owner := h.lockOwner(key); owner != "caller-1" {
		t.Fatalf("while the relocated task runs its key is held by %q, want caller-1", owner)
	}
	again, err := h.d.NewClient().Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != "caller-1" {
		t.Fatalf("enqueue of the key while its relocated holder runs: %+v, %v; want a duplicate of caller-1", again, err)
	}
}

// README (lifecycle): a task a worker took first in another queue than its
// lock's "meets its key when it starts". Its message still names the lock
// of the queue it was meant for; while it waits for asynq's retry it is
// still the key's task in the queue it runs in, so an enqueue of the key
// there is a duplicate of it, not a heal that creates a second task, and
// Lookup reports it waiting for its retry, not orphaned.
func TestRelocatedCallerIDTaskInRetryStillHoldsItsKey(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	failed := make(chan struct{}, 1)
	h.serve(func(context.Context, *asynq.Task) error {
		failed <- struct{}{}
		return errors.New("fails once, then waits for its retry")
	}, retryInAnHour)
	c := h.d.WrapClient(takenFirstEnqueuer{c: h.asynq, insp: h.insp, q: h.queue})
	ctx := context.Background()
	res, err := c.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue+"-asked"), asynq.TaskID("caller-1"))
	if err != nil || res.TaskID != "caller-1" {
		t.Fatalf("Submit: %+v, %v", res, err)
	}
	waitFor(t, failed, "the relocated task's first run")
	eventually(t, "the task waits for its retry", func() bool { return h.taskState("caller-1") == asynq.TaskStateRetry })
	kl, found, err := h.d.Lookup(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.Holder != "caller-1" || kl.State != "retry-wait" {
		t.Errorf("Lookup: %+v, %v, %v; want held by caller-1, retry-wait", kl, found, err)
	}
	again, err := h.d.NewClient().Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != "caller-1" {
		t.Fatalf("enqueue of the key in the queue the task runs in: %+v, %v; want a duplicate of caller-1 (waiting for its retry)", again, err)
	}
}
