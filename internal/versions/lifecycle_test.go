package versions

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
)

// A task's life on every asynq version: shutdowns, operators (release,
// archive, run by hand), revokes, final failures. Without task headers
// (before v0.26.0) a task's mark travels in its ID (dm-…), and the marks
// written on a waiting task's record (dedup-lost) are read from there as
// it starts.

// serveRaw runs a server on the test's queue with handler (the caller
// mounts the middleware), until stop or the test's end.
func (e *env) serveRaw(handler asynq.Handler, tweak func(*asynq.Config)) (stop func()) {
	cfg := asynq.Config{
		Concurrency: 4, Queues: map[string]int{e.q: 1}, LogLevel: asynq.FatalLevel,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond },
		DelayedTaskCheckInterval: 100 * time.Millisecond, ShutdownTimeout: 5 * time.Second,
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr()}, cfg)
	if err := srv.Start(handler); err != nil {
		e.t.Fatal(err)
	}
	var once sync.Once
	stop = func() { once.Do(srv.Shutdown) }
	e.t.Cleanup(stop)
	return stop
}

// slowOuter serves the middleware for inner under an outer middleware that,
// after the first attempt it sees ends, waits for asynq to give the attempt
// up (a shutdown past ShutdownTimeout), as a tracing or logging middleware
// still at work might. ended receives the attempt's task ID once the
// middleware has returned.
func (e *env) slowOuter(inner asynq.HandlerFunc, ended chan<- string) (stop func()) {
	var once sync.Once
	mw := e.d.Middleware()(inner)
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		first := false
		once.Do(func() { first = true })
		if first {
			id, _ := asynq.GetTaskID(ctx)
			ended <- id
			<-ctx.Done()
		}
		return err
	})
	return e.serveRaw(outer, func(c *asynq.Config) {
		c.Concurrency = 1
		c.ShutdownTimeout = 300 * time.Millisecond
	})
}

func (e *env) state(id string) asynq.TaskState {
	ti, err := e.insp.GetTaskInfo(e.q, id)
	if err != nil {
		return 0
	}
	return ti.State
}

// gone reports whether asynq is done with task id (completed, or its record
// deleted).
func (e *env) gone(id string) bool {
	st := e.state(id)
	return st == 0 || st == asynq.TaskStateCompleted
}

// Release (locks.go): "if it still waits, it is marked, so that when it
// runs it checks the key first (and gives way to a task of its type that
// took the key since)"; busy.go: "of a Replace type it is superseded (not
// run: the holder carries the newer payload)". A waiting task A of a
// Replace type is released by an operator; the key's next enqueue B (a
// newer payload) takes the key. A must not run after B with its older
// payload: the last run of the key is the newest payload.
func TestReleasedWaitingTaskOfAReplaceTypeGivesWayToTheNewerHolder(t *testing.T) {
	rules := map[string]dedup.Rule{"state": {Fields: []string{"user"}, OnConflict: dedup.Replace}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "state", `{"user":1,"v":1}`)
		ok, err := e.d.Release(context.Background(), asynq.NewTask("state", []byte(`{"user":1}`)), a.TaskID, asynq.Queue(e.q))
		if err != nil || !ok {
			t.Fatalf("release: %v, %v", ok, err)
		}
		b := e.mustSubmit(dedup.Created, "state", `{"user":1,"v":2}`)
		r := newRuns()
		release := make(chan struct{})
		e.serve(func(_ context.Context, task *asynq.Task) error {
			p := string(task.Payload())
			r.enter(p)
			defer r.exit(p)
			if p == `{"user":1,"v":2}` {
				<-release // B runs while A starts
			}
			return nil
		})
		redistest.Eventually(t, "the released task A meets its key held by B, or is done", func() bool {
			return e.d.Stats().Busy > 0 || e.gone(a.TaskID)
		})
		close(release)
		redistest.Eventually(t, "asynq is done with both", func() bool { return e.gone(a.TaskID) && e.gone(b.TaskID) })
		time.Sleep(300 * time.Millisecond) // (a run of A under way)
		if got := r.seen(); !slices.Equal(got, []string{`{"user":1,"v":2}`}) {
			t.Fatalf("runs %q; want only the newer holder's payload (the released task superseded); stats %+v", got, e.d.Stats())
		}
	})
}

// lifecycle.md: "A handler that succeeded after all cools its key
// (Cooldown): the retry that follows finds its own cooling key and does not
// run again". A shutdown requeues a task whose success already cooled its
// key (a middleware outside Dedup's still at work): it must not run again.
// (A caller-chosen ID where asynq has task headers, v0.26.0: the middleware
// settles its cooldown, as it does every cooldown on older asynqs. Under a
// task ID of NewClient's own on asynq v0.26.0, asynq's record of the success keeps
// the cooldown, and a success asynq did not record runs again: the root
// package's TestKeptCooldownTaskRequeuedBeforeAsynqRecordedItsSuccessRunsAgainHoldingItsKey.)
func TestCooledTaskRequeuedByAShutdownAfterItsSuccessDoesNotRunAgain(t *testing.T) {
	rules := map[string]dedup.Rule{"digest": {Cooldown: time.Hour}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		ended := make(chan string, 1)
		stop := e.slowOuter(func(context.Context, *asynq.Task) error { return nil }, ended)
		var own []asynq.Option
		if hasHeaders() { // (an older asynq takes no caller-chosen ID under a lock: its cooldown is settled anyway)
			own = append(own, asynq.TaskID("cooled-"+e.q))
		}
		a := e.mustSubmit(dedup.Created, "digest", "d", own...)
		redistest.WaitFor(t, ended, "the task's attempt ended")
		if st := e.lookup("digest", "d"); st != "cooling" {
			t.Fatalf("key %q after the success, want cooling", st)
		}
		stop()
		if st := e.state(a.TaskID); st != asynq.TaskStatePending {
			t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
		}
		r := newRuns()
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter("d")
			r.exit("d")
			return nil
		})
		redistest.Eventually(t, "asynq is done with the requeued task", func() bool { return e.gone(a.TaskID) })
		if got := r.seen(); len(got) > 0 {
			t.Fatalf("the cooled task ran again inside its cooldown: %q", got)
		}
		if st := e.lookup("digest", "d"); st != "cooling" {
			t.Fatalf("key %q, want still cooling", st)
		}
	})
}

// "never two handlers of a key running at once", and a task whose attempt
// ended is not run again: a shutdown requeues a task whose success already
// released its key (the middleware releases it where
// asynq's record does not name the lock: every task without task headers);
// the key's next enqueue is then accepted, and the two must not run at once.
func TestTaskRequeuedByAShutdownAfterItsReleaseNeverRunsBesideTheKeysNextTask(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		ended := make(chan string, 1)
		stop := e.slowOuter(func(context.Context, *asynq.Task) error { return nil }, ended)
		a := e.mustSubmit(dedup.Created, "job", "j")
		redistest.WaitFor(t, ended, "the task's attempt ended")
		stop()
		if st := e.state(a.TaskID); st != asynq.TaskStatePending {
			t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
		}
		b, err := e.submit("job", "j")
		if err != nil {
			return // refused while the requeued task waits: one live task of the key
		}
		r := newRuns()
		e.serve(func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			r.enter(id)
			defer r.exit(id)
			time.Sleep(200 * time.Millisecond)
			return nil
		})
		redistest.Eventually(t, "asynq is done with both", func() bool { return e.gone(a.TaskID) && e.gone(b.TaskID) })
		if r.most() != 1 {
			t.Fatalf("%d runs of one key at once (runs %q)", r.most(), r.seen())
		}
		if slices.Contains(r.seen(), a.TaskID) { // (lifecycle.md: it is done, marked dedup-lost: ended)
			t.Fatalf("the requeued task ran again after its success: runs %q (A %s, B %s)", r.seen(), a.TaskID, b.TaskID)
		}
	})
}

// lifecycle.md: "shutdown, the handler outliving ShutdownTimeout | asynq
// requeues the task: the lock stays with it, and the task is marked …, so
// that a server taking it while the handler still runs meets its key busy
// and does not run it beside the handler."
func TestHandlerOutlivingAShutdownNeverRunsBesideItsRequeuedTask(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		r := newRuns()
		started, release := make(chan struct{}, 1), make(chan struct{})
		var first sync.Once
		h := func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			r.enter(id)
			defer r.exit(id)
			block := false
			first.Do(func() { block = true })
			if block {
				started <- struct{}{}
				<-release // outlives the shutdown, ignoring its context
			}
			return nil
		}
		stop := e.serveRaw(e.d.Middleware()(asynq.HandlerFunc(h)), func(c *asynq.Config) { c.ShutdownTimeout = 300 * time.Millisecond })
		a := e.mustSubmit(dedup.Created, "long", "l")
		redistest.WaitFor(t, started, "the first run")
		stop()
		if st := e.state(a.TaskID); st != asynq.TaskStatePending {
			close(release)
			t.Fatalf("task %v after the shutdown, want pending (requeued)", st)
		}
		busy := e.d.Stats().Busy
		e.serve(h)
		redistest.Eventually(t, "the next server takes the requeued task while the handler runs", func() bool {
			return e.d.Stats().Busy > busy || r.most() > 1
		})
		if r.most() > 1 {
			close(release)
			t.Fatalf("%d runs of one key at once", r.most())
		}
		close(release)
		redistest.WaitFor(t, r.ran, "the outliving handler's end")
		redistest.Eventually(t, "asynq is done with the task", func() bool { return e.gone(a.TaskID) })
		if r.most() != 1 {
			t.Fatalf("%d runs of one key at once", r.most())
		}
	})
}

// compat.go: this source cannot name asynq.RevokeTask; asynq knows only its
// own value, and retries a look-alike (errors.New("revoke task")) like any
// other error. So must the middleware.
// lifecycle.md: "other error or panic, retries left | held for
// RetryDelayFunc(n) + TTL". A handler's look-alike error must not free
// the key while asynq still has the task wait for its retry, nor swallow
// that retry.
func TestLookAlikeRevokeErrorKeepsTheKeyForTheRetry(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "rv", "r", asynq.MaxRetry(1))
		var mu sync.Mutex
		calls := 0
		e.serveRaw(e.d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
			mu.Lock()
			calls++
			mu.Unlock()
			return errors.New("revoke task") // not asynq.RevokeTask: asynq retries it
		})), func(c *asynq.Config) {
			c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Second }
		})
		redistest.Eventually(t, "the task waits for its retry", func() bool { return e.state(a.TaskID) == asynq.TaskStateRetry })
		if st := e.lookup("rv", "r"); st == "" {
			t.Errorf("the key is free while asynq has the task wait for its retry")
		}
		redistest.Eventually(t, "the task is archived after its retry", func() bool { return e.state(a.TaskID) == asynq.TaskStateArchived })
		mu.Lock()
		defer mu.Unlock()
		if calls != 2 {
			t.Fatalf("%d runs, want 2 (asynq retries the error once)", calls)
		}
	})
}

// failures.md: a holder that fails for good hands the key to the follow-up
// it owes (RunningDefer), which runs with the newest payload; then the key
// is free.
func TestFinalFailureHandsTheKeyToTheFollowUpOwed(t *testing.T) {
	rules := map[string]dedup.Rule{"ix": {Fields: []string{"doc"}, OnConflict: dedup.Replace, OnRunning: dedup.RunningDefer}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		e.mustSubmit(dedup.Created, "ix", `{"doc":1,"v":1}`, asynq.MaxRetry(0))
		r := newRuns()
		started, release := make(chan struct{}, 1), make(chan struct{})
		e.serve(func(_ context.Context, task *asynq.Task) error {
			p := string(task.Payload())
			r.enter(p)
			defer r.exit(p)
			if p == `{"doc":1,"v":1}` {
				started <- struct{}{}
				<-release
				return errors.New("fails for good")
			}
			return nil
		})
		redistest.WaitFor(t, started, "the holder's run")
		e.mustSubmit(dedup.Deferred, "ix", `{"doc":1,"v":2}`)
		close(release)
		redistest.WaitFor(t, r.ran, "the holder's end")
		redistest.WaitFor(t, r.ran, "the follow-up's run")
		redistest.Eventually(t, "the key is free", func() bool { return e.free("ix", `{"doc":1}`) })
		if got := r.seen(); !slices.Equal(got, []string{`{"doc":1,"v":1}`, `{"doc":1,"v":2}`}) || r.most() != 1 {
			t.Fatalf("runs %q (%d at once)", got, r.most())
		}
	})
}

// The matrix (README): "the Inspector archives or deletes the task while it
// waits"; versions.md: "an archived task whose key was taken since, run
// again by hand, meets its key held and waits behind the newer task instead
// of running beside it" — here archived by an operator while it waited.
func TestTaskArchivedByHandWhileWaitingNeverRunsBesideTheNewHolder(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "ah", "h", asynq.ProcessIn(time.Hour))
		if err := e.insp.ArchiveTask(e.q, a.TaskID); err != nil {
			t.Fatal(err)
		}
		var b dedup.Result
		redistest.Eventually(t, "the key's next enqueue heals it", func() bool {
			res, err := e.submit("ah", "h")
			b = res
			return err == nil && res.Outcome == dedup.Created
		})
		r := newRuns()
		started, release := make(chan string, 4), make(chan struct{})
		e.serve(func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			r.enter(id)
			defer r.exit(id)
			started <- id
			<-release
			return nil
		})
		if got := redistest.WaitFor(t, started, "the new holder's run"); got != b.TaskID {
			t.Fatalf("ran %s, want the new holder %s", got, b.TaskID)
		}
		busy := e.d.Stats().Busy
		if err := e.insp.RunTask(e.q, a.TaskID); err != nil {
			t.Fatal(err)
		}
		redistest.Eventually(t, "the archived task meets the key busy", func() bool { return e.d.Stats().Busy > busy })
		close(release)
		redistest.Eventually(t, "asynq is done with both", func() bool { return e.gone(a.TaskID) && e.gone(b.TaskID) })
		if r.most() != 1 {
			t.Fatalf("%d runs of one key at once", r.most())
		}
	})
}
