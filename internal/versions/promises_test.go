package versions

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/lockview"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
)

// The promises docs/versions.md makes for every asynq version this module
// builds against. Each test runs on NewClient and WrapClient.

func TestNewTakesTheDirectPathOnlyOnTheLayoutItWrites(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		warned := strings.Contains(e.logged.String(), "enqueues go through asynq's client")
		// (A test binary carries no module versions: linked() is "".)
		if want := !hasHeaders() || (linked() != "" && linked() != "v0.26.0"); warned != want {
			t.Fatalf("linked asynq %s: warned %v, want %v (log: %s)", linked(), warned, want, e.logged.String())
		}
	})
}

func TestDuplicateIsRefusedNamingTheWaitingTask(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "report", `{"user":42}`)
		dup := e.duplicate("report", `{"user":42}`)
		if dup.Holder != first.TaskID || !errors.Is(dup, asynq.ErrDuplicateTask) || !errors.Is(dup, dedup.ErrDuplicateTask) {
			t.Fatalf("duplicate names %q (want %q), matches asynq's %v, ours %v", dup.Holder, first.TaskID,
				errors.Is(dup, asynq.ErrDuplicateTask), errors.Is(dup, dedup.ErrDuplicateTask))
		}
		// The operators' tools (dedupctl, dedupweb) find the lock by its task.
		l, _, _ := e.d.Lookup(context.Background(), asynq.NewTask("report", []byte(`{"user":42}`)), asynq.Queue(e.q))
		if tg, err := lockview.ByTask(context.Background(), lockview.NewSource(e.rdb), e.prefix, first.TaskID, ""); err != nil || tg.Key != l.Key {
			t.Fatalf("the lock of task %s: %+v, %v; want %s", first.TaskID, tg, err, l.Key)
		}
		e.mustSubmit(dedup.Created, "report", `{"user":7}`) // another key
		if _, err := e.insp.GetTaskInfo(e.q, first.TaskID); err != nil {
			t.Fatalf("the holder is not stored: %v", err)
		}
	})
}

func TestTaskRunsOnceAndItsSuccessFreesTheKey(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		r := newRuns()
		e.mustSubmit(dedup.Created, "sync", "a")
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter(string(task.Payload()))
			r.exit(string(task.Payload()))
			return nil
		})
		redistest.WaitFor(t, r.ran, "the task's run")
		redistest.Eventually(t, "the key is free after the success", func() bool { return e.free("sync", "a") })
		e.mustSubmit(dedup.Created, "sync", "a")
		redistest.WaitFor(t, r.ran, "the second task's run")
		if got := r.seen(); len(got) != 2 {
			t.Fatalf("runs %q, want two", got)
		}
	})
}

func TestReplaceRunsTheWaitingTaskOnceWithTheNewestPayload(t *testing.T) {
	rules := map[string]dedup.Rule{"state": {Fields: []string{"user"}, OnConflict: dedup.Replace}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "state", `{"user":1,"v":1}`)
		for v := 2; v <= 3; v++ {
			res := e.mustSubmit(dedup.Replaced, "state", `{"user":1,"v":`+string(rune('0'+v))+`}`)
			if res.TaskID != first.TaskID {
				t.Fatalf("replaced into %s, want %s", res.TaskID, first.TaskID)
			}
		}
		r := e.serveRecording()
		redistest.WaitFor(t, r.ran, "the task's run")
		redistest.Eventually(t, "the key is free", func() bool { return e.free("state", `{"user":1}`) })
		if got := r.seen(); !slices.Equal(got, []string{`{"user":1,"v":3}`}) {
			t.Fatalf("runs %q, want one with the newest payload", got)
		}
	})
}

func TestRetryKeepsTheKeyAndTheFinalFailureFreesIt(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "flaky", "x", asynq.MaxRetry(1))
		r := newRuns()
		failed := make(chan struct{}, 2)
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter("x")
			defer r.exit("x")
			failed <- struct{}{}
			return errors.New("boom")
		})
		redistest.WaitFor(t, failed, "the first attempt")
		redistest.Eventually(t, "the task waits for its retry", func() bool {
			ti, err := e.insp.GetTaskInfo(e.q, first.TaskID)
			return err == nil && ti.State == asynq.TaskStateRetry
		})
		if dup := e.duplicate("flaky", "x"); dup.Holder != first.TaskID {
			t.Fatalf("during the retry the key is held by %s, want %s", dup.Holder, first.TaskID)
		}
		redistest.Eventually(t, "the task is archived after its retry", func() bool {
			ti, err := e.insp.GetTaskInfo(e.q, first.TaskID)
			return err == nil && ti.State == asynq.TaskStateArchived
		})
		// (A process that saw the holder live less than a second ago may
		// refuse for that second: docs/lifecycle.md.)
		redistest.Eventually(t, "the key's next enqueue takes it", func() bool {
			res, err := e.submit("flaky", "x")
			return err == nil && res.Outcome == dedup.Created
		})
	})
}

func TestFailHoldKeepsTheKeyAfterTheFinalFailure(t *testing.T) {
	rules := map[string]dedup.Rule{"charge": {OnFailure: dedup.FailHold, FailHoldFor: time.Hour}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "charge", "c", asynq.MaxRetry(0))
		e.serve(func(context.Context, *asynq.Task) error { return errors.New("card declined") })
		redistest.Eventually(t, "the task is archived", func() bool {
			ti, err := e.insp.GetTaskInfo(e.q, first.TaskID)
			return err == nil && ti.State == asynq.TaskStateArchived
		})
		dup := e.duplicate("charge", "c")
		if !dup.FailHeld || dup.Holder != first.TaskID || dup.FreeIn <= 59*time.Minute {
			t.Fatalf("after the final failure: %+v; want held for an hour by %s", dup, first.TaskID)
		}
	})
}

func TestCooldownHoldsTheKeyAfterTheSuccess(t *testing.T) {
	rules := map[string]dedup.Rule{"digest": {Cooldown: time.Hour}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "digest", "d")
		r := newRuns()
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter("d")
			r.exit("d")
			return nil
		})
		redistest.WaitFor(t, r.ran, "the task's run")
		redistest.Eventually(t, "the key cools down", func() bool { return e.lookup("digest", "d") == "cooling" })
		dup := e.duplicate("digest", "d")
		if !dup.CoolingDown || dup.Holder != first.TaskID || dup.FreeIn <= 59*time.Minute {
			t.Fatalf("after the success: %+v; want cooling for about an hour", dup)
		}
	})
}

func TestRunningDeferRunsOneFollowUpAfterTheRunningTask(t *testing.T) {
	rules := map[string]dedup.Rule{"index": {Fields: []string{"doc"}, OnConflict: dedup.Replace, OnRunning: dedup.RunningDefer}}
	eachClient(t, rules, func(t *testing.T, e *env) {
		e.mustSubmit(dedup.Created, "index", `{"doc":9,"v":1}`)
		r := newRuns()
		started, release := make(chan struct{}, 1), make(chan struct{})
		e.serve(func(_ context.Context, task *asynq.Task) error {
			p := string(task.Payload())
			r.enter(p)
			defer r.exit(p)
			if p == `{"doc":9,"v":1}` {
				started <- struct{}{}
				<-release
			}
			return nil
		})
		redistest.WaitFor(t, started, "the first run")
		e.mustSubmit(dedup.Deferred, "index", `{"doc":9,"v":2}`)
		e.mustSubmit(dedup.Replaced, "index", `{"doc":9,"v":3}`)
		close(release)
		redistest.WaitFor(t, r.ran, "the first run's end")
		redistest.WaitFor(t, r.ran, "the follow-up's run")
		redistest.Eventually(t, "the key is free", func() bool { return e.free("index", `{"doc":9}`) })
		if got := r.seen(); !slices.Equal(got, []string{`{"doc":9,"v":1}`, `{"doc":9,"v":3}`}) || r.most() != 1 {
			t.Fatalf("runs %q (at most %d at once), want v1 then v3, one at a time", got, r.most())
		}
	})
}

func TestTasksOfAsynqsOwnClientNeverRunBesideEachOther(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		plain := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr()})
		defer plain.Close()
		for range 2 {
			if _, err := plain.Enqueue(asynq.NewTask("guarded", []byte("g")), asynq.Queue(e.q)); err != nil {
				t.Fatal(err)
			}
		}
		r := newRuns()
		e.serve(func(_ context.Context, task *asynq.Task) error {
			r.enter("g")
			defer r.exit("g")
			time.Sleep(50 * time.Millisecond) // (a run long enough for the other task to meet it)
			return nil
		})
		redistest.WaitFor(t, r.ran, "a run")
		redistest.WaitFor(t, r.ran, "the other run")
		if r.most() != 1 {
			t.Fatalf("%d runs of one key at once", r.most())
		}
	})
}

func TestDeletedWaitingTaskLeavesNoLiveLock(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		first := e.mustSubmit(dedup.Created, "gone", "g")
		if err := e.insp.DeleteTask(e.q, first.TaskID); err != nil {
			t.Fatal(err)
		}
		if st := e.lookup("gone", "g"); st != "" && st != "orphaned" {
			t.Fatalf("after the delete the key is %q, want free or orphaned", st)
		}
	})
}

func TestCallerChosenIDNeedsTaskHeaders(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		res, err := e.submit("mine", "m", asynq.TaskID("my-id"))
		if hasHeaders() {
			if err != nil || res.TaskID != "my-id" {
				t.Fatalf("with task headers: %v, %v; want my-id created", res, err)
			}
			return
		}
		if !errors.Is(err, dedup.ErrInvalidOption) || !strings.Contains(err.Error(), "my-id") {
			t.Fatalf("without task headers: %v, %v; want ErrInvalidOption naming the ID", res, err)
		}
		if !e.free("mine", "m") {
			t.Fatal("the refused call left a lock")
		}
		if _, err := e.insp.GetTaskInfo(e.q, "my-id"); !errors.Is(err, asynq.ErrTaskNotFound) && !errors.Is(err, asynq.ErrQueueNotFound) {
			t.Fatalf("the refused call stored its task: %v", err)
		}
		e.mustSubmit(dedup.Created, "mine", "m") // under an ID of the package's
	})
}

func TestHeadersOptionIsReportedWhereTaskHeadersAreMissing(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		res := e.mustSubmit(dedup.Created, "traced", "t", dedup.Headers(map[string]string{"traceparent": "00-1"}))
		dropped := slices.Contains(res.NotApplied, "dedup.Headers(…)")
		if dropped == hasHeaders() {
			t.Fatalf("task headers %v: NotApplied %q", hasHeaders(), res.NotApplied)
		}
	})
}

func TestArchivedTaskHealedOverDoesNotRunBesideTheNewHolderWhenRunByHand(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		a := e.mustSubmit(dedup.Created, "job", "j", asynq.MaxRetry(0))
		r := newRuns()
		started, release := make(chan string, 4), make(chan struct{})
		e.serve(func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			r.enter(id)
			defer r.exit(id)
			started <- id
			if id == a.TaskID {
				return errors.New("fails for good")
			}
			<-release
			return nil
		})
		redistest.WaitFor(t, started, "the first task's run")
		redistest.Eventually(t, "the first task is archived", func() bool {
			ti, err := e.insp.GetTaskInfo(e.q, a.TaskID)
			return err == nil && ti.State == asynq.TaskStateArchived
		})
		var b dedup.Result
		redistest.Eventually(t, "the key's next enqueue takes it", func() bool {
			res, err := e.submit("job", "j")
			b = res
			return err == nil && res.Outcome == dedup.Created
		})
		if got := redistest.WaitFor(t, started, "the new holder's run"); got != b.TaskID {
			t.Fatalf("ran %s, want the new holder %s", got, b.TaskID)
		}
		busy := e.d.Stats().Busy
		if err := e.insp.RunTask(e.q, a.TaskID); err != nil {
			t.Fatal(err)
		}
		redistest.Eventually(t, "the archived task meets the key busy", func() bool { return e.d.Stats().Busy > busy })
		// On its last attempt it left a copy, due later: run it now.
		copies, err := e.insp.ListScheduledTasks(e.q)
		if err != nil || len(copies) != 1 {
			t.Fatalf("scheduled: %v, %v; want the busy task's copy", copies, err)
		}
		if err := e.insp.RunTask(e.q, copies[0].ID); err != nil {
			t.Fatal(err)
		}
		redistest.Eventually(t, "its copy meets the key busy too", func() bool { return e.d.Stats().Busy > busy+1 })
		close(release)
		if r.most() != 1 {
			t.Fatalf("%d runs of one key at once", r.most())
		}
	})
}

// (The Scheduler enqueues through NewClient: one run is enough.)
func TestSchedulerReplicasEnqueueEachFiringOnce(t *testing.T) {
	t.Parallel()
	redistest.NeedReal(t)
	func(t *testing.T, e *env) {
		type enq struct {
			id  string
			dup *dedup.DuplicateTaskError
		}
		got := make(chan enq, 64)
		for range 2 {
			s := dedup.NewScheduler(e.d, &dedup.SchedulerOpts{Logger: redistest.QuietLogger(), PostEnqueueFunc: func(info *asynq.TaskInfo, err error) {
				var dup *dedup.DuplicateTaskError
				switch {
				case errors.As(err, &dup):
					got <- enq{dup: dup}
				case err == nil:
					got <- enq{id: info.ID}
				default:
					t.Errorf("firing: %v", err)
				}
			}})
			if _, err := s.Register("@every 1s", asynq.NewTask("tick", nil), asynq.Queue(e.q)); err != nil {
				t.Fatal(err)
			}
			if err := s.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Shutdown)
		}
		r := newRuns()
		e.serve(func(ctx context.Context, _ *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			r.enter(id)
			r.exit(id)
			return nil
		})
		created := map[string]bool{}
		var dups []*dedup.DuplicateTaskError
		for len(created) < 2 || len(dups) < 2 {
			g := redistest.WaitFor(t, got, "a firing")
			if g.dup != nil {
				dups = append(dups, g.dup)
			} else {
				created[g.id] = true
			}
		}
		for _, dup := range dups { // (the other replica's enqueue of the same firing)
			redistest.Eventually(t, "the duplicate's holder is a firing's task", func() bool {
				select {
				case g := <-got:
					if g.id != "" {
						created[g.id] = true
					}
				default:
				}
				return created[dup.Holder]
			})
		}
		for range 2 {
			redistest.WaitFor(t, r.ran, "a firing's run")
		}
		seen := map[string]int{}
		for _, id := range r.seen() {
			if seen[id]++; seen[id] > 1 || !created[id] {
				t.Fatalf("ran %s (%d times), created %v", id, seen[id], created)
			}
		}
	}(t, newEnv(t, "NewClient", nil))
}

func TestBatchAnswersEachTaskAsSubmitWould(t *testing.T) {
	eachClient(t, nil, func(t *testing.T, e *env) {
		tasks := []*asynq.Task{
			asynq.NewTask("b", []byte("1")), asynq.NewTask("b", []byte("2")), asynq.NewTask("b", []byte("1")),
			asynq.NewTask("b", []byte("3"), asynq.TaskID("caller-id")),
		}
		res := e.c.EnqueueBatch(context.Background(), tasks, asynq.Queue(e.q))
		var dup *dedup.DuplicateTaskError
		switch {
		case res[0].Err != nil || res[1].Err != nil || res[0].Outcome != dedup.Created || res[1].Outcome != dedup.Created:
			t.Fatalf("new keys: %+v, %+v", res[0], res[1])
		case !errors.As(res[2].Err, &dup) || dup.Holder != res[0].TaskID:
			t.Fatalf("the batch's duplicate: %+v, want refused naming %s", res[2], res[0].TaskID)
		case hasHeaders() && res[3].Err != nil:
			t.Fatalf("a caller-chosen ID with task headers: %v", res[3].Err)
		case !hasHeaders() && !errors.Is(res[3].Err, dedup.ErrInvalidOption):
			t.Fatalf("a caller-chosen ID without task headers: %+v, want ErrInvalidOption", res[3])
		}
		r := e.serveRecording()
		want := 2
		if hasHeaders() {
			want = 3
		}
		for range want {
			redistest.WaitFor(t, r.ran, "a run")
		}
		redistest.Eventually(t, "the keys are free", func() bool { return e.free("b", "1") && e.free("b", "2") })
		if !hasHeaders() && !e.free("b", "3") {
			t.Fatal("the refused task left a lock")
		}
	})
}
