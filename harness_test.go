package dedup

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// harness is one test's private world on the shared Redis: its own key
// prefix and queue, a Dedup, a wrapped client and, on demand, a server.
type harness struct {
	t      *testing.T
	rdb    redis.UniversalClient
	d      *Dedup
	client *Client
	asynq  *asynq.Client
	insp   *asynq.Inspector
	queue  string
	prefix string
}

func quietLogger() *slog.Logger { return redistest.QuietLogger() }

func newHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	return newHarnessOn(t, newRDB(t), cfg)
}

// newHarnessOn is newHarness on a given Redis client (a second process's
// view of the same Redis).
func newHarnessOn(t *testing.T, rdb redis.UniversalClient, cfg Config) *harness {
	t.Helper()
	name := uniq(t)
	if cfg.Prefix == "" {
		cfg.Prefix = "dd-" + name
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	d, err := New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ac := asynq.NewClientFromRedisClient(rdb)
	return &harness{t: t, rdb: rdb, d: d, client: d.WrapClient(ac), asynq: ac,
		insp: asynq.NewInspectorFromRedisClient(rdb), queue: "q-" + name, prefix: cfg.Prefix}
}

// serve runs an asynq server on the harness queue with the middleware,
// until the test ends.
func (h *harness) serve(handler asynq.HandlerFunc, tweak func(*asynq.Config)) *asynq.Server {
	h.t.Helper()
	cfg := asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{h.queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          5 * time.Second,
		IsFailure:                IsFailure,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(h.rdb, cfg)
	// Same as mux.Use(h.d.Middleware()) on a ServeMux, for every type.
	if err := srv.Start(h.d.Middleware()(handler)); err != nil {
		h.t.Fatalf("server start: %v", err)
	}
	var once sync.Once
	h.t.Cleanup(func() { once.Do(srv.Shutdown) })
	return srv
}

// lockOwner returns the task holding the lock at key, or "".
func (h *harness) lockOwner(key string) string {
	h.t.Helper()
	v, err := h.rdb.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		h.t.Fatalf("GET %s: %v", key, err)
	}
	return holderIn(v)
}

// locks returns the lock keys of this harness (on every master of a cluster).
func (h *harness) locks() []string {
	h.t.Helper()
	ctx := context.Background()
	var (
		mu  sync.Mutex
		out []string
	)
	scan := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, store.NewKeys(h.prefix).LockPattern(""), 1000).Iterator()
		for iter.Next(ctx) {
			mu.Lock()
			out = append(out, iter.Val())
			mu.Unlock()
		}
		return iter.Err()
	}
	var err error
	switch c := h.rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	default:
		h.t.Fatalf("locks: unsupported client %T", h.rdb)
	}
	if err != nil {
		h.t.Fatalf("scan: %v", err)
	}
	return out
}

// keyOf returns the lock key the wrapper uses for a task in queue q.
func (h *harness) keyOf(task *asynq.Task, q string, opts ...asynq.Option) string {
	h.t.Helper()
	r := h.d.ruleFor(task.Type())
	for _, o := range opts {
		if ov, ok := o.(option); ok {
			if err := ov.apply(&r); err != nil {
				h.t.Fatal(err)
			}
		}
	}
	fp, err := h.d.fingerprintHex(task.Type(), task.Payload(), &r)
	if err != nil {
		h.t.Fatal(err)
	}
	return lockKeyHex(h.prefix, q, fp)
}

func waitFor[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	return redistest.WaitFor(t, ch, what)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	redistest.Eventually(t, what, cond)
}

// payloadOf reads task id's payload from asynq.
func (h *harness) payloadOf(id string) string {
	h.t.Helper()
	ti, err := h.insp.GetTaskInfo(h.queue, id)
	if err != nil {
		h.t.Fatalf("GetTaskInfo %s: %v", id, err)
	}
	return string(ti.Payload)
}

// fpOfKey returns a lock key's fingerprint.
func fpOfKey(key string) string { return fpOfLock(key) }

// lockState returns what Lookup would say of the lock at key ("" for none).
func (h *harness) lockState(key string) string {
	h.t.Helper()
	ls, err := store.ReadLocks(context.Background(), h.rdb, store.NewKeys(h.prefix), []string{key})
	if err != nil {
		h.t.Fatal(err)
	}
	if len(ls) == 0 {
		return ""
	}
	return ls[0].State()
}
