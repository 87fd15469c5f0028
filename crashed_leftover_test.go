package dedup

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The environment of the worker process below: the redis address, the
// harness's prefix and queue.
const (
	leftoverAddrEnv   = "DEDUP_LEFTOVER_WORKER_ADDR"
	leftoverPrefixEnv = "DEDUP_LEFTOVER_WORKER_PREFIX"
	leftoverQueueEnv  = "DEDUP_LEFTOVER_WORKER_QUEUE"
)

// runLeftoverWorker is the worker process
// TestKilledWorkersLeftoverHandlerHoldsAnArchivedTasksKeyOnlyUntilItsNoteLapses
// starts (and kills): TestMain runs it instead of the tests when
// leftoverAddrEnv is set. Its handler records its start and then runs until
// the process dies, ignoring its context.
func runLeftoverWorker() error {
	addr, prefix, queue := os.Getenv(leftoverAddrEnv), os.Getenv(leftoverPrefixEnv), os.Getenv(leftoverQueueEnv)
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	d, err := New(context.Background(), rdb, Config{Prefix: prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger(), heartbeat: leftoverHeartbeat})
	if err != nil {
		return err
	}
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency: 1, Queues: map[string]int{queue: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
	})
	if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		rdb.RPush(context.Background(), prefix+":leftover:started", id)
		select {} // a handler stuck in a call that ignores its context, until SIGKILL
	}))); err != nil {
		return err
	}
	time.Sleep(time.Minute) // until killed (bounded, should the parent die first)
	return nil
}

// leftoverHeartbeat is the worker process's heartbeat: its note that a
// handler asynq gave up still runs lapses three beats after its last.
const leftoverHeartbeat = 200 * time.Millisecond

// lifecycle.md: an archived holder's key is "free: the key's next enqueue
// takes it at once"; a note that a handler asynq gave up still runs keeps
// the key from healing under the handler, renewed by the handler's
// heartbeat. A worker whose handler outlived its deadline on the last retry
// (asynq archived the task) is SIGKILLed: no handler of the key runs any
// more, and the key is free once the note lapses (three heartbeats), not
// held until its TTL (an hour).
func TestKilledWorkersLeftoverHandlerHoldsAnArchivedTasksKeyOnlyUntilItsNoteLapses(t *testing.T) {
	t.Parallel()
	needRealRedis(t)
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	kill := startStuckWorker(t, h)

	a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0), asynq.Timeout(time.Second))
	if v, err := h.rdb.BLPop(ctx, 20*time.Second, h.prefix+":leftover:started").Result(); err != nil || v[1] != a.ID {
		t.Fatalf("the worker never ran %s: %v %v", a.ID, v, err)
	}
	eventually(t, "asynq archives the task whose deadline passed on its last retry", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	eventually(t, "the outlived note is written", func() bool { return h.rdb.HExists(ctx, store.ModeOf(key), "o").Val() })
	kill() // the worker dies; its handler with it
	killed := time.Now()

	for {
		_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		switch {
		case err == nil:
			return
		case !errors.As(err, &dup):
			t.Fatal(err)
		case time.Since(killed) > 3*leftoverHeartbeat+2*time.Second:
			t.Fatalf("the key's next enqueue %v after the archived task's worker died: duplicate of %s (lock %q, %v left)",
				time.Since(killed).Round(time.Millisecond), dup.Holder, h.lockState(key), h.rdb.PTTL(ctx, key).Val())
		}
		time.Sleep(50 * time.Millisecond) // the note lapses by the clock: nothing to wait on
	}
}

// startStuckWorker starts runLeftoverWorker's process on
// h's prefix and queue, and returns a function that SIGKILLs it and waits
// until it is gone.
func startStuckWorker(t *testing.T, h *harness) (kill func()) {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "worker.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DEDUP_REQUIRE_REDIS=") {
			env = append(env, kv)
		}
	}
	env = append(env, redistest.MiniredisEnv+"=1", leftoverAddrEnv+"="+redistest.Addr(), leftoverPrefixEnv+"="+h.prefix, leftoverQueueEnv+"="+h.queue)
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.count=1", "-test.timeout=2m")
	cmd.Env, cmd.Stdout, cmd.Stderr = env, logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	kill = func() { _ = cmd.Process.Kill(); <-done }
	t.Cleanup(func() {
		kill()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("worker output:\n%s", b)
		}
	})

	return kill
}

// expireAsynqLease makes asynq's lease on task id lapse a minute ago, as it
// would 30 s after its worker died: a server started now recovers it at once.
func expireAsynqLease(t *testing.T, h *harness, id string) {
	t.Helper()
	lease := store.LeaseKey(h.queue)
	if n, err := h.rdb.ZAddXX(context.Background(), lease, redis.Z{Score: float64(time.Now().Add(-time.Minute).Unix()), Member: id}).Result(); err != nil || n != 0 {
		t.Fatalf("ZADD XX %s: %v %v", lease, n, err)
	}
	if _, err := h.rdb.ZScore(context.Background(), lease, id).Result(); err != nil {
		t.Fatalf("task %s holds no lease: %v", id, err)
	}
}

// policies.md, OnFailure: "Not held: a worker killed during the last
// attempt. The key stays with the task until asynq's recoverer archives it;
// the key's next enqueue then takes it at once." lifecycle.md: a duplicate
// enqueue meanwhile "is refused, naming it".
func TestFailHoldDoesNotHoldTheKeyOfATaskWhoseWorkerWasKilledOnItsLastAttempt(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, counterRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	kill := startStuckWorker(t, h)
	a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
	if v, err := h.rdb.BLPop(ctx, 20*time.Second, h.prefix+":leftover:started").Result(); err != nil || v[1] != a.ID {
		t.Fatalf("the worker never ran %s: %v %v", a.ID, v, err)
	}
	kill()
	if dup := h.duplicateOf(counterTask("k", 1, 2)); dup.Holder != a.ID || dup.FailHeld {
		t.Fatalf("enqueue right after the kill: %+v, want a plain duplicate of %s", dup, a.ID)
	}
	expireAsynqLease(t, h, a.ID)
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil) // its recoverer runs as it starts
	eventually(t, "asynq's recoverer archives the task", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
	// (Another producer: this one answers from the lock alone for a second
	// after it read the holder's record, as lifecycle.md, Healing, says.)
	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	b, err := d2.NewClient().Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil {
		t.Fatalf("the key's next enqueue once the killed last attempt is archived: %v, want a new task at once", err)
	}
	if r := waitFor(t, rc.runs, "the new task runs"); r.id != b.ID {
		t.Fatalf("ran %s, want %s", r.id, b.ID)
	}
}
