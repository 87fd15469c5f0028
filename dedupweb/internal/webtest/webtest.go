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
	"maps"
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

	locks sync.Map // task ID → the lock key its enqueue took, or was folded into
}

// New makes a world on the shared redis-server; the test skips without one
// (fails under DEDUP_REQUIRE_REDIS, see redistest.Main).
func New(t testing.TB) *World {
	t.Helper()
	return NewWithRules(t, nil)
}

// NewWithRules is New whose Dedup has rules beside TypeCool's.
func NewWithRules(t testing.TB, rules map[string]dedup.Rule) *World {
	t.Helper()
	redistest.NeedReal(t)
	rdb := redistest.Client(t)
	id := randHex(4)
	w := &World{T: t, RDB: rdb, Insp: asynq.NewInspectorFromRedisClient(rdb), Prefix: "web-" + id, QA: "qa-" + id, QB: "qb-" + id}
	all := map[string]dedup.Rule{TypeCool: {Fields: []string{"user_id"}, Cooldown: time.Hour}}
	maps.Copy(all, rules)
	d, err := dedup.New(context.Background(), rdb, dedup.Config{Prefix: w.Prefix, Logger: redistest.QuietLogger(), Rules: all})
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
	res, err := w.Client.Submit(context.Background(), asynq.NewTask(typ, []byte(payload)), opts...)
	if err != nil {
		w.T.Fatalf("enqueue %s %d in %s: %v", typ, user, queue, err)
	}
	w.locks.Store(res.Info.ID, store.NewKeys(w.Prefix).Lock(res.Info.Queue, res.Fingerprint))
	return res.Info
}

// LockOf is the lock key of a task: the one Enqueue took for it (whatever
// became of the task since), else the one its asynq record names.
func (w *World) LockOf(info *asynq.TaskInfo) string {
	w.T.Helper()
	if lock, ok := w.locks.Load(info.ID); ok {
		return lock.(string)
	}
	lock, _, err := store.TaskLockOf(context.Background(), w.RDB, info.Queue, info.ID)
	if err != nil || lock == "" {
		w.T.Fatalf("task %s names no lock: %v", info.ID, err)
	}
	w.locks.Store(info.ID, lock)
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

// Orphan deletes a task's asynq record through the Inspector. A lock
// WrapClient took names its task, which asynq's client stored next, so it
// stays: orphaned, though for the heal grace (and a minute, as the lock's state
// says) its task might not be stored yet.
func (w *World) Orphan(info *asynq.TaskInfo) {
	w.T.Helper()
	if err := w.Insp.DeleteTask(info.Queue, info.ID); err != nil {
		w.T.Fatal(err)
	}
}

// Orphaned enqueues a task of typ keyed on its payload's user_id through
// NewClient (its lock's value is its ID, stored with it), then makes it
// vanish as asynq never learns (a lost queue, DeleteAllPendingTasks): its
// lock is orphaned at once, and a plain lock keeps no type of its own.
func (w *World) Orphaned(queue, typ string, user int) *asynq.TaskInfo {
	w.T.Helper()
	ctx := context.Background()
	payload := fmt.Sprintf(`{"user_id":%d,"email":"user%d@example.com"}`, user, user)
	res, err := w.D.NewClient().Submit(ctx, asynq.NewTask(typ, []byte(payload)), asynq.Queue(queue), dedup.Fields("user_id"))
	if err != nil {
		w.T.Fatalf("enqueue %s %d in %s: %v", typ, user, queue, err)
	}
	id := res.Info.ID
	w.locks.Store(id, store.NewKeys(w.Prefix).Lock(queue, res.Fingerprint))
	if err := w.RDB.Del(ctx, store.TaskKey(queue, id)).Err(); err != nil {
		w.T.Fatal(err)
	}
	if err := w.RDB.LRem(ctx, store.PendingKey(queue), 0, id).Err(); err != nil {
		w.T.Fatal(err)
	}
	return res.Info
}

// PastTheSecond waits until the lock WrapClient took for info is more than
// a second old: releasing what the doctor found (store.ReleaseStuck) leaves
// a lock taken before its task was stored alone for at least a second,
// whatever the doctor's grace.
func (w *World) PastTheSecond(info *asynq.TaskInfo) {
	w.T.Helper()
	v, err := w.RDB.Get(context.Background(), w.LockOf(info)).Result()
	if err != nil {
		w.T.Fatal(err)
	}
	if p := store.ParseValue(v); p.Kind == store.HoldWrap {
		time.Sleep(time.Until(p.At.Add(time.Second + 10*time.Millisecond)))
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
// waiting email:welcome locks in QA and one orphaned (Orphaned: its type
// unknown), the server's locks in QB (StartServer), and a flush of the
// counters.
func (w *World) Populate() States {
	w.T.Helper()
	w.Enqueue(w.QA, "email:welcome", 1)
	w.Enqueue(w.QA, "email:welcome", 2)
	w.Orphaned(w.QA, "email:welcome", 3)
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

// TypeFailHard fails for good (asynq.SkipRetry) under a fail hold that
// lasts until released (Holds).
const TypeFailHard = "job:fail-hard"

// Holds are locks a policy keeps past their task, whose holders cannot
// run: what "release what the doctor found" must leave alone.
type Holds struct {
	Cooling    string   // TypeCool's key: it succeeded under a one-hour Cooldown, its record gone
	Failed     string   // TypeFailHard's key: a fail hold (FailHoldUntilReleased), its holder archived
	FailedGone string   // the same, its archived holder since deleted by an operator
	Firings    []string // Scheduler firings' keys, their tasks deleted
}

// MakeHolds makes the Holds in a queue of their own, through a real asynq
// server with the middleware and a Scheduler, and returns them once each
// is in its state.
func (w *World) MakeHolds() Holds {
	w.T.Helper()
	q := w.QA + "-holds"
	cool := w.Enqueue(q, TypeCool, 1)
	failed := w.Enqueue(q, TypeFailHard, 2, dedup.OnFailure(dedup.FailHoldUntilReleased, 0))
	gone := w.Enqueue(q, TypeFailHard, 3, dedup.OnFailure(dedup.FailHoldUntilReleased, 0))
	mux := asynq.NewServeMux()
	mux.Use(w.D.Middleware())
	mux.HandleFunc(TypeCool, func(context.Context, *asynq.Task) error { return nil })
	mux.HandleFunc(TypeFailHard, func(context.Context, *asynq.Task) error {
		return fmt.Errorf("smtp: 550 no such user: %w", asynq.SkipRetry)
	})
	srv := asynq.NewServerFromRedisClient(w.RDB, asynq.Config{Concurrency: 4, Queues: map[string]int{q: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: dedup.IsFailure})
	if err := srv.Start(mux); err != nil {
		w.T.Fatalf("asynq server: %v", err)
	}
	w.awaitState(cool, store.LockCooling)
	w.awaitState(failed, store.LockFailed)
	w.awaitState(gone, store.LockFailed)
	srv.Shutdown()
	if err := w.Insp.DeleteTask(q, gone.ID); err != nil {
		w.T.Fatal(err)
	}
	h := Holds{Cooling: w.LockOf(cool), Failed: w.LockOf(failed), FailedGone: w.LockOf(gone), Firings: w.firings(q)}
	w.awaitState(gone, store.LockFailed)
	return h
}

// firings runs a Scheduler entry in queue until it fired, deletes the
// tasks it enqueued, and returns the keys of its firings, which a firing's
// window holds whatever its task does.
func (w *World) firings(queue string) []string {
	w.T.Helper()
	ctx := context.Background()
	s := dedup.NewScheduler(w.D, nil)
	if _, err := s.Register("@every 1s", asynq.NewTask("job:tick", nil), asynq.Queue(queue)); err != nil {
		w.T.Fatal(err)
	}
	if err := s.Start(); err != nil {
		w.T.Fatal(err)
	}
	var keys []string
	redistest.Eventually(w.T, "a Scheduler firing", func() bool {
		keys = w.keysHeldAs(queue, store.HoldFiring)
		return len(keys) > 0
	})
	s.Shutdown()
	keys = w.keysHeldAs(queue, store.HoldFiring)
	for _, k := range keys {
		v, err := w.RDB.Get(ctx, k).Result()
		if err != nil {
			w.T.Fatal(err)
		}
		if err := w.Insp.DeleteTask(queue, store.ParseValue(v).Holder); err != nil {
			w.T.Fatal(err)
		}
	}
	return keys
}

// keysHeldAs lists the locks of queue whose value is of kind.
func (w *World) keysHeldAs(queue string, kind store.Hold) []string {
	w.T.Helper()
	ctx := context.Background()
	all, err := w.RDB.Keys(ctx, store.NewKeys(w.Prefix).LockPattern(queue)).Result()
	if err != nil {
		w.T.Fatal(err)
	}
	var out []string
	for _, k := range all {
		if v, err := w.RDB.Get(ctx, k).Result(); err == nil && store.ParseValue(v).Kind == kind {
			out = append(out, k)
		}
	}
	return out
}

// Values reads the values of keys ("" for a key that is gone).
func (w *World) Values(keys ...string) []string {
	w.T.Helper()
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i], _ = w.RDB.Get(context.Background(), k).Result()
	}
	return out
}
