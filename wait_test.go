package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// resultHandler writes "result:<payload>" as the task's result once
// release delivers (or at once when release is nil), then returns fail.
func resultHandler(started chan<- string, release <-chan struct{}, fail error) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		if started != nil {
			id, _ := asynq.GetTaskID(ctx)
			started <- id
		}
		if release != nil {
			<-release
		}
		if fail != nil {
			return fail
		}
		_, err := t.ResultWriter().Write([]byte("result:" + string(t.Payload())))
		return err
	}
}

// duplicateOf enqueues task again and returns the duplicate's error.
func (h *harness) duplicateOf(task *asynq.Task, opts ...asynq.Option) *DuplicateTaskError {
	h.t.Helper()
	_, err := h.client.Enqueue(task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) {
		h.t.Fatalf("second enqueue: %v, want a DuplicateTaskError", err)
	}
	return dup
}

// A duplicate's caller waits for the winner and gets its result.
func TestWaitHolderReturnsWinnersResult(t *testing.T) {
	h := newHarness(t, Config{})
	started, release := make(chan string, 1), make(chan struct{})
	h.serve(resultHandler(started, release, nil), nil)
	task := userTask(1, "first")
	info := h.enqueue(task, asynq.Retention(time.Minute))
	waitFor(t, started, "winner running")
	dup := h.duplicateOf(task)
	if dup.Holder != info.ID {
		t.Fatalf("duplicate names %s, want %s", dup.Holder, info.ID)
	}
	type res struct {
		info *asynq.TaskInfo
		err  error
	}
	got := make(chan res, 1)
	go func() {
		i, err := h.d.WaitHolder(context.Background(), dup)
		got <- res{i, err}
	}()
	close(release)
	r := waitFor(t, got, "WaitHolder")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if want := "result:" + string(task.Payload()); string(r.info.Result) != want || r.info.State != asynq.TaskStateCompleted || r.info.ID != info.ID {
		t.Fatalf("info %+v, result %q; want completed %s with %q", r.info, r.info.Result, info.ID, want)
	}
	// Waiting again, after the end, returns at once.
	again, err := h.d.WaitResult(context.Background(), h.queue, info.ID)
	if err != nil || string(again.Result) != string(r.info.Result) {
		t.Fatalf("second wait: %v, %+v", err, again)
	}
}

// A caller-chosen task ID is waited for the same way.
func TestWaitResultCallerChosenID(t *testing.T) {
	h := newHarness(t, Config{})
	h.serve(resultHandler(nil, nil, nil), nil)
	id := "mine-" + uniq(t)
	h.enqueue(userTask(2, ""), asynq.TaskID(id), asynq.Retention(time.Minute))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := h.d.WaitResult(ctx, h.queue, id)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(info.Result), "result:") {
		t.Fatalf("result %q", info.Result)
	}
}

// Without retention a finished task is deleted: the wait ends, matchably,
// without a result.
func TestWaitResultWithoutRetention(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{})
	started, release := make(chan string, 1), make(chan struct{})
	h.serve(resultHandler(started, release, nil), nil)
	info := h.enqueue(userTask(3, ""))
	waitFor(t, started, "run")
	errc := make(chan error, 1)
	go func() {
		_, err := h.d.WaitResult(context.Background(), h.queue, info.ID)
		errc <- err
	}()
	close(release)
	err := waitFor(t, errc, "WaitResult")
	if !errors.Is(err, ErrResultUnavailable) || !errors.Is(err, asynq.ErrTaskNotFound) {
		t.Fatalf("err %v, want ErrResultUnavailable and asynq.ErrTaskNotFound", err)
	}
}

// A task that fails for good ends the wait with ErrTaskFailed, quoting the
// handler's error.
func TestWaitResultArchived(t *testing.T) {
	h := newHarness(t, Config{})
	h.serve(resultHandler(nil, nil, fmt.Errorf("bad input: %w", asynq.SkipRetry)), nil)
	info := h.enqueue(userTask(4, ""), asynq.Retention(time.Minute))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := h.d.WaitResult(ctx, h.queue, info.ID)
	if !errors.Is(err, ErrTaskFailed) || !strings.Contains(err.Error(), "bad input") {
		t.Fatalf("err %v, want ErrTaskFailed quoting the handler's error", err)
	}
	if got == nil || got.State != asynq.TaskStateArchived {
		t.Fatalf("info %+v, want the archived task", got)
	}
}

// The context bounds the wait.
func TestWaitResultContext(t *testing.T) {
	h := newHarness(t, Config{})
	started, release := make(chan string, 1), make(chan struct{})
	defer close(release)
	h.serve(resultHandler(started, release, nil), nil)
	info := h.enqueue(userTask(5, ""), asynq.Retention(time.Minute))
	waitFor(t, started, "run")
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	if _, err := h.d.WaitResult(ctx, h.queue, info.ID); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want context.DeadlineExceeded", err)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	if _, err := h.d.WaitResult(cctx, h.queue, info.ID); !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", err)
	}
}

// An ID that asynq does not know and no lock names ends the wait at once;
// so does a queue that does not exist. Bad arguments are refused.
//
// asynq's "not found" is Redis answering: waits for missing tasks never
// open the circuit breaker, which would fail the enqueues that follow.
func TestWaitResultUnknownTask(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	h := newHarness(t, Config{BreakerThreshold: 2})
	h.enqueue(userTask(6, "")) // the queue exists
	for _, c := range []struct{ queue, id string }{
		{h.queue, store.NewPlainID()},
		{h.queue, "no-such-task"},
		{"no-such-queue-" + uniq(t), "x"},
	} {
		_, err := h.d.WaitResult(context.Background(), c.queue, c.id)
		if !errors.Is(err, ErrResultUnavailable) {
			t.Fatalf("%s/%s: %v, want ErrResultUnavailable", c.queue, c.id, err)
		}
	}
	if _, err := h.d.WaitResult(context.Background(), "", "x"); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("blank queue: %v", err)
	}
	if _, err := h.d.WaitHolder(context.Background(), nil); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("nil dup: %v", err)
	}
	if n := h.d.Stats().BreakerOpen; n != 0 {
		t.Errorf("the breaker opened %d times while WaitResult polled for missing tasks", n)
	}
	if _, err := h.client.Enqueue(userTask(7, ""), asynq.Queue(h.queue)); err != nil {
		t.Errorf("enqueue after waits for missing tasks: %v", err)
	}
}

// Between taking the lock and asynq storing the task, the task is missing
// but its lock names it: the wait goes on until the task shows up.
func TestWaitResultTaskNotStoredYet(t *testing.T) {
	h := newHarness(t, Config{})
	h.serve(resultHandler(nil, nil, nil), nil)
	ctx := context.Background()
	task := asynq.NewTask("wait:late", []byte("late"))
	r := h.d.ruleFor(task.Type())
	fpv, err := h.d.fingerprintHex(task.Type(), task.Payload(), &r)
	if err != nil {
		t.Fatal(err)
	}
	id := store.NewPlainID()
	key := lockKeyHex(h.prefix, h.queue, fpv)
	// The lock as WrapClient leaves it just before asynq's client stores the task.
	if err := h.rdb.Set(ctx, key, store.WrapValue(id, time.Now()), time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	missing := make(chan struct{}, 100)
	type res struct {
		info *asynq.TaskInfo
		err  error
	}
	got := make(chan res, 1)
	go func() {
		i, err := h.d.waitResult(ctx, h.queue, id, key, func(s asynq.TaskState) {
			if s == 0 {
				missing <- struct{}{}
			}
		})
		got <- res{i, err}
	}()
	waitFor(t, missing, "a poll that finds the task missing but locked")
	if _, err := h.asynq.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID(id), asynq.Retention(time.Minute)); err != nil {
		t.Fatal(err)
	}
	rr := waitFor(t, got, "WaitResult")
	if rr.err != nil || string(rr.info.Result) != "result:late" {
		t.Fatalf("WaitResult: %v, %+v", rr.err, rr.info)
	}
}
