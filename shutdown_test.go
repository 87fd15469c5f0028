package dedup

import (
	"context"
	"testing"

	"github.com/hibiken/asynq"
	"go.uber.org/goleak"
)

// A server with the middleware shuts down cleanly: handlers finish, the
// heartbeat stops, Close flushes, and no goroutine is left behind.
func TestGracefulShutdownLeaksNothing(t *testing.T) {
	needRealRedis(t) // miniredis serves connections with goroutines of its own
	rdb := newRDB(t)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	h := newHarnessOn(t, rdb, Config{})
	if err := h.d.StartFlusher(0); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	started := make(chan struct{}, 10)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 4, Queues: map[string]int{h.queue: 1}, LogLevel: asynq.FatalLevel})
	if err := srv.Start(h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		started <- struct{}{}
		<-release
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		h.enqueue(userTask(i, ""))
	}
	for range 3 {
		waitFor(t, started, "handlers running")
	}
	close(release)
	srv.Shutdown()
	if err := h.d.Close(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "locks released", func() bool { return len(h.locks()) == 0 })
	if s := h.d.Stats(); s.Released != 3 || s.LockLost != 0 {
		t.Fatalf("stats %+v", s)
	}
}
