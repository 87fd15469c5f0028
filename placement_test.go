package dedup

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// Placement (placement.go): whether the tasks a WrapClient's enqueuer, or a
// server's, stores live in the Dedup's Redis. Tasks elsewhere get
// ErrTasksElsewhere, as their locks could not be checked against them.

// hookEnqueuer is a user's decorator over an asynq client: it calls before
// just ahead of handing the task on, and after once asynq has stored it.
type hookEnqueuer struct {
	next          Enqueuer
	before, after func(ctx context.Context, info *asynq.TaskInfo)
}

func (e hookEnqueuer) Enqueue(t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	return e.EnqueueContext(context.Background(), t, o...)
}

func (e hookEnqueuer) EnqueueContext(ctx context.Context, t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	if e.before != nil {
		e.before(ctx, nil)
	}
	info, err := e.next.EnqueueContext(ctx, t, o...)
	if err == nil && e.after != nil {
		e.after(ctx, info)
	}
	return info, err
}

// README: "the first accepted enqueue checks where its task is; if it is
// elsewhere, ... every later deduplicated call fails with ErrTasksElsewhere";
// failure modes: "never a duplicate admitted by a healed lock". A WrapClient
// over another Redis is refused even when the Dedup's Redis knows the queue
// (here its own NewClient used it, as during a migration between two Redis),
// and a lock of its aged past HealGrace admits no duplicate. (Once, a known
// queue made the missing task "undecided", and after 64 such enqueues the
// client was taken for "here": never refused, its locks healed, duplicates
// admitted.)
func TestPlacementRefusesAWrapClientOnAnotherRedisWhenTheQueueIsKnownHere(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, Config{})
	// The Dedup's Redis knows the queue: the Dedup's own client used it.
	if _, err := h.d.NewClient().Enqueue(userTask(99, "x"), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	_, other := ownRedis(t, nil)
	c := h.d.WrapClient(asynq.NewClientFromRedisClient(other))
	if _, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("first enqueue (stored elsewhere, still locked): %v", err)
	}
	if _, err := c.Enqueue(userTask(2, ""), asynq.Queue(h.queue)); !errors.Is(err, ErrTasksElsewhere) {
		t.Errorf("second deduplicated call: err = %v, want ErrTasksElsewhere", err)
	}
	// The harm: once the lock is older than HealGrace its owner, looked up
	// in the Dedup's Redis, is "gone", and the key is taken again.
	h.ageLock(h.keyOf(userTask(1, ""), h.queue))
	if info, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err == nil {
		t.Errorf("duplicate of user 1 admitted as %s: its first task is still pending in the other Redis", info.ID)
	}
	n, _ := other.LLen(context.Background(), "asynq:{"+h.queue+"}:pending").Result()
	t.Logf("tasks pending in the other Redis: %d", n)
}

// README: "A server whose tasks are not in the Dedup's Redis gets the same
// error from the middleware for every task, and runs none". The decision is
// the server's, not the Dedup's: one Dedup whose middleware ran a task of a
// server on its own Redis still refuses the tasks of a second server on
// another Redis (queues sharded over two Redis, one Dedup) with
// ErrTasksElsewhere. Otherwise their locks' owner checks read the wrong
// Redis, and a second task of a key runs beside the first once the lock is
// older than HealGrace.
func TestPlacementRefusesASecondServerOnAnotherRedisOfASharedDedup(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, Config{})
	rcA := newRecorder(nil)
	h.serve(rcA.handler(), nil)
	h.enqueue(userTask(100, ""))
	waitFor(t, rcA.runs, "a task on the Dedup's own Redis")

	_, other := ownRedis(t, nil)
	qB := h.queue + "-b"
	release := make(chan struct{})
	var (
		mu              sync.Mutex
		running, maxRun int
	)
	runs, errs := make(chan string, 10), make(chan error, 100)
	srv := asynq.NewServerFromRedisClient(other, asynq.Config{
		Concurrency: 10, Queues: map[string]int{qB: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure, ShutdownTimeout: 5 * time.Second,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			select {
			case errs <- err:
			default:
			}
		}),
	})
	if err := srv.Start(h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		running++
		maxRun = max(maxRun, running)
		mu.Unlock()
		runs <- id
		<-release
		mu.Lock()
		running--
		mu.Unlock()
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	t.Cleanup(func() { close(release) })

	ac := asynq.NewClientFromRedisClient(other)
	t.Cleanup(func() { _ = ac.Close() })
	if _, err := ac.Enqueue(userTask(1, ""), asynq.Queue(qB)); err != nil {
		t.Fatal(err)
	}
	var first string
	select {
	case err := <-errs:
		if !errors.Is(err, ErrTasksElsewhere) {
			t.Fatalf("task refused with %v, want ErrTasksElsewhere", err)
		}
		return // as promised
	case first = <-runs:
		t.Errorf("task %s of a server whose tasks are not in the Dedup's Redis ran under the middleware, want ErrTasksElsewhere", first)
	case <-time.After(10 * time.Second):
		t.Fatal("the task neither ran nor was refused")
	}

	h.ageLock(h.keyOf(userTask(1, ""), qB)) // as after HealGrace
	if _, err := ac.Enqueue(userTask(1, ""), asynq.Queue(qB)); err != nil {
		t.Fatal(err)
	}
	select {
	case second := <-runs:
		mu.Lock()
		t.Errorf("task %s of the same key ran while %s still runs (%d at once)", second, first, maxRun)
		mu.Unlock()
	case <-time.After(3 * time.Second): // the second task is retried every 50 ms while busy
	}
}

// A same-Redis WrapClient whose first task is run and deleted (Retention 0)
// before the placement check reads it: the queue is known in asynq:queues,
// so the check stays undecided and nothing is refused.
func TestPlacementCheckAfterAFastWorkerRefusesNothing(t *testing.T) {
	h := newHarness(t, Config{})
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	c := h.d.WrapClient(hookEnqueuer{next: h.asynq, after: func(_ context.Context, info *asynq.TaskInfo) {
		eventually(t, "task run and deleted", func() bool {
			_, err := h.insp.GetTaskInfo(info.Queue, info.ID)
			return errors.Is(err, asynq.ErrTaskNotFound)
		})
	}})
	for i := range 3 {
		if _, err := c.Enqueue(userTask(i, ""), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
}

// asynq's client registers a queue in asynq:queues once per client, not per
// enqueue. If the set loses the queue while a long-lived asynq client lives
// on (an operator deletes the empty queue in asynqmon; Redis restarted
// without persistence), a WrapClient over that client, on the Dedup's own
// Redis, whose first task is run and deleted before the check (a fast
// worker, Retention 0), is still not judged "elsewhere": its later calls are
// accepted.
func TestPlacementOnTheSameRedisSurvivesAForgottenQueue(t *testing.T) {
	h := newHarness(t, Config{})
	if _, err := h.asynq.Enqueue(asynq.NewTask("warmup", nil), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err) // the long-lived asynq client has published the queue
	}
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	waitFor(t, rc.runs, "warm-up task")
	eventually(t, "queue empty", func() bool { return h.insp.DeleteQueue(h.queue, false) == nil })
	c := h.d.WrapClient(hookEnqueuer{next: h.asynq, after: func(_ context.Context, info *asynq.TaskInfo) {
		waitFor(t, rc.runs, "first task")
		eventually(t, "task deleted", func() bool {
			return h.rdb.Exists(context.Background(), asynqTaskKeyPrefix(info.Queue)+info.ID).Val() == 0
		})
	}})
	if _, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("first enqueue: %v", err)
	}
	if _, err := c.Enqueue(userTask(2, ""), asynq.Queue(h.queue)); err != nil {
		t.Errorf("a WrapClient on the Dedup's own Redis refused: %v", err)
	}
}
