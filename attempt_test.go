package dedup

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/attempt"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// attemptRun is one attempt as a wrapper outside the middleware saw it.
type attemptRun struct {
	id    string
	retry int
	a     attempt.Attempt
}

// serveAttempts runs a server on h's queue whose handler is the middleware
// wrapped by a recorder of each attempt's attempt.Attempt (WithAttempt), until the
// test ends. Each attempt is reported once the middleware has returned.
func (h *harness) serveAttempts(handler asynq.HandlerFunc) <-chan attemptRun {
	h.t.Helper()
	out := make(chan attemptRun, 100)
	inner := h.d.Middleware()(handler)
	outer := asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		var a attempt.Attempt
		err := inner.ProcessTask(attempt.With(ctx, &a), t)
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		out <- attemptRun{id: id, retry: n, a: a}
		return err
	})
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{
		Concurrency: 4, Queues: map[string]int{h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	})
	if err := srv.Start(outer); err != nil {
		h.t.Fatalf("server start: %v", err)
	}
	var once sync.Once
	h.t.Cleanup(func() { once.Do(srv.Shutdown) })
	return out
}

// nextAttempt returns the next recorded attempt of task id, skipping others.
func nextAttempt(t *testing.T, ch <-chan attemptRun, id string) attemptRun {
	t.Helper()
	for {
		r := waitFor(t, ch, "an attempt of "+id)
		if r.id == id {
			return r
		}
	}
}

// TestWithAttemptHeldReleasedFollowUp: a failed attempt with retries left is
// held, the retry releases, and a release that queues a RunningDefer
// follow-up names it; each names the lock by its fingerprint.
func TestWithAttemptHeldReleasedFollowUp(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"at:run": {Fields: []string{"k"}, OnConflict: Replace, OnRunning: RunningDefer}}})
	ctx := context.Background()
	running, finish := make(chan struct{}, 1), make(chan struct{})
	runs := h.serveAttempts(func(ctx context.Context, tk *asynq.Task) error {
		if string(tk.Payload()) != `{"k":1,"v":1}` {
			return nil
		}
		if n, _ := asynq.GetRetryCount(ctx); n == 0 {
			return errors.New("first attempt fails")
		}
		running <- struct{}{}
		<-finish
		return nil
	})
	first, err := h.client.Submit(ctx, asynq.NewTask("at:run", []byte(`{"k":1,"v":1}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if r := nextAttempt(t, runs, first.TaskID); r.a.Outcome != attempt.Held || r.a.Fingerprint != first.Fingerprint || r.a.Arrived {
		t.Fatalf("failed attempt: %+v, want held under %s", r.a, first.Fingerprint)
	}
	waitFor(t, running, "the retry to run")
	follow, err := h.client.Submit(ctx, asynq.NewTask("at:run", []byte(`{"k":1,"v":2}`)), asynq.Queue(h.queue))
	if err != nil || follow.Outcome != Deferred {
		t.Fatalf("second call: %+v, %v; want deferred", follow, err)
	}
	close(finish)
	r := nextAttempt(t, runs, first.TaskID)
	if r.a.Outcome != attempt.Released || r.a.FollowUp != follow.TaskID || r.retry != 1 {
		t.Fatalf("retry: %+v (retry %d), want released queueing follow-up %s", r.a, r.retry, follow.TaskID)
	}
	if r := nextAttempt(t, runs, follow.TaskID); r.a.Outcome != attempt.Released || r.a.FollowUp != "" || r.a.Fingerprint != first.Fingerprint {
		t.Fatalf("follow-up: %+v, want released", r.a)
	}
}

// TestWithAttemptBusy: a task that arrives without a lock (asynq's own client)
// and meets its key held by a waiting task is dropped, folded or retried by
// its type's Busy policy, and its attempt.Attempt names the holder.
func TestWithAttemptBusy(t *testing.T) {
	rule := func(b Busy) Rule { return Rule{Fields: []string{"k"}, OnBusy: b} }
	h := newHarness(t, Config{Rules: map[string]Rule{"at:drop": rule(BusyDrop), "at:fold": rule(BusyFold), "at:retry": rule(BusyRetry)}})
	ctx := context.Background()
	runs := h.serveAttempts(func(context.Context, *asynq.Task) error { return nil })
	want := map[string]attempt.Outcome{"at:drop": attempt.BusyDropped, "at:fold": attempt.BusyFolded, "at:retry": attempt.BusyRetried}
	for typ, outcome := range want {
		holder, err := h.client.Submit(ctx, asynq.NewTask(typ, []byte(`{"k":1}`)), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		arrival, err := h.asynq.Enqueue(asynq.NewTask(typ, []byte(`{"k":1,"n":2}`)), asynq.Queue(h.queue))
		if err != nil {
			t.Fatal(err)
		}
		r := nextAttempt(t, runs, arrival.ID)
		if r.a.Outcome != outcome || r.a.Holder != holder.TaskID || !r.a.Arrived || r.a.Fingerprint != holder.Fingerprint {
			t.Errorf("%s: %+v, want %v naming holder %s", typ, r.a, outcome, holder.TaskID)
		}
	}
}

// TestWithAttemptUnlockedAllowedCooling: a task nothing deduplicates runs not
// locked, a RunningAllow task runs allowed, a Cooldown task's success
// leaves its key cooling.
func TestWithAttemptUnlockedAllowedCooling(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"at:allow": {Fields: []string{"k"}, OnRunning: RunningAllow},
		"at:cool":  {Fields: []string{"k"}, Cooldown: time.Minute},
	}})
	ctx := context.Background()
	runs := h.serveAttempts(func(context.Context, *asynq.Task) error { return nil })
	cases := []struct {
		typ  string
		opts []asynq.Option
		want attempt.Outcome
	}{
		{"at:plain", []asynq.Option{Skip()}, attempt.NotLocked},
		{"at:allow", nil, attempt.Allowed},
		{"at:cool", nil, attempt.Cooling},
	}
	for _, c := range cases {
		res, err := h.client.Submit(ctx, asynq.NewTask(c.typ, []byte(`{"k":1}`)), append(c.opts, asynq.Queue(h.queue))...)
		if err != nil {
			t.Fatal(err)
		}
		if r := nextAttempt(t, runs, res.TaskID); r.a.Outcome != c.want || r.a.Fingerprint != res.Fingerprint {
			t.Errorf("%s: %+v, want %v under %q", c.typ, r.a, c.want, res.Fingerprint)
		}
	}
}

// TestWithAttemptUnusedCostsNothing: without WithAttempt the middleware's
// recording is a context lookup and nil checks: no allocation.
func TestWithAttemptUnusedCostsNothing(t *testing.T) {
	ctx := context.WithValue(context.Background(), struct{ k int }{1}, "v")
	l := &lease{}
	allocs := testing.AllocsPerRun(100, func() {
		a := attempt.Of(ctx)
		a.Set(attempt.Released)
		a.Other(attempt.BusyDropped, "x")
		a.Locked(l.ref.FP, l.arrived)
		a.Settled(store.SettleResult{Owned: true}, nil)
	})
	if allocs != 0 || attempt.Of(ctx) != nil || attempt.Of(attempt.With(ctx, nil)) != nil {
		t.Fatalf("allocs = %v, want 0", allocs)
	}
	for o := attempt.None; o <= attempt.Superseded; o++ {
		if s := o.String(); s == "" || strings.HasPrefix(s, "attempt.") {
			t.Errorf("attempt.Outcome(%d) has no name: %q", int(o), s)
		}
	}
}
