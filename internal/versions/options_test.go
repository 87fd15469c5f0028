package versions

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
)

// store.Reserved: a caller-chosen ID of this package's forms is refused, so
// that the middleware never reads a caller's ID as a marked one: on every
// way in (a call's asynq.TaskID, NewTask's, a batch, dedup.Skip), before
// anything is written.
func TestCallerIDOfTheMarkedFormIsRefusedLeavingNothing(t *testing.T) {
	const forged = "dm-sw-0123456789abcdef-0123456789abcdef0123"
	eachClient(t, nil, func(t *testing.T, e *env) {
		ctx := context.Background()
		check := func(what string, err error) {
			t.Helper()
			if !errors.Is(err, dedup.ErrInvalidOption) {
				t.Errorf("%s: %v, want ErrInvalidOption", what, err)
			}
		}
		_, err := e.submit("mark", "m", asynq.TaskID(forged))
		check("call's TaskID", err)
		_, err = e.c.Submit(ctx, asynq.NewTask("mark", []byte("m"), asynq.TaskID(forged)), asynq.Queue(e.q))
		check("NewTask's TaskID", err)
		_, err = e.submit("mark", "m", asynq.TaskID(forged), dedup.Skip())
		check("Skip with TaskID", err)
		res := e.c.EnqueueBatch(ctx, []*asynq.Task{asynq.NewTask("mark", []byte("m"), asynq.TaskID(forged))}, asynq.Queue(e.q))
		check("batch", res[0].Err)
		if !e.free("mark", "m") {
			t.Fatal("a refused call left a lock")
		}
		if _, err := e.insp.GetTaskInfo(e.q, forged); err == nil {
			t.Fatal("a refused call stored its task")
		}
	})
}

// docs/versions.md: "So is dedup.Skip() with your own ID, whose mark keeps a
// server's execution guard off the task" (refused without task headers,
// nothing written); with task headers it is enqueued under that ID.
func TestSkipUnderACallerChosenIDNeedsTaskHeaders(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		res, err := e.submit("skip", "s", dedup.Skip(), asynq.TaskID("my-skip"))
		_, stored := e.insp.GetTaskInfo(e.q, "my-skip")
		if hasHeaders() {
			if err != nil || res.TaskID != "my-skip" || stored != nil {
				t.Fatalf("with task headers: %+v, %v (stored: %v)", res, err, stored)
			}
			return
		}
		if !errors.Is(err, dedup.ErrInvalidOption) || stored == nil {
			t.Fatalf("without task headers: %+v, %v (stored: %v); want ErrInvalidOption, nothing stored", res, err, stored)
		}
		// Under the library's ID it is enqueued, and the guard leaves it.
		res = e.mustSubmit(dedup.Created, "skip", "s", dedup.Skip())
		if !strings.HasPrefix(res.TaskID, "dx-") {
			t.Fatalf("skipped task's ID %q, want dx-…", res.TaskID)
		}
	})
}

// The per-call options reach the lock and asynq without task headers: Key
// keys two payloads as one, OnConflict(Replace) folds into the waiting task,
// ProcessIn schedules it (and the lock covers the delay), MaxRetry(0)
// archives it at its first failure, and the lock's TTL follows dedup.TTL.
func TestPerCallOptionsApplyWithoutTaskHeaders(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "opt", "p1", dedup.Key("k"), asynq.ProcessIn(time.Hour), asynq.MaxRetry(0), dedup.TTL(2*time.Hour))
		if a.Info == nil || a.Info.State != asynq.TaskStateScheduled || a.Info.MaxRetry != 0 {
			t.Fatalf("created %+v; want scheduled, MaxRetry 0", a.Info)
		}
		res := e.mustSubmit(dedup.Replaced, "opt", "p2", dedup.Key("k"), dedup.OnConflict(dedup.Replace))
		if res.TaskID != a.TaskID {
			t.Fatalf("replaced into %s, want %s", res.TaskID, a.TaskID)
		}
		l, found, err := e.d.Lookup(context.Background(), asynq.NewTask("opt", []byte("other")), asynq.Queue(e.q), dedup.Key("k"))
		if err != nil || !found || l.Holder != a.TaskID || l.TTL < 2*time.Hour {
			t.Fatalf("lookup: %+v, %v, %v; want held by %s for over 2h", l, found, err, a.TaskID)
		}
		ti, err := e.insp.GetTaskInfo(e.q, a.TaskID)
		if err != nil || string(ti.Payload) != "p2" || ti.MaxRetry != 0 || ti.State != asynq.TaskStateScheduled {
			t.Fatalf("stored %+v, %v; want p2, MaxRetry 0, scheduled", ti, err)
		}
		if err := e.insp.RunTask(e.q, a.TaskID); err != nil {
			t.Fatal(err)
		}
		e.serve(func(context.Context, *asynq.Task) error { return errors.New("fails") })
		redistest.Eventually(t, "archived at its first failure", func() bool { return e.state(a.TaskID) == asynq.TaskStateArchived })
		redistest.Eventually(t, "the key's next enqueue takes it", func() bool {
			res, err := e.submit("opt", "p3", dedup.Key("k"), asynq.ProcessIn(time.Hour))
			return err == nil && res.Outcome == dedup.Created
		})
	})
}

// routed is an Enqueuer that puts every task in queue to, whatever the call
// asked (a decorator that routes by type, say).
type routed struct {
	c  *asynq.Client
	to string
}

func (r routed) EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return r.c.EnqueueContext(ctx, task, append(opts, asynq.Queue(r.to))...)
}

func (r routed) Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return r.EnqueueContext(context.Background(), task, opts...)
}

func (r routed) Close() error { return r.c.Close() }

// lifecycle.md: "A task in another queue than its lock … is then taken back
// out before a worker takes it, and the call is made again in that queue":
// the key is held there by the task, refuses a duplicate there, and is free
// in the queue asked for; the task runs once and frees it.
func TestTaskRoutedToAnotherQueueHoldsItsKeyWhereItLanded(t *testing.T) {
	t.Parallel()
	redistest.NeedReal(t)
	e := newEnv(t, "NewClient", nil)
	other := e.q + "-to"
	c := e.d.WrapClient(routed{c: asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr()}), to: other})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	a, err := c.Submit(ctx, asynq.NewTask("rt", []byte("r")), asynq.Queue(e.q))
	if err != nil || a.Outcome != dedup.Created || a.Info.Queue != other {
		t.Fatalf("%+v, %v; want created in %s", a, err, other)
	}
	_, err = c.Submit(ctx, asynq.NewTask("rt", []byte("r")), asynq.Queue(other))
	var dup *dedup.DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != a.TaskID {
		t.Fatalf("in %s: %v; want a duplicate of %s", other, err, a.TaskID)
	}
	if !e.free("rt", "r") {
		t.Fatalf("the key is held in %s, the queue the task left", e.q)
	}
	r := newRuns()
	e.q = other
	e.serve(func(context.Context, *asynq.Task) error {
		r.enter("r")
		r.exit("r")
		return nil
	})
	redistest.WaitFor(t, r.ran, "the task's run")
	redistest.Eventually(t, "the key is free after its success", func() bool { return e.free("rt", "r") })
}

// policies.md: RunningAllow frees the key as the task starts, so the key's
// next enqueue is accepted while it runs; both run, and the key is free at
// the end.
func TestRunningAllowFreesTheKeyAsTheTaskStarts(t *testing.T) {
	rules := map[string]dedup.Rule{"al": {OnRunning: dedup.RunningAllow}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		started, release := make(chan struct{}, 2), make(chan struct{})
		r := newRuns()
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter(string(task.Payload()))
			defer r.exit(string(task.Payload()))
			started <- struct{}{}
			<-release
			return nil
		})
		e.mustSubmit(dedup.Created, "al", "a")
		redistest.WaitFor(t, started, "the first run")
		redistest.Eventually(t, "the key is free while it runs", func() bool { return e.free("al", "a") })
		e.mustSubmit(dedup.Created, "al", "a")
		redistest.WaitFor(t, started, "the second run, beside the first")
		close(release)
		redistest.WaitFor(t, r.ran, "a run's end")
		redistest.WaitFor(t, r.ran, "the other run's end")
		redistest.Eventually(t, "the key is free", func() bool { return e.free("al", "a") })
	})
}

// Config.Rule.MaxPending bounds the keys of a type waiting in one queue; a
// key that starts waits no more.
func TestMaxPendingBoundsTheWaitingKeys(t *testing.T) {
	rules := map[string]dedup.Rule{"mp": {MaxPending: 2}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		e.mustSubmit(dedup.Created, "mp", "1")
		e.mustSubmit(dedup.Created, "mp", "2")
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		if res, err := e.c.Submit(ctx, asynq.NewTask("mp", []byte("3")), asynq.Queue(e.q)); err == nil {
			t.Fatalf("a third waiting key: %+v, want refused", res)
		}
		r := e.serveRecording()
		redistest.WaitFor(t, r.ran, "a run")
		redistest.WaitFor(t, r.ran, "the other run")
		redistest.Eventually(t, "room for another key", func() bool {
			res, err := e.submit("mp", "3")
			return err == nil && res.Outcome == dedup.Created
		})
		redistest.WaitFor(t, r.ran, "the third run")
		redistest.Eventually(t, "the keys are free", func() bool { return e.free("mp", "1") && e.free("mp", "2") && e.free("mp", "3") })
	})
}

// wait.go: WaitHolder waits for the task a duplicate names, and returns its
// result once it completes (here a marked task without task headers).
func TestWaitHolderReturnsTheHoldersResult(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "wh", "w", asynq.Retention(time.Hour))
		dup := e.duplicate("wh", "w")
		e.serve(func(context.Context, *asynq.Task) error { return nil })
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		info, err := e.d.WaitHolder(ctx, dup)
		if err != nil || info.ID != a.TaskID || info.State != asynq.TaskStateCompleted {
			t.Fatalf("WaitHolder: %+v, %v; want %s completed", info, err, a.TaskID)
		}
	})
}

// policies.md (Debounce): a burst of enqueues of a key runs once, with its
// last payload, about Debounce after the burst ends.
func TestDebounceRunsABurstOnceWithItsLastPayload(t *testing.T) {
	rules := map[string]dedup.Rule{"db": {Fields: []string{"k"}, OnConflict: dedup.Replace, Debounce: 500 * time.Millisecond}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "db", `{"k":1,"v":1}`)
		for _, v := range []string{"2", "3"} {
			if res := e.mustSubmit(dedup.Replaced, "db", `{"k":1,"v":`+v+`}`); res.TaskID != first.TaskID {
				t.Fatalf("folded into %s, want %s", res.TaskID, first.TaskID)
			}
		}
		r := e.serveRecording()
		redistest.WaitFor(t, r.ran, "the burst's run")
		redistest.Eventually(t, "the key is free", func() bool { return e.free("db", `{"k":1}`) })
		time.Sleep(300 * time.Millisecond)
		if got := r.seen(); !slices.Equal(got, []string{`{"k":1,"v":3}`}) {
			t.Fatalf("runs %q, want one with the last payload", got)
		}
	})
}
