package dedup

import (
	"context"
	"errors"
	"testing"

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
	if !errors.As(err, &dup) || dup.TaskID != first.ID {
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
