// Command worker shows dedup end to end: producers enqueue many
// "user:reindex" tasks for a few users through the deduplicating client while
// an asynq server with the dedup middleware works them off, and it checks
// that no user ever had two tasks at once.
//
//	go run ./examples/worker                          # embedded Redis (miniredis)
//	REDIS_URL=redis://localhost:6379/0 go run ./examples/worker
//
// Every run uses its own queue ("example-<random>"), so it can share a Redis
// with other work; it removes that queue's keys when it is done.
package main

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

const taskType = "user:reindex"

// options sizes a run. main uses defaultOptions; the test uses smaller ones.
type options struct {
	Enqueues  int           // tasks to enqueue in total
	Users     int           // distinct user_ids they are spread over
	Producers int           // goroutines enqueueing concurrently
	Workers   int           // asynq server concurrency
	Timeout   time.Duration // bound on producing plus processing
	RedisURL  string        // "" starts an embedded miniredis
}

func defaultOptions() options {
	return options{Enqueues: 10_000, Users: 1_000, Producers: 8, Workers: 20, Timeout: 50 * time.Second}
}

// summary is what a run observed; run prints it and the test checks it.
type summary struct {
	Queue         string
	Accepted      int    // enqueues that created a task
	Rejected      int    // enqueues refused as duplicates
	EnqueueErrors int    // any other enqueue error
	SampleHolder  string // a task ID named by a DuplicateTaskError
	AllAsynqDup   bool   // every rejection matched asynq.ErrDuplicateTask
	Processed     int    // handler runs that completed
	NotOnce       int    // accepted tasks that did not run exactly once, or runs of tasks never accepted
	HandlerErrors int    // payloads the handler could not decode
	Violations    int    // times a user had two handlers running at once
	MaxPerKey     int    // most handlers seen running at once for one user
	LocksLeft     int    // dedup lock keys of the queue left after shutdown
	Took          time.Duration
	Stats         dedup.Stats
	FailedChecks  []string
	errorSamples  []string // first few unexpected enqueue errors, for printing
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	o := defaultOptions()
	o.RedisURL = os.Getenv("REDIS_URL")
	_, err := run(ctx, os.Stdout, o)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "FAILED:", err)
		os.Exit(1)
	}
}

// run performs one whole demonstration and prints its summary to out. It
// returns an error when Redis cannot be used or any check fails; the summary
// is returned whenever the run got as far as producing.
func run(ctx context.Context, out io.Writer, o options) (*summary, error) {
	if o.Enqueues < 1 || o.Users < 1 || o.Producers < 1 || o.Workers < 1 || o.Timeout <= 0 {
		return nil, fmt.Errorf("invalid options %+v", o)
	}
	begin := time.Now()
	rdb, where, closeRedis, err := openRedis(ctx, o.RedisURL)
	if err != nil {
		return nil, err
	}
	defer closeRedis()

	queue := "example-" + randomHex(6)
	s := &summary{Queue: queue, AllAsynqDup: true}

	d, err := dedup.New(ctx, rdb, dedup.Config{})
	if err != nil {
		return nil, fmt.Errorf("dedup.New: %w", err)
	}
	defer d.Close() // idempotent; the explicit Close below orders it after Shutdown

	w := newWorker()
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency: o.Workers,
		Queues:      map[string]int{queue: 1},
		// A task deferred by dedup's execution-time guard is not a failure.
		IsFailure: dedup.IsFailure,
		// asynq polls an empty queue; a short interval lets the server pick
		// up tasks within milliseconds while the producers are still going.
		TaskCheckInterval: 50 * time.Millisecond,
		LogLevel:          asynq.WarnLevel,
		// Handlers take milliseconds; don't let a stuck one keep the
		// program from exiting within its minute.
		ShutdownTimeout: 5 * time.Second,
	})
	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc(taskType, w.handle)
	// Start before producing, so tasks finish while others are still being
	// enqueued: that is what frees keys for later enqueues of the same user.
	if err := srv.Start(mux); err != nil {
		return nil, fmt.Errorf("start asynq server: %w", err)
	}
	defer srv.Shutdown() // no-op once the explicit Shutdown below has run

	wctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()

	// Both *asynq.Client and the wrapper share rdb. asynq refuses to Close a
	// client built on a shared connection, so only rdb is closed at the end.
	client := d.WrapClient(asynq.NewClientFromRedisClient(rdb))
	attempted := produce(wctx, client, queue, o, s)

	// All enqueues are in; wait for the server to finish every accepted task.
	waitErr := w.waitFor(wctx, s.Accepted)
	cancel()

	// Shutdown waits for running handlers, so every lock is settled after it.
	srv.Shutdown()
	d.Close()

	w.fill(s)
	s.Stats = d.Stats()
	s.Took = time.Since(begin)

	// A fresh context: ctx may be cancelled (Ctrl-C) and we still want to
	// count and clean up.
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer ccancel()
	// Key layout dedup uses for locks: <prefix>:{<queue>}:l:<fingerprint>.
	locks, scanErr := countKeys(cctx, rdb, dedup.DefaultPrefix+":{"+queue+"}:l:*")
	s.LocksLeft = locks

	check := func(ok bool, format string, args ...any) {
		if !ok {
			s.FailedChecks = append(s.FailedChecks, fmt.Sprintf(format, args...))
		}
	}
	check(ctx.Err() == nil, "interrupted")
	check(waitErr == nil, "%v", waitErr)
	check(attempted == o.Enqueues, "only %s of %s enqueues were attempted", commas(attempted), commas(o.Enqueues))
	check(s.Accepted+s.Rejected+s.EnqueueErrors == attempted, "accepted + rejected + errors (%d) != attempted (%d)", s.Accepted+s.Rejected+s.EnqueueErrors, attempted)
	check(s.EnqueueErrors == 0, "%s enqueues failed with an unexpected error", commas(s.EnqueueErrors))
	check(s.AllAsynqDup, "a DuplicateTaskError did not match asynq.ErrDuplicateTask")
	check(s.Processed == s.Accepted, "processed (%s) != accepted (%s)", commas(s.Processed), commas(s.Accepted))
	check(s.NotOnce == 0, "%s accepted tasks did not run exactly once", commas(s.NotOnce))
	check(s.HandlerErrors == 0, "%s tasks had an undecodable payload", commas(s.HandlerErrors))
	check(s.Violations == 0, "a user had two tasks running at once %s times", commas(s.Violations))
	check(scanErr == nil, "counting locks: %v", scanErr)
	check(s.LocksLeft == 0, "%s locks left in Redis after shutdown", commas(s.LocksLeft))

	printSummary(out, s, o, where)
	cleanup(cctx, rdb, queue)

	if len(s.FailedChecks) > 0 {
		return s, errors.New(strings.Join(s.FailedChecks, "; "))
	}
	return s, nil
}

// openRedis connects to REDIS_URL, or starts an embedded miniredis when url
// is empty. where describes it for the summary (never with a password).
func openRedis(ctx context.Context, url string) (rdb *redis.Client, where string, closeFn func(), err error) {
	if url == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return nil, "", nil, fmt.Errorf("start embedded Redis: %w", err)
		}
		rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		return rdb, "embedded miniredis", func() { rdb.Close(); mr.Close() }, nil
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, "", nil, fmt.Errorf("REDIS_URL is not a valid Redis URL (want redis://[user:password@]host:port[/db]): %w", err)
	}
	rdb = redis.NewClient(opt)
	// Fail fast with a clear message rather than after dedup.New's retries.
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		rdb.Close()
		return nil, "", nil, fmt.Errorf("cannot reach Redis at %s (from REDIS_URL): %w", opt.Addr, err)
	}
	return rdb, "Redis at " + opt.Addr, func() { rdb.Close() }, nil
}

// payload is the task's JSON body. Only user_id forms the dedup key; trace_id
// and requested_at differ on every enqueue, which is why deduplicating on the
// whole payload would catch nothing here.
type payload struct {
	UserID      int    `json:"user_id"`
	TraceID     string `json:"trace_id"`
	RequestedAt string `json:"requested_at"`
}

// produce enqueues o.Enqueues tasks from o.Producers goroutines, user_id
// cycling over o.Users so every user is asked for repeatedly, and tallies
// the outcomes into s. It returns how many enqueues it attempted.
func produce(ctx context.Context, c *dedup.Client, queue string, o options, s *summary) int {
	var (
		next int64 // claimed with atomic adds; the producers share it
		mu   sync.Mutex
		wg   sync.WaitGroup
		n    atomic.Int64
	)
	for range o.Producers {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := atomic.AddInt64(&next, 1) - 1
				if i >= int64(o.Enqueues) {
					return
				}
				n.Add(1)
				body, _ := json.Marshal(payload{
					UserID:      int(i) % o.Users,
					TraceID:     randomHex(8),
					RequestedAt: time.Now().UTC().Format(time.RFC3339Nano),
				})
				_, err := c.EnqueueContext(ctx, asynq.NewTask(taskType, body),
					asynq.Queue(queue), dedup.Fields("user_id"))

				var dup *dedup.DuplicateTaskError
				mu.Lock()
				switch {
				case err == nil:
					s.Accepted++
				case errors.As(err, &dup):
					s.Rejected++
					if s.SampleHolder == "" {
						s.SampleHolder = dup.TaskID
					}
					// Code written for asynq.Unique checks this; it keeps working.
					if !errors.Is(err, asynq.ErrDuplicateTask) {
						s.AllAsynqDup = false
					}
				default:
					s.EnqueueErrors++
					if len(s.errorSamples) < 5 {
						s.errorSamples = append(s.errorSamples, err.Error())
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return int(n.Load())
}

// worker is the task handler plus what it records about its runs.
type worker struct {
	mu         sync.Mutex
	running    map[int]int    // user_id → handlers running now
	runs       map[string]int // task ID → completed runs
	processed  int
	maxPerKey  int
	violations int
	badPayload int

	// progress gets a token after each completed run so waitFor can recheck
	// the count; one buffered slot is enough since waitFor always rereads.
	progress chan struct{}
}

func newWorker() *worker {
	return &worker{running: map[int]int{}, runs: map[string]int{}, progress: make(chan struct{}, 1)}
}

func (w *worker) handle(ctx context.Context, t *asynq.Task) error {
	var p payload
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		w.mu.Lock()
		w.badPayload++
		w.mu.Unlock()
		return fmt.Errorf("decode payload: %v: %w", err, asynq.SkipRetry)
	}
	w.enter(p.UserID)
	// Deferred, so it runs before the middleware releases the lock: a later
	// task of this user can only start after this one is counted out.
	defer w.leave(p.UserID)

	// Simulated work, 1–5 ms.
	timer := time.NewTimer(time.Duration(1+rand.IntN(5)) * time.Millisecond)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-ctx.Done():
		return ctx.Err() // asynq retries it; not counted as processed
	}

	id, _ := asynq.GetTaskID(ctx)
	w.mu.Lock()
	w.processed++
	w.runs[id]++
	w.mu.Unlock()
	select {
	case w.progress <- struct{}{}:
	default: // a token is already pending
	}
	return nil
}

func (w *worker) enter(user int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.running[user]++
	n := w.running[user]
	w.maxPerKey = max(w.maxPerKey, n)
	if n > 1 {
		w.violations++
	}
}

func (w *worker) leave(user int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.running[user]--; w.running[user] == 0 {
		delete(w.running, user)
	}
}

// waitFor returns once target runs have completed, or when ctx ends.
func (w *worker) waitFor(ctx context.Context, target int) error {
	for {
		w.mu.Lock()
		n := w.processed
		w.mu.Unlock()
		if n >= target {
			return nil
		}
		select {
		case <-w.progress:
		case <-ctx.Done():
			return fmt.Errorf("gave up waiting after %s of %s tasks were processed: %w", commas(n), commas(target), ctx.Err())
		}
	}
}

// fill copies the worker's records into s once the server has stopped.
func (w *worker) fill(s *summary) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s.Processed = w.processed
	s.Violations = w.violations
	s.MaxPerKey = w.maxPerKey
	s.HandlerErrors = w.badPayload
	// Each accepted task should have run once: a count that matches while
	// some task ran twice and another never would be a coincidence, not a
	// pass. More distinct IDs than accepted enqueues means some task ran that
	// the producers were told had failed.
	once := 0
	for _, n := range w.runs {
		if n == 1 {
			once++
		}
	}
	s.NotOnce = max(s.Accepted, len(w.runs)) - once
}

// countKeys counts the keys matching pattern with SCAN (never KEYS, which
// blocks a shared Redis).
func countKeys(ctx context.Context, rdb *redis.Client, pattern string) (int, error) {
	n := 0
	iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		n++
	}
	return n, iter.Err()
}

// cleanup removes this run's queue from asynq and deletes every key of it
// (asynq's counters, any leftover locks), so a shared Redis is left as found.
// The queue name is random, so the patterns match nothing of anyone else's.
func cleanup(ctx context.Context, rdb *redis.Client, queue string) {
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if err := insp.DeleteQueue(queue, true); err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
		fmt.Fprintf(os.Stderr, "cleanup: remove queue %s: %v\n", queue, err)
	}
	for _, pattern := range []string{"asynq:{" + queue + "}:*", dedup.DefaultPrefix + ":{" + queue + "}:*"} {
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
		if err := iter.Err(); err != nil {
			fmt.Fprintf(os.Stderr, "cleanup: %s: %v\n", pattern, err)
		}
	}
}

func printSummary(out io.Writer, s *summary, o options, where string) {
	p := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	p("dedup example: %s enqueues over %s users (queue %s, %s)", commas(o.Enqueues), commas(o.Users), s.Queue, where)
	p("  accepted (new tasks)      : %s", commas(s.Accepted))
	rej := commas(s.Rejected)
	if s.SampleHolder != "" {
		rej = fmt.Sprintf("%-7s e.g. held by task %s  (errors.Is(err, asynq.ErrDuplicateTask) = %t)", rej, s.SampleHolder, s.AllAsynqDup)
	}
	p("  rejected as duplicates    : %s", rej)
	if s.EnqueueErrors > 0 {
		p("  other enqueue errors      : %s", commas(s.EnqueueErrors))
		for _, e := range s.errorSamples {
			p("      %s", e)
		}
	}
	p("  processed                 : %s", commas(s.Processed))
	if s.Violations == 0 {
		p("  same key running twice    : never   (max concurrent runs per key: %d)", s.MaxPerKey)
	} else {
		p("  same key running twice    : %s times   (max concurrent runs per key: %d)", commas(s.Violations), s.MaxPerKey)
	}
	p("  locks left in Redis       : %s", commas(s.LocksLeft))
	p("  took                      : %.1fs", s.Took.Seconds())
	st := s.Stats
	p("  dedup.Stats               : locked %s, duplicates %s, started %s, released %s, busy %d, lock lost %d, redis errors %d",
		commas(int(st.Locked)), commas(int(st.Duplicates)), commas(int(st.Started)), commas(int(st.Released)), st.Busy, st.LockLost, st.RedisErrors)
	if s.Accepted > o.Users {
		p("  (accepted > %s users: a user's key is free again once its task is done, so a later", commas(o.Users))
		p("   enqueue for that user starts a new task; duplicates are refused only while one is")
		p("   queued or running.)")
	}
	if len(s.FailedChecks) == 0 {
		p("OK")
		return
	}
	for _, f := range s.FailedChecks {
		p("FAIL: %s", f)
	}
}

func randomHex(nBytes int) string {
	b := make([]byte, nBytes)
	_, _ = crand.Read(b) // never fails (Go ≥ 1.24 crashes instead)
	return hex.EncodeToString(b)
}

// commas formats n with thousands separators: 10000 → "10,000".
func commas(n int) string {
	if n < 0 {
		return "-" + commas(-n)
	}
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
