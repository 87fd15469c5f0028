package dedup

import (
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
