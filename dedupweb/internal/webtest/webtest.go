// Package webtest builds the world the dedupweb tests (and its browser
// tests, a module of their own) look at: a private key prefix and queues on
// the shared redis-server of internal/redistest, a Dedup with its wrapped
// client, locks in every state through a real asynq server with the
// middleware, and the handler served on 127.0.0.1.
package webtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupweb"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Types the world's server handles, each its own way.
const (
	TypeBlock = "job:block" // runs until the test ends: its lock is running
	TypeFail  = "job:fail"  // fails, and waits an hour for its retry: retry-wait
	TypeCool  = "job:cool"  // succeeds under a one-hour Cooldown: cooling
)

// World is one test's private keys and queues, its Dedup and client.
type World struct {
	T      testing.TB
	RDB    *redis.Client
	D      *dedup.Dedup
	Client *dedup.Client
	Insp   *asynq.Inspector
	Prefix string
	QA, QB string // QB is the queue the server works
}

// New makes a world on the shared redis-server; the test skips without one
// (fails under DEDUP_REQUIRE_REDIS, see redistest.Main).
func New(t testing.TB) *World {
	t.Helper()
	redistest.NeedReal(t)
	rdb := redistest.Client(t)
	id := randHex(4)
	w := &World{T: t, RDB: rdb, Insp: asynq.NewInspectorFromRedisClient(rdb), Prefix: "web-" + id, QA: "qa-" + id, QB: "qb-" + id}
	d, err := dedup.New(context.Background(), rdb, dedup.Config{Prefix: w.Prefix, Logger: redistest.QuietLogger(),
		Rules: map[string]dedup.Rule{TypeCool: {Fields: []string{"user_id"}, Cooldown: time.Hour}}})
	if err != nil {
		t.Fatalf("dedup.New: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	w.D, w.Client = d, d.WrapClient(asynq.NewClientFromRedisClient(rdb))
	return w
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Enqueue enqueues a task of typ keyed on its payload's user_id.
func (w *World) Enqueue(queue, typ string, user int, opts ...asynq.Option) *asynq.TaskInfo {
	w.T.Helper()
	payload := fmt.Sprintf(`{"user_id":%d,"email":"user%d@example.com"}`, user, user)
	opts = append([]asynq.Option{asynq.Queue(queue), dedup.Fields("user_id")}, opts...)
	info, err := w.Client.Enqueue(asynq.NewTask(typ, []byte(payload)), opts...)
	if err != nil {
		w.T.Fatalf("enqueue %s %d in %s: %v", typ, user, queue, err)
	}
	return info
}

// LockOf is the lock key of a task enqueued through the wrapper.
func (w *World) LockOf(info *asynq.TaskInfo) string {
	w.T.Helper()
	lock, _, err := store.TaskLockOf(context.Background(), w.RDB, info.Queue, info.ID)
	if err != nil || lock == "" {
		w.T.Fatalf("task %s names no lock: %v", info.ID, err)
	}
	return lock
}

// Exists reports whether a key exists.
func (w *World) Exists(key string) bool {
	w.T.Helper()
	n, err := w.RDB.Exists(context.Background(), key).Result()
	if err != nil {
		w.T.Fatal(err)
	}
	return n == 1
}

// Orphan deletes a task's asynq record: its lock is orphaned.
func (w *World) Orphan(info *asynq.TaskInfo) {
	w.T.Helper()
	if err := w.Insp.DeleteTask(info.Queue, info.ID); err != nil {
		w.T.Fatal(err)
	}
}

// States holds one lock in each state the server makes: running,
// retry-wait and cooling, in queue QB.
type States struct{ Running, RetryWait, Cooling *asynq.TaskInfo }

// StartServer runs an asynq server with the middleware on QB, and returns
// once it holds a running, a retry-wait and a cooling lock. It stops when
// the test ends.
func (w *World) StartServer() States {
	w.T.Helper()
	started, failed, done := make(chan string, 8), make(chan string, 8), make(chan string, 8)
	release := make(chan struct{})
	mux := asynq.NewServeMux()
	mux.Use(w.D.Middleware())
	mux.HandleFunc(TypeBlock, func(ctx context.Context, t *asynq.Task) error {
		started <- t.Type()
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	})
	mux.HandleFunc(TypeFail, func(context.Context, *asynq.Task) error {
		failed <- TypeFail
		return errors.New("smtp: 421 try again later")
	})
	mux.HandleFunc(TypeCool, func(context.Context, *asynq.Task) error { done <- TypeCool; return nil })
	srv := asynq.NewServerFromRedisClient(w.RDB, asynq.Config{Concurrency: 4, Queues: map[string]int{w.QB: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second,
		IsFailure: dedup.IsFailure, RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
	var s States
	s.Running, s.RetryWait, s.Cooling = w.Enqueue(w.QB, TypeBlock, 1), w.Enqueue(w.QB, TypeFail, 2), w.Enqueue(w.QB, TypeCool, 3)
	if err := srv.Start(mux); err != nil {
		w.T.Fatalf("asynq server: %v", err)
	}
	var once sync.Once
	w.T.Cleanup(func() { once.Do(func() { close(release); srv.Shutdown() }) })
	redistest.WaitFor(w.T, started, "the blocking task to start")
	redistest.WaitFor(w.T, failed, "the failing task to run")
	redistest.WaitFor(w.T, done, "the cooling task to run")
	w.awaitState(s.Running, store.LockRunning)
	w.awaitState(s.RetryWait, store.LockRetryWait)
	w.awaitState(s.Cooling, store.LockCooling)
	return s
}

// Populate makes one lock in every state and counters to draw: two
// waiting and one orphaned email:welcome locks in QA, the server's locks in
// QB (StartServer), and a flush of the counters.
func (w *World) Populate() States {
	w.T.Helper()
	w.Enqueue(w.QA, "email:welcome", 1)
	w.Enqueue(w.QA, "email:welcome", 2)
	w.Orphan(w.Enqueue(w.QA, "email:welcome", 3))
	s := w.StartServer()
	if err := w.D.FlushStats(context.Background()); err != nil {
		w.T.Fatal(err)
	}
	return s
}

// awaitState waits until the task's lock is in state: the middleware and
// asynq write it after the handler returns, which signals nothing.
func (w *World) awaitState(info *asynq.TaskInfo, state string) {
	w.T.Helper()
	key := w.LockOf(info)
	redistest.Eventually(w.T, key+" is "+state, func() bool {
		ls, err := store.ReadLocks(context.Background(), w.RDB, store.NewKeys(w.Prefix), []string{key})
		return err == nil && len(ls) == 1 && ls[0].State() == state
	})
}

// Serve serves a dedupweb handler of the world's prefix on 127.0.0.1;
// opts.Prefix is set to the world's.
func (w *World) Serve(opts dedupweb.Options) *httptest.Server {
	opts.Prefix = w.Prefix
	if opts.Logger == nil {
		opts.Logger = redistest.QuietLogger()
	}
	srv := httptest.NewServer(dedupweb.New(w.RDB, opts))
	w.T.Cleanup(srv.Close)
	return srv
}
