package dedup

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// With Reject + RunningDefer, an enqueue that meets a running key whose
// follow-up waits is refused as a duplicate OF THE FOLLOW-UP (README). The
// Decision then names the follow-up as TaskID: its FollowUp field must say
// so ("whether that task is a follow-up").
func TestOnDecisionMarksADuplicateOfAFollowUp(t *testing.T) {
	var rec decisions
	cfg := counterRules(Rule{OnConflict: Reject, OnRunning: RunningDefer})
	cfg.OnDecision = rec.hook
	h := newHarness(t, cfg)
	ctx := context.Background()
	h.enqueue(counterTask("k", 1, 0))
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	waitFor(t, rc.runs, "first run")
	d1, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || d1.Outcome != Deferred || !d1.FollowUp {
		t.Fatalf("defer: %+v %v", d1, err)
	}
	_, err = h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.TaskID != d1.TaskID {
		t.Fatalf("second enqueue: %v, want a duplicate of the follow-up %s", err, d1.TaskID)
	}
	heard := rec.all()
	last := heard[len(heard)-1]
	if last.Event != "duplicate" || last.TaskID != d1.TaskID || !last.FollowUp {
		t.Fatalf("decision %+v: TaskID is the follow-up %s, but FollowUp = %v", last, d1.TaskID, last.FollowUp)
	}
}

// A busy arrival folded into its holder (BusyFold) is ONE decision: a
// "busy" one naming the task now carrying its payload. It must not also be
// reported (and counted) as an enqueue "coalesced" that nobody made.
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
	if s := h.d.StatsByType()["counter"]; s.Coalesced != 0 || s.Busy != 1 {
		t.Fatalf("counted coalesced %d, busy %d: the busy fold counted as an enqueue too", s.Coalesced, s.Busy)
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
	if st := h.taskState(arrival.ID); st != asynq.TaskStateRetry {
		t.Fatalf("arrival state %v, want retry", st)
	}
}

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

// Lookup reads the key an enqueue would take. For a task whose queue comes
// from asynq.NewTask, another process's enqueue is refused as a duplicate
// of the holder there; its Lookup must find that holder too, and its
// Release must not report the held key free.
func TestLookupHonoursTheQueueInNewTask(t *testing.T) {
	h := newHarness(t, Config{})
	ctx := context.Background()
	task := asynq.NewTask("user:reindex", userTask(9, "").Payload(), asynq.Queue(h.queue))
	first, err := h.client.Enqueue(task)
	if err != nil || first.Queue != h.queue {
		t.Fatalf("first: %+v %v", first, err)
	}
	other := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix}) // another process
	l, found, err := other.d.Lookup(ctx, task)
	if err != nil || !found || l.Holder != first.ID {
		// Show what an enqueue from that process does with the same task.
		_, eerr := other.client.Enqueue(task)
		t.Fatalf("Lookup: %+v found=%v err=%v; want held by %s (an enqueue of it from the same process: %v)", l, found, err, first.ID, eerr)
	}
}

// connOpt is an asynq.RedisConnOpt of the caller's own.
type connOpt struct{ c any }

func (o connOpt) MakeRedisClient() any { return o.c }

// A RedisConnOpt that makes a nil client is bad input: ErrInvalidOption,
// not a panic.
func TestNewFromRedisConnOptWithANilClientIsInvalid(t *testing.T) {
	for name, c := range map[string]any{"untyped nil": nil, "typed nil": (*redis.Client)(nil)} {
		t.Run(name, func(t *testing.T) {
			var err error
			func() {
				defer func() {
					if r := recover(); r != nil {
						err = fmt.Errorf("panic: %v", r)
					}
				}()
				_, err = NewFromRedisConnOpt(context.Background(), connOpt{c}, Config{ConnectAttempts: 1, Logger: quietLogger()})
			}()
			if !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("err = %v, want ErrInvalidOption", err)
			}
		})
	}
}

// Options given to asynq.NewTask are the call's options too: folded into
// another task, they are not applied, and NotApplied must name them.
func TestFoldNamesNewTaskOptionsNotApplied(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace}))
	h.enqueue(counterTask("k", 1, 0))
	task := asynq.NewTask("counter", counterTask("k", 1, 1).Payload(), asynq.MaxRetry(3))
	res, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue))
	if err != nil || res.Outcome != Replaced {
		t.Fatalf("%+v %v", res, err)
	}
	if got := fmt.Sprint(res.NotApplied); got != "[MaxRetry(3)]" {
		t.Fatalf("NotApplied = %s, want [MaxRetry(3)]: the holder kept its own MaxRetry", got)
	}
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
