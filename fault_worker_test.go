package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The worker process of the fault tests. TestFaultWorkerKilled runs the test
// binary again with -test.run=^TestFaultWorkerProcess$ and the environment
// below; the child is an ordinary worker application (its own go-redis
// client, Dedup and asynq server with the middleware) that the parent can
// SIGKILL. Nothing crosses the process boundary but Redis: the handler
// records what it does in a Redis list, stamped with the Redis server's
// clock, and waits for the parent's go-ahead in Redis.

const (
	faultWorkerEnv = "DEDUP_FAULT_WORKER" // "1" in the child
	faultAddrEnv   = "DEDUP_FAULT_ADDR"   // redis host:port
	faultPrefixEnv = "DEDUP_FAULT_PREFIX" // dedup Prefix, also names the record keys
	faultQueueEnv  = "DEDUP_FAULT_QUEUE"  // the one asynq queue served
	faultLeaseEnv  = "DEDUP_FAULT_LEASE"  // dedup Config.Lease (time.Duration text)
	faultNameEnv   = "DEDUP_FAULT_NAME"   // worker name in the records

	faultTaskType   = "fault:job"
	faultRetryDelay = 100 * time.Millisecond
)

// faultJob is the payload of fault:job. The key is user_id; Mode says what
// the handler does:
//
//	"block"  first attempt: runs until the process is killed; later: returns at once
//	"hold"   runs until the key faultReleaseKey(prefix, task ID) exists
//	other    returns at once
type faultJob struct {
	UserID int    `json:"user_id"`
	Mode   string `json:"mode"`
}

func faultEventsKey(prefix string) string { return prefix + ":fault:events" }

func faultReleaseKey(prefix, id string) string { return prefix + ":fault:release:" + id }

// faultRecordScript appends "<event> <micros>" to KEYS[1], the time taken
// from the Redis server, so entries of all processes share one clock and one
// order (the list's).
var faultRecordScript = redis.NewScript(`
local t = redis.call('TIME')
redis.call('RPUSH', KEYS[1], ARGV[1] .. ' ' .. t[1] .. string.format('%06d', tonumber(t[2])))
return 1`)

// faultRecord appends "<kind> <worker> <task ID> <retry count> <micros>".
func faultRecord(ctx context.Context, rdb redis.Cmdable, prefix, kind, worker, id string, retry int) error {
	ev := fmt.Sprintf("%s %s %s %d", kind, worker, id, retry)
	return faultRecordScript.Run(ctx, rdb, []string{faultEventsKey(prefix)}, ev).Err()
}

// faultEvent is one parsed record.
type faultEvent struct {
	kind, worker, id string
	retry            int
	at               int64 // Redis server time, µs since the epoch
}

func (e faultEvent) String() string {
	return fmt.Sprintf("%s %s %s (retry %d) at %d", e.kind, e.worker, e.id, e.retry, e.at)
}

func parseFaultEvents(lines []string) ([]faultEvent, error) {
	out := make([]faultEvent, 0, len(lines))
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) != 5 {
			return nil, fmt.Errorf("bad record %q", l)
		}
		retry, err1 := strconv.Atoi(f[3])
		at, err2 := strconv.ParseInt(f[4], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("bad record %q: %w", l, err)
		}
		out = append(out, faultEvent{kind: f[0], worker: f[1], id: f[2], retry: retry, at: at})
	}
	return out, nil
}

// runFaultWorker is the worker process that TestFaultWorkerKilled starts
// (and kills): TestMain runs it instead of the tests when faultWorkerEnv is
// set.
func runFaultWorker() error {
	addr, prefix, queue, name := os.Getenv(faultAddrEnv), os.Getenv(faultPrefixEnv), os.Getenv(faultQueueEnv), os.Getenv(faultNameEnv)
	lease, err := time.ParseDuration(os.Getenv(faultLeaseEnv))
	if err != nil || addr == "" || prefix == "" || queue == "" || name == "" {
		return fmt.Errorf("worker environment incomplete (lease: %v)", err)
	}
	// Bounded life, in case the parent dies without killing us.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("worker", name)
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	retryDelay := func(int, error, *asynq.Task) time.Duration { return faultRetryDelay }
	d, err := New(ctx, rdb, Config{Prefix: prefix, heartbeat: (lease) / 3, RetryDelayFunc: retryDelay, Logger: logger})
	if err != nil {
		return fmt.Errorf("New: %w", err)
	}
	defer d.Close()

	record := func(kind, id string, retry int) {
		// The parent reads these records; one that is lost fails its test.
		if err := faultRecord(context.Background(), rdb, prefix, kind, name, id, retry); err != nil {
			logger.Error("fault worker: record failed", "kind", kind, "task_id", id, "error", err)
		}
	}
	handler := func(hctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(hctx)
		n, _ := asynq.GetRetryCount(hctx)
		var job faultJob
		if err := json.Unmarshal(task.Payload(), &job); err != nil {
			return fmt.Errorf("%w: %v", asynq.SkipRetry, err)
		}
		record("start", id, n)
		switch {
		case job.Mode == "block" && n == 0:
			<-hctx.Done() // until SIGKILL (or shutdown, if the parent never kills us)
			return hctx.Err()
		case job.Mode == "hold":
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for { // polls the parent's go-ahead: the only signal another process can give
				if n, err := rdb.Exists(hctx, faultReleaseKey(prefix, id)).Result(); err == nil && n == 1 {
					break
				}
				select {
				case <-hctx.Done():
					return hctx.Err()
				case <-tick.C:
				}
			}
		}
		record("end", id, n)
		return nil
	}

	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc(faultTaskType, handler)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              4,
		Queues:                   map[string]int{queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		IsFailure:                IsFailure,
		RetryDelayFunc:           retryDelay,
		LogLevel:                 asynq.WarnLevel,
		ShutdownTimeout:          2 * time.Second,
	})
	// Outside the middleware: report the execution-time guard's deferrals.
	outer := asynq.HandlerFunc(func(hctx context.Context, task *asynq.Task) error {
		err := mux.ProcessTask(hctx, task)
		if errors.Is(err, ErrKeyBusy) {
			id, _ := asynq.GetTaskID(hctx)
			n, _ := asynq.GetRetryCount(hctx)
			record("busy", id, n)
		}
		return err
	})
	if err := srv.Start(outer); err != nil {
		return fmt.Errorf("server start: %w", err)
	}
	logger.Info("fault worker: serving", "queue", queue, "pid", os.Getpid())
	<-ctx.Done()
	srv.Shutdown()
	return nil
}
