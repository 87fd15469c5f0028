package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// testConfig is a Store's configuration for the tests, under a key prefix
// of the test's own.
func testConfig(t testing.TB) Config {
	return Config{
		Prefix: "st-" + redistest.Uniq(t), LockTimeout: 5 * time.Second, HealGrace: time.Minute,
		MaxBatch: 64, BreakerThreshold: -1, BreakerWait: func(int) time.Duration { return time.Second },
		ErrCircuitOpen: context.DeadlineExceeded, Logger: redistest.QuietLogger(),
	}
}

// newTestStore returns a Store with its own key prefix on rdb, closed when
// the test ends.
func newTestStore(t testing.TB, rdb redis.UniversalClient) *Store {
	t.Helper()
	s := New(rdb, testConfig(t))
	t.Cleanup(func() { s.Close(rdb) })
	return s
}

// ref is the Ref of task id under the key fp of queue q, of type "t".
func (s *Store) ref(q, fp, id string) Ref {
	return Ref{Queue: q, FP: fp, ID: id, Type: "t", Lock: s.keys.Lock(q, fp)}
}

// wrapAcquire is an enqueue through asynq's client (WrapClient's path): a
// plain rejection whose lock is taken before its task is stored.
func wrapAcquire(s *Store, q, fp string, at time.Time) *Acquire {
	id := NewPlainID()
	return &Acquire{Ref: s.ref(q, fp, id), OnWaiting: FoldReject, TTL: time.Hour, Now: at, Value: WrapValue(id, at)}
}

// directAcquire is NewClient's direct path: the lock is taken with its
// task, whose record (and message) names the lock as its unique key.
func directAcquire(s *Store, q, fp string, fold Fold, payload string) *Acquire {
	id := NewPlainID()
	r := s.ref(q, fp, id)
	return &Acquire{Ref: r, OnWaiting: fold, TTL: time.Hour, Now: time.Now(), Value: Value(id), Payload: []byte(payload),
		Direct: true, Unique: true, Message: testMessage(r, payload)}
}

// testMessage is the message the direct path stores for r's task.
func testMessage(r Ref, payload string) Message {
	return Message{Type: r.Type, Payload: []byte(payload), ID: r.ID, Queue: r.Queue, Retry: 25, Timeout: time.Minute, UniqueKey: r.Lock}
}

// mustAcquire runs a, failing the test on an error.
func mustAcquire(t testing.TB, s *Store, a *Acquire) AcquireResult {
	t.Helper()
	res, err := s.Acquire(context.Background(), a)
	if err != nil {
		t.Fatalf("acquire %s: %v", a.Ref.ID, err)
	}
	return res
}

// putTask writes asynq's record of task id of queue q in state (none for
// ""), of type "t", and puts it where the state says.
func putTask(rdb redis.Cmdable, q, id, state string) {
	ctx := context.Background()
	if state == "" {
		return
	}
	m := &Message{Type: "t", Payload: []byte(`{"p":"` + id + `"}`), ID: id, Queue: q, Retry: 25, Timeout: time.Minute}
	rdb.HSet(ctx, TaskKey(q, id), "msg", m.Encode(), "state", state)
	switch state {
	case StatePending:
		rdb.HSet(ctx, TaskKey(q, id), "pending_since", time.Now().UnixNano())
		rdb.LPush(ctx, PendingKey(q), id)
	case StateActive:
		rdb.LPush(ctx, ActiveKey(q), id)
	case StateScheduled:
		rdb.ZAdd(ctx, ScheduledKey(q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: id})
	case StateRetry:
		rdb.ZAdd(ctx, RetryKey(q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: id})
	}
}

// near reports whether d is within tol of want.
func near(d, want, tol time.Duration) bool { return d >= want-tol && d <= want+tol }
