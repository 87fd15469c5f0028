package dedup

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
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

// README (Configuration): "Dedup.Close() stops the heartbeat: call it after
// srv.Shutdown()"; (Failure modes) "graceful shutdown | handlers finish,
// heartbeat stops, nothing leaks"; (Lock lifecycle) "success | released".
// Releases go out after the handler, in batches: a Close right after
// Shutdown still sends every one, counts each once, and leaves no lock.
func TestCloseRightAfterShutdownSendsEveryQueuedRelease(t *testing.T) {
	const n = 60
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	gate := make(chan struct{})
	started := make(chan string, n)
	_, stop := serveRaw(t, h.rdb, h.queue, d2.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-gate
		return nil
	})), func(c *asynq.Config) { c.Concurrency = n })
	keys := make([]string, n)
	for i := range n {
		info := h.enqueue(counterTask(fmt.Sprint("k", i), 1, i))
		requirePlainID(t, info.ID)
		keys[i] = h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
	}
	for range n {
		waitFor(t, started, "every task running")
	}
	close(gate)
	stop()
	_ = d2.Close()
	st := d2.Stats()
	if st.Started != n || st.Processed != n || st.Released != n || st.LockLost != 0 || st.RedisErrors != 0 {
		t.Errorf("stats after Shutdown and Close: %+v; want %d started, processed and released", st, n)
	}
	left := 0
	for _, k := range keys {
		left += int(h.rdb.Exists(ctx, k).Val())
	}
	if left != 0 {
		t.Errorf("%d of %d locks left after their tasks succeeded, Shutdown and Close", left, n)
	}
}

// A handler that outlives a shutdown's ShutdownTimeout goes on after asynq
// put its task back; the attempt asynq gives up marks the task's record
// (dedup-lost: outlived), so a server that takes the task at once checks
// its key, finds it held by that handler, and returns it as busy rather
// than run it beside it: with NewClient's direct path, through asynq's
// client, and for a task that arrived without a lock.
func TestShutdownRequeuedTaskNeverRunsBesideItsOwnOutlivingHandler(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"wrap", "direct", "arrival"} {
		t.Run(path, func(t *testing.T) {
			h := newHarness(t, counterRules(Rule{}))
			if path == "direct" {
				h.client = h.d.NewClient()
			}
			handler, started, finish := outlivingHandler(t, h)
			_, stop1 := serveRaw(t, h.rdb, h.queue, handler, func(c *asynq.Config) { c.ShutdownTimeout = 200 * time.Millisecond })
			id := ""
			if path == "arrival" {
				a, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue))
				if err != nil {
					t.Fatal(err)
				}
				id = a.ID
			} else {
				id = h.enqueue(counterTask("k", 1, 1)).ID
			}
			waitFor(t, started, "the first run")
			stop1()                // asynq puts the task back; its handler goes on
			if path != "arrival" { // (an arrival checks its key at every start)
				// The mark is written one round trip after asynq puts the
				// task back (lifecycle.md says so): a server that takes the
				// task within it still runs it. Past it, none does.
				eventually(t, "the put-back task is marked", func() bool { return h.storedHeaders(id)[store.HeaderLost] == store.LostOutlived })
			}
			serveRaw(t, h.rdb, h.queue, handler, nil)
			eventually(t, "the put-back task is answered", func() bool {
				return h.d.Stats().Busy >= 1 && h.taskState(id) == asynq.TaskStateRetry
			})
			select {
			case again := <-started:
				t.Fatalf("%s ran again beside its own handler, which still runs", again)
			default:
			}
			finish()
		})
	}
}

// Shutdown puts an unfinished task back even on its last attempt: the lock
// must stay.
func TestShutdownOnTheLastAttemptKeepsTheLock(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}}}})
	rc := newRecorder(func(r run) error { <-r.ctx.Done(); return r.ctx.Err() })
	srv := h.serve(rc.handler(), func(c *asynq.Config) { c.ShutdownTimeout = 200 * time.Millisecond })
	first := h.enqueue(counterTask("k", 1, 0), asynq.MaxRetry(0))
	waitFor(t, rc.runs, "run")
	srv.Shutdown()
	eventually(t, "attempt settled", func() bool { return h.d.Stats().Held == 1 })
	if st := h.taskState(first.ID); st != asynq.TaskStatePending {
		t.Fatalf("task state %v after shutdown, want pending (requeued)", st)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("err = %v, want duplicate of the requeued %s", err, first.ID)
	}
}
