package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// operations.md, doctor: "A hold a policy keeps past its holder (cooling, a
// fail hold, a Scheduler firing's) is never one: doctor neither lists
// nor releases it." policies.md, OnFailure: the archived task holds the key
// "also once an operator deletes it"; lifecycle.md, Task IDs: "Once no task
// with an ID exists, the ID can be used again, for any key". A fail hold
// whose deleted holder's caller-chosen ID now names a completed task of
// another key is still a hold: doctor --fix must leave it.
func TestDoctorFixLeavesAFailHoldWhoseHoldersIDWasReusedForAnotherKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"crm:sync": {Fields: []string{"user_id"}, OnFailure: dedup.FailHoldUntilReleased},
	}})
	ctx := context.Background()
	done := make(chan string, 10)
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{
		Concurrency:       2,
		Queues:            map[string]int{f.qa: 1},
		TaskCheckInterval: 20 * time.Millisecond,
		LogLevel:          asynq.FatalLevel,
		IsFailure:         dedup.IsFailure,
	})
	if err := srv.Start(f.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		defer func() { done <- id }()
		if string(t.Payload()) == `{"user_id":1}` {
			return fmt.Errorf("crm: 403 forbidden: %w", asynq.SkipRetry)
		}
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)

	client := f.d.NewClient()
	id := "crm-" + randHex(4)
	a, err := client.Submit(ctx, asynq.NewTask("crm:sync", []byte(`{"user_id":1}`)), asynq.Queue(f.qa), asynq.TaskID(id))
	if err != nil {
		t.Fatal(err)
	}
	keyA := store.NewKeys(f.prefix).Lock(f.qa, a.Fingerprint)
	<-done
	f.waitState(keyA, store.LockFailed)
	// (The hold is written before the result reaches asynq: wait for its archive.)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if ti, err := f.insp.GetTaskInfo(f.qa, id); err == nil && ti.State == asynq.TaskStateArchived {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never archived", id)
		}
	}
	if err := f.insp.DeleteTask(f.qa, id); err != nil { // tidying the archive: the hold stays
		t.Fatal(err)
	}
	f.waitState(keyA, store.LockFailed)
	// The ID, free in asynq again, names a task of another key, which succeeds.
	if _, err := client.Enqueue(asynq.NewTask("crm:sync", []byte(`{"user_id":2}`)), asynq.Queue(f.qa), asynq.TaskID(id), asynq.Retention(time.Hour)); err != nil {
		t.Fatal(err)
	}
	<-done
	deadline := time.Now().Add(5 * time.Second)
	for {
		if ti, err := f.insp.GetTaskInfo(f.qa, id); err == nil && ti.State == asynq.TaskStateCompleted {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the task of the other key never completed")
		}
		time.Sleep(10 * time.Millisecond) // asynq marks it done after the handler returned: no signal
	}

	r := f.ok("--json", "doctor", "--grace", "0", "--fix")
	if !f.exists(keyA) {
		t.Fatalf("doctor --fix released the fail hold of %s (until released by hand):\n%s", keyA, r.stdout)
	}
}
