package main

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// Adversarial tests of dedupctl, round 7: releases and doctor --fix of
// locks that owe a RunningDefer follow-up.

// README (Lock API, and release's own note): "A follow-up the lock owes
// that waits is queued now" (after the review: also while the owner runs,
// as the owner's run no longer holds the lock that would queue it at its
// end); dedupctl release prints "follow-up task … is queued now". After
// `dedupctl release --yes` of a running lock that owes a follow-up, the
// follow-up is pending, not left parked.
func TestAdversary7ReleaseOfARunningLockTheRunsEndQueuesItsFollowUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
	}})
	running := f.enqueue(f.qb, "report:build", 1)
	started, finish := f.startServer(f.qb)
	select {
	case id := <-started:
		if id != running.ID {
			t.Fatalf("server ran %s, want %s", id, running.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never ran the task")
	}
	key := f.lockOf(running)
	f.waitRunning(key)
	follow := f.enqueue(f.qb, "report:build", 1)
	if follow.ID == running.ID {
		t.Fatal("the second enqueue did not create a follow-up")
	}
	r := f.ok("release", "--yes", key)
	if !strings.Contains(r.stdout, "is queued now") {
		t.Fatalf("release's note:\n%s", r.stdout)
	}
	finish() // the run ends (nil), and the server stops: nothing takes the follow-up
	deadline := time.Now().Add(3 * time.Second)
	for f.taskState(f.qb, follow.ID) != "pending" {
		if time.Now().After(deadline) {
			ti, _ := f.insp.GetTaskInfo(f.qb, follow.ID)
			due := ""
			if ti != nil {
				due = time.Until(ti.NextProcessAt).Round(time.Second).String()
			}
			t.Fatalf("after the released owner's run ended, its follow-up %s is %s (due in %s), want pending: release said it is queued now",
				follow.ID, f.taskState(f.qb, follow.ID), due)
		}
		time.Sleep(20 * time.Millisecond) // asynq's record changes without a signal
	}
}

// README (dedupctl doctor): "--fix releases them owner-checked … tasks are
// never touched, but for a RunningDefer follow-up the lock owes that still
// waits: it takes the key and is queued now, as the end of its owner's run
// would have done". The owner here has a caller-chosen ID (its lock found
// through the lock header its record carries), failed once (held for its
// retry an hour away) and was archived by an operator after its server
// stopped.
func TestAdversary7DoctorFixHandsACallerIDOwnersKeyToItsFollowUp(t *testing.T) {
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
	owner := "a7-owner-" + randHex(4)
	if _, err := f.client.EnqueueContext(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":0}`)), asynq.Queue(f.qa), asynq.TaskID(owner)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the owner never ran")
	}
	res, err := f.client.Submit(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":1}`)), asynq.Queue(f.qa))
	if err != nil || res.Outcome != dedup.Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	stop() // the attempt fails (retry in an hour) and the server stops: nobody watches the lock
	deadline := time.Now().Add(10 * time.Second)
	for f.taskState(f.qa, owner) != "retry" {
		if time.Now().After(deadline) {
			t.Fatalf("owner %s is %s, want retry", owner, f.taskState(f.qa, owner))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := f.insp.ArchiveTask(f.qa, owner); err != nil {
		t.Fatal(err)
	}
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix", "--queue", f.qa))
	if len(out.Findings) != 1 || !out.Findings[0].Released || out.Findings[0].FollowUp != res.TaskID {
		t.Fatalf("doctor --fix: %+v, want the archived owner's lock released to its follow-up %s", out.Findings, res.TaskID)
	}
	if st := f.taskState(f.qa, res.TaskID); st != "pending" {
		t.Fatalf("follow-up %s is %s, want pending (queued now)", res.TaskID, st)
	}
	again, err := f.client.Submit(ctx, asynq.NewTask("report:build", []byte(`{"user_id":1,"seq":2}`)), asynq.Queue(f.qa))
	if err != nil || again.TaskID != res.TaskID || again.Outcome != dedup.Replaced {
		t.Fatalf("the key's next update: %+v %v, want Replaced into the follow-up %s, which holds the key", again, err, res.TaskID)
	}
}
