package dedup

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The replica process of TestSchedulerReplicaKilledMidRunMissesNoFiring:
// the test binary run again (TestMain runs runSchedWorker instead of the
// tests when schedWorkerEnv is set), with a Scheduler of its own on its own
// Redis client, registering the same entry as the test's replicas, its
// clock skewed. It records the firings it enqueued in a Redis list: nothing
// else crosses the process boundary.

const (
	schedWorkerEnv    = "DEDUP_SCHED_WORKER" // "1" in the child
	schedAddrEnv      = "DEDUP_SCHED_ADDR"   // redis host:port
	schedPrefixEnv    = "DEDUP_SCHED_PREFIX" // dedup Prefix, also names the record key
	schedQueueEnv     = "DEDUP_SCHED_QUEUE"  // the entry's queue
	schedOffsetEnv    = "DEDUP_SCHED_OFFSET" // the clock's offset (time.Duration text)
	schedWorkerLogEnv = "DEDUP_SCHED_LOG"    // "1": log at debug level to stderr
)

func schedCreatedKey(prefix string) string { return prefix + ":sched:created" }

// runSchedWorker is the replica process.
func runSchedWorker() error {
	addr, prefix, queue := os.Getenv(schedAddrEnv), os.Getenv(schedPrefixEnv), os.Getenv(schedQueueEnv)
	offset, err := time.ParseDuration(os.Getenv(schedOffsetEnv))
	if err != nil || addr == "" || prefix == "" || queue == "" {
		return fmt.Errorf("replica environment incomplete (offset: %v)", err)
	}
	// Bounded life, in case the parent dies without killing us.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	level := slog.LevelWarn
	if os.Getenv(schedWorkerLogEnv) == "1" {
		level = slog.LevelDebug
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	d, err := New(ctx, rdb, Config{Prefix: prefix, Logger: logger})
	if err != nil {
		return fmt.Errorf("New: %w", err)
	}
	defer d.Close()
	s := NewScheduler(d, &SchedulerOpts{PostEnqueueFunc: func(info *asynq.TaskInfo, err error) {
		if err == nil {
			rdb.RPush(context.Background(), schedCreatedKey(prefix), info.Headers[schedulerFiringHeader])
		}
	}})
	s.now = func() time.Time { return time.Now().Add(offset) }
	if _, err := s.Register("@every 1s", schedTask(), asynq.Queue(queue), asynq.MaxRetry(1)); err != nil {
		return err
	}
	if err := s.Start(); err != nil {
		return err
	}
	logger.Info("scheduler replica: running", "pid", os.Getpid())
	<-ctx.Done()
	s.Shutdown()
	return nil
}

// startSchedWorker starts a replica process on h's Redis, prefix and queue.
func startSchedWorker(t *testing.T, h *harness, offset time.Duration) *faultWorker {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "replica.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close() // the child has its own descriptor
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DEDUP_REQUIRE_REDIS=") && !strings.HasPrefix(kv, "DEDUP_TEST_MINIREDIS=") {
			env = append(env, kv)
		}
	}
	addr := h.rdb.(*redis.Client).Options().Addr
	env = append(env, "DEDUP_TEST_MINIREDIS=1", schedWorkerEnv+"=1", schedAddrEnv+"="+addr,
		schedPrefixEnv+"="+h.prefix, schedQueueEnv+"="+h.queue, schedOffsetEnv+"="+offset.String())
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("start replica: %v", err)
	}
	w := &faultWorker{name: "replica", cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(w.done) }()
	t.Cleanup(func() {
		w.kill()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("replica output:\n%s", b)
		}
	})
	return w
}

// schedWorkerCreated reads the firings the replica process enqueued.
func schedWorkerCreated(h *harness) func() []string {
	return func() []string {
		return h.rdb.LRange(context.Background(), schedCreatedKey(h.prefix), 0, -1).Val()
	}
}
