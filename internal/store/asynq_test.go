package store

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// What the design relies on of asynq v0.26.0's own server: a task the
// direct path stored with its lock (take.lua) is run by a real asynq
// server, whose own scripts then decide the lock's fate.

type quietAsynq struct{}

func (quietAsynq) Debug(...any) {}
func (quietAsynq) Info(...any)  {}
func (quietAsynq) Warn(...any)  {}
func (quietAsynq) Error(...any) {}
func (quietAsynq) Fatal(...any) {}

// serve runs an asynq server over rdb for queue q with handler h until the
// test ends.
func serve(t *testing.T, rdb redis.UniversalClient, q string, h asynq.HandlerFunc) {
	t.Helper()
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Queues: map[string]int{q: 1}, Concurrency: 1,
		Logger: quietAsynq{}, ShutdownTimeout: 5 * time.Second})
	if err := srv.Start(h); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
}

// enqueueDirect stores a task through take.lua's direct path, its record
// and message naming its lock as their unique key.
func enqueueDirect(t *testing.T, s *Store, q, fp string) Ref {
	t.Helper()
	a := directAcquire(s, q, fp, FoldReject, `{"n":1}`)
	if res := mustAcquire(t, s, a); res.Status != StatusTaken || !res.Stored {
		t.Fatalf("enqueue: %+v", res)
	}
	return a.Ref
}

// asynq's done script deletes the lock of a task it completes: a plain
// task's success costs the library no call.
func TestAsynqDeletesTheLockOfATaskItCompletes(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := enqueueDirect(t, s, q, "0000000000000301")
	ran := make(chan string, 1)
	serve(t, rdb, q, func(ctx context.Context, task *asynq.Task) error {
		ran <- task.ResultWriter().TaskID()
		return nil
	})
	if id := redistest.WaitFor(t, ran, "the task runs"); id != r.ID {
		t.Fatalf("ran %s, want %s", id, r.ID)
	}
	redistest.Eventually(t, "asynq marks the task done", func() bool { return rdb.Exists(ctx, TaskKey(q, r.ID)).Val() == 0 })
	if v, err := rdb.Get(ctx, r.Lock).Result(); !errors.Is(err, redis.Nil) {
		t.Fatalf("after the task's success the lock is %q (%v); want it deleted by asynq's done script", v, err)
	}
	if res := mustAcquire(t, s, directAcquire(s, q, r.FP, FoldReject, "")); res.Status != StatusTaken {
		t.Fatalf("the key's next enqueue: %+v; want taken", res)
	}
}

// A task whose handler returns SkipRetry is archived by asynq, which
// leaves its lock: the archived holder keeps the key until its next
// enqueue heals the lock at once, marking the archived task (should
// someone run it again by hand, it checks its key first).
func TestAsynqKeepsTheLockOfATaskItArchives(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := enqueueDirect(t, s, q, "0000000000000302")
	ran := make(chan struct{}, 1)
	serve(t, rdb, q, func(context.Context, *asynq.Task) error {
		ran <- struct{}{}
		return fmt.Errorf("not today: %w", asynq.SkipRetry)
	})
	redistest.WaitFor(t, ran, "the task runs")
	redistest.Eventually(t, "asynq archives the task", func() bool {
		return rdb.HGet(ctx, TaskKey(q, r.ID), "state").Val() == StateArchived
	})
	if v := rdb.Get(ctx, r.Lock).Val(); v != r.ID {
		t.Fatalf("after SkipRetry the lock is %q; want kept by the archived %s", v, r.ID)
	}
	if u := rdb.HGet(ctx, TaskKey(q, r.ID), "unique_key").Val(); u != r.Lock {
		t.Fatalf("the archived record names %q as its unique key, want the lock", u)
	}
	next := directAcquire(s, q, r.FP, FoldReject, "")
	if res := mustAcquire(t, s, next); res.Status != StatusTaken || rdb.Get(ctx, r.Lock).Val() != next.Ref.ID {
		t.Fatalf("the key's next enqueue: %+v; want the lock healed and taken", res)
	}
	if h := MessageHeaders([]byte(rdb.HGet(ctx, TaskKey(q, r.ID), "msg").Val())); h[HeaderLost] != LostHealed {
		t.Fatalf("the archived task's headers %v; want %s=%s", h, HeaderLost, LostHealed)
	}
}
