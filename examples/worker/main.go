// Command worker shows dedup end to end: producers enqueue many tasks for a
// few users through the deduplicating client while an asynq server with the
// dedup middleware works them off, and it checks what came out.
//
//	go run ./examples/worker                   # -mode=reject: a duplicate of a queued or running task is refused
//	go run ./examples/worker -mode=replace     # a waiting task takes the newest payload instead
//	REDIS_URL=redis://localhost:6379/0 go run ./examples/worker
//
// Without REDIS_URL it runs on an embedded Redis (miniredis). Every run uses
// its own queue ("example-<random>"), so it can share a Redis with other
// work; it removes that queue's keys when it is done.
//
// This file holds what both modes share: the Redis, the server, the worker
// that records every run, the producer loop and the summary's plumbing.
// reject.go and replace.go hold the two demonstrations.
package main

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
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

// options sizes a run. main uses defaultOptions; the test uses smaller ones.
type options struct {
	Enqueues  int           // tasks to enqueue in total (per phase, in replace mode)
	Users     int           // distinct user_ids they are spread over
	Producers int           // goroutines enqueueing concurrently
	Workers   int           // asynq server concurrency
	Timeout   time.Duration // bound on producing plus processing
	RedisURL  string        // "" starts an embedded miniredis
}

func defaultOptions() options {
	return options{Enqueues: 10_000, Users: 1_000, Producers: 8, Workers: 20, Timeout: 50 * time.Second}
}

// modes maps -mode to its demonstration. Each prints its summary to out and
// returns an error when Redis cannot be used or any check fails.
var modes = map[string]func(context.Context, io.Writer, options) error{
	"reject": func(ctx context.Context, out io.Writer, o options) error {
		_, err := runReject(ctx, out, o)
		return err
	},
	"replace": func(ctx context.Context, out io.Writer, o options) error {
		_, err := runReplace(ctx, out, o)
		return err
	},
}

func main() {
	mode := flag.String("mode", "reject", "which demonstration to run, by the dedup `policy` it shows:\n"+
		"reject: refuse an enqueue for a user whose task is queued or running\n"+
		"replace: write a newer update into the user's waiting task; updates that\n"+
		"arrive while the user's task runs wait in one follow-up task")
	flag.Parse()
	run, ok := modes[*mode]
	if !ok || flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown mode %q or extra arguments; use -mode=reject or -mode=replace\n", *mode)
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	o := defaultOptions()
	o.RedisURL = os.Getenv("REDIS_URL")
	err := run(ctx, os.Stdout, o)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "FAILED:", err)
		os.Exit(1)
	}
}

// env is what both modes run on: a Redis, a queue of the run's own, a Dedup,
// the deduplicating client, and an asynq server (not started yet) that runs
// the worker's handler for one task type behind the dedup middleware.
type env struct {
	rdb        *redis.Client
	where      string // the Redis, for the summary (never with a password)
	queue      string
	d          *dedup.Dedup
	client     *dedup.Client
	srv        *asynq.Server
	mux        *asynq.ServeMux
	w          *worker
	closeRedis func()
	begin      time.Time
}

func newEnv(ctx context.Context, o options, cfg dedup.Config, taskType string) (*env, error) {
	if o.Enqueues < 1 || o.Users < 1 || o.Producers < 1 || o.Workers < 1 || o.Timeout <= 0 {
		return nil, fmt.Errorf("invalid options %+v", o)
	}
	e := &env{begin: time.Now(), queue: "example-" + randomHex(6), w: newWorker()}
	var err error
	e.rdb, e.where, e.closeRedis, err = openRedis(ctx, o.RedisURL)
	if err != nil {
		return nil, err
	}
	e.d, err = dedup.New(ctx, e.rdb, cfg)
	if err != nil {
		e.closeRedis()
		return nil, fmt.Errorf("dedup.New: %w", err)
	}
	e.srv = asynq.NewServerFromRedisClient(e.rdb, asynq.Config{
		Concurrency: o.Workers,
		Queues:      map[string]int{e.queue: 1},
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
	e.mux = asynq.NewServeMux()
	// The worker's counter goes outside dedup's middleware, so it counts an
	// attempt only once dedup has settled its lock: when waitFor returns,
	// every counted task's key is free again (or handed to its follow-up).
	e.mux.Use(e.w.settle, e.d.Middleware())
	e.mux.HandleFunc(taskType, e.w.handle)
	// Both *asynq.Client and the wrapper share rdb. asynq refuses to Close a
	// client built on a shared connection, so only rdb is closed at the end.
	e.client = e.d.WrapClient(asynq.NewClientFromRedisClient(e.rdb))
	return e, nil
}

func (e *env) start() error {
	if err := e.srv.Start(e.mux); err != nil {
		return fmt.Errorf("start asynq server: %w", err)
	}
	return nil
}

// stop shuts the server down and closes the Dedup. Shutdown waits for
// running handlers, so every lock is settled after it.
func (e *env) stop() {
	e.srv.Shutdown() // a no-op if the server never started or already stopped
	e.d.Close()      // idempotent
}

// close stops everything (if the run did not get that far), removes the
// queue's keys and closes Redis.
func (e *env) close() {
	e.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cleanup(ctx, e.rdb, e.queue)
	e.closeRedis()
}

// finish stops the server and fills in what every mode reports: the
// worker's records, the Dedup's counters and what is left in Redis. It adds
// the checks every mode makes to c.
func (e *env) finish(ctx context.Context, r *report, c *checks, waitErr error, t *tally) {
	e.stop()
	e.w.fill(r, t.tasks)
	r.Stats = e.d.Stats()
	r.Took = time.Since(e.begin)

	// A fresh context: ctx may be cancelled (Ctrl-C) and we still want to count.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	// Key layout dedup uses (docs/cluster.md): the lock <prefix>:{<queue>}:u:<fingerprint>,
	// and a mode record <prefix>:{<queue>}:m:<fingerprint> for the keys whose policy needs one.
	var lockErr, modeErr, taskErr error
	var modes int
	r.LocksLeft, lockErr = countKeys(cctx, e.rdb, "dedup"+":{"+e.queue+"}:u:*")
	modes, modeErr = countKeys(cctx, e.rdb, "dedup"+":{"+e.queue+"}:m:*")
	r.LocksLeft += modes
	lockErr = errors.Join(lockErr, modeErr)
	// asynq deletes a task's record once it succeeds (no Retention here), so
	// a record left over is a task that never ran, such as a lost follow-up.
	r.TasksLeft, taskErr = countKeys(cctx, e.rdb, "asynq:{"+e.queue+"}:t:*")

	c.add(ctx.Err() == nil, "interrupted")
	c.add(waitErr == nil, "%v", waitErr)
	c.add(t.Errors == 0, "%s enqueues failed with an unexpected error", commas(t.Errors))
	c.add(r.NotOnce == 0, "%s tasks did not run exactly once", commas(r.NotOnce))
	c.add(r.HandlerErrors == 0, "%s tasks had an undecodable payload", commas(r.HandlerErrors))
	c.add(r.Violations == 0, "a user had two tasks running at once %s times", commas(r.Violations))
	c.add(errors.Join(lockErr, taskErr) == nil, "counting what is left in Redis: %v", errors.Join(lockErr, taskErr))
	c.add(r.LocksLeft == 0 && r.TasksLeft == 0, "%s locks and %s tasks left in Redis after shutdown", commas(r.LocksLeft), commas(r.TasksLeft))
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
	UserID int `json:"user_id"`
	// Version numbers a user's updates 1, 2, 3, … in replace mode, so the
	// worker can tell which one it got. Reject mode leaves it out.
	Version     int    `json:"version,omitempty"`
	TraceID     string `json:"trace_id"`
	RequestedAt string `json:"requested_at"`
}

// update is one enqueue: user's version-th update (version 0 in reject mode).
type update struct{ user, version int }

func (u update) task(taskType string) *asynq.Task {
	body, _ := json.Marshal(payload{
		UserID:      u.user,
		Version:     u.version,
		TraceID:     randomHex(8),
		RequestedAt: time.Now().UTC().Format(time.RFC3339Nano),
	})
	return asynq.NewTask(taskType, body)
}

// sendFunc enqueues one task and says what the enqueue did.
type sendFunc func(ctx context.Context, t *asynq.Task) (dedup.Result, error)

// produce runs producers goroutines. Each sends the updates next hands it,
// until next reports none left for it or ctx ends, and records the outcomes
// in t. It returns how many it sent.
func produce(ctx context.Context, producers int, taskType string, next func(producer int) (update, bool), send sendFunc, t *tally) int {
	var (
		mu sync.Mutex // guards t
		wg sync.WaitGroup
		n  atomic.Int64
	)
	for p := range producers {
		wg.Go(func() {
			for ctx.Err() == nil {
				u, ok := next(p)
				if !ok {
					return
				}
				n.Add(1)
				res, err := send(ctx, u.task(taskType))
				mu.Lock()
				t.add(u, res, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return int(n.Load())
}

// tally counts what a run's enqueues did.
type tally struct {
	Created, Replaced, Deferred int // dedup.Outcome of the accepted enqueues
	Rejected                    int // refused with a *dedup.DuplicateTaskError
	Errors                      int // any other error
	NotAsynqDup                 int // rejections that did not match asynq.ErrDuplicateTask
	SampleHolder                string
	errorSamples                []string // first few unexpected errors, for printing

	// tasks holds the IDs of the tasks the enqueues created (new tasks and
	// follow-ups), each of which should run exactly once; latest holds each
	// user's newest version that went in.
	tasks  map[string]bool
	latest map[int]int
}

func newTally() *tally { return &tally{tasks: map[string]bool{}, latest: map[int]int{}} }

func (t *tally) add(u update, res dedup.Result, err error) {
	var dup *dedup.DuplicateTaskError
	switch {
	case err == nil:
		t.latest[u.user] = max(t.latest[u.user], u.version)
		switch res.Outcome {
		case dedup.Created:
			t.Created++
			t.tasks[res.TaskID] = true
		case dedup.Deferred:
			t.Deferred++
			t.tasks[res.TaskID] = true
		case dedup.Replaced:
			t.Replaced++
		default: // Merged: this example never merges
			t.sample(fmt.Errorf("unexpected outcome %v", res.Outcome))
		}
	case errors.As(err, &dup):
		t.Rejected++
		if t.SampleHolder == "" {
			t.SampleHolder = dup.Holder
		}
		// Code written for asynq.Unique checks this; it keeps working.
		if !errors.Is(err, asynq.ErrDuplicateTask) {
			t.NotAsynqDup++
		}
	default:
		t.sample(err)
	}
}

func (t *tally) sample(err error) {
	t.Errors++
	if len(t.errorSamples) < 5 {
		t.errorSamples = append(t.errorSamples, err.Error())
	}
}

// merge adds u's counts to t, for totals over phases.
func (t *tally) merge(u *tally) {
	t.Created += u.Created
	t.Replaced += u.Replaced
	t.Deferred += u.Deferred
	t.Rejected += u.Rejected
	t.Errors += u.Errors
	t.NotAsynqDup += u.NotAsynqDup
	t.errorSamples = append(t.errorSamples, u.errorSamples...)
	for id := range u.tasks {
		t.tasks[id] = true
	}
	for user, v := range u.latest {
		t.latest[user] = max(t.latest[user], v)
	}
}

// report is what every mode observes once the server has stopped.
type report struct {
	Queue         string
	Processed     int // handler runs that completed
	NotOnce       int // created tasks that did not run exactly once, plus runs of tasks never created
	HandlerErrors int // payloads the handler could not decode
	Violations    int // times a user had two handlers running at once
	MaxPerUser    int // most handlers seen running at once for one user
	Backwards     int // runs of a user with a version no newer than its previous run's (replace mode)
	LocksLeft     int // dedup lock keys of the queue left after shutdown
	TasksLeft     int // asynq task records of the queue left after shutdown
	Took          time.Duration
	Stats         dedup.Stats
	FailedChecks  []string
}

// checks collects the descriptions of the checks that failed.
type checks []string

func (c *checks) add(ok bool, format string, args ...any) {
	if !ok {
		*c = append(*c, fmt.Sprintf(format, args...))
	}
}

func (c checks) err() error {
	if len(c) == 0 {
		return nil
	}
	return errors.New(strings.Join(c, "; "))
}

// worker is the task handler plus what it records about its runs.
type worker struct {
	mu         sync.Mutex
	running    map[int]int    // user_id → handlers running now
	runs       map[string]int // task ID → completed runs
	versions   map[int][]int  // user_id → versions its runs got, in order (replace mode)
	processed  int
	settled    int // attempts whose lock dedup has settled
	maxPerUser int
	violations int
	backwards  int
	badPayload int

	// progress gets a token after each settled attempt so waitFor can
	// recheck the count; one buffered slot is enough since waitFor always
	// rereads.
	progress chan struct{}
}

func newWorker() *worker {
	return &worker{running: map[int]int{}, runs: map[string]int{}, versions: map[int][]int{}, progress: make(chan struct{}, 1)}
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
	defer w.mu.Unlock()
	w.processed++
	w.runs[id]++
	if p.Version > 0 {
		// A user's runs never overlap (that is checked too), so their order
		// here is the order they ran in: each must be newer than the last.
		vs := w.versions[p.UserID]
		if len(vs) > 0 && p.Version <= vs[len(vs)-1] {
			w.backwards++
		}
		w.versions[p.UserID] = append(vs, p.Version)
	}
	return nil
}

// settle is a middleware around dedup's: it counts an attempt as settled
// after dedup has released (or held) the task's lock, and wakes waitFor.
func (w *worker) settle(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		err := next.ProcessTask(ctx, t)
		w.mu.Lock()
		w.settled++
		w.mu.Unlock()
		select {
		case w.progress <- struct{}{}:
		default: // a token is already pending
		}
		return err
	})
}

func (w *worker) enter(user int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.running[user]++
	n := w.running[user]
	w.maxPerUser = max(w.maxPerUser, n)
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

// waitFor returns once target attempts have been settled, or when ctx ends.
func (w *worker) waitFor(ctx context.Context, target int) error {
	for {
		w.mu.Lock()
		n := w.settled
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

// runsOf returns a copy of the versions each user's runs got so far.
func (w *worker) runsOf() map[int][]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[int][]int, len(w.versions))
	for u, vs := range w.versions {
		out[u] = append([]int(nil), vs...)
	}
	return out
}

// fill copies the worker's records into r once the server has stopped.
// created holds the IDs of every task the producers were told was created.
func (w *worker) fill(r *report, created map[string]bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	r.Processed = w.processed
	r.Violations = w.violations
	r.MaxPerUser = w.maxPerUser
	r.Backwards = w.backwards
	r.HandlerErrors = w.badPayload
	// Each created task should have run once, and nothing else should have:
	// matching totals while one task ran twice and another never would be a
	// coincidence, not a pass.
	for id := range created {
		if w.runs[id] != 1 {
			r.NotOnce++
		}
	}
	for id := range w.runs {
		if !created[id] {
			r.NotOnce++
		}
	}
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
	for _, pattern := range []string{"asynq:{" + queue + "}:*", "dedup" + ":{" + queue + "}:*"} {
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
		if err := iter.Err(); err != nil {
			fmt.Fprintf(os.Stderr, "cleanup: %s: %v\n", pattern, err)
		}
	}
}

// printer writes the summary's lines.
type printer struct{ out io.Writer }

func (p printer) line(format string, args ...any) { fmt.Fprintf(p.out, format+"\n", args...) }

// enqueueErrors lists the unexpected enqueue errors, if there were any.
func (p printer) enqueueErrors(label string, t *tally) {
	if t.Errors == 0 {
		return
	}
	p.line("  %-24s: %s", label, commas(t.Errors))
	for _, e := range t.errorSamples {
		p.line("      %s", e)
	}
}

// footer prints the lines every mode ends with: concurrency, leftovers,
// time, the given dedup.Stats counters, and OK or the failed checks.
func (p printer) footer(r *report, stats ...stat) {
	if r.Violations == 0 {
		p.line("  %-24s: never   (max concurrent runs per user: %d)", "same user running twice", r.MaxPerUser)
	} else {
		p.line("  %-24s: %s times   (max concurrent runs per user: %d)", "same user running twice", commas(r.Violations), r.MaxPerUser)
	}
	p.line("  %-24s: %s locks, %s tasks", "left in Redis", commas(r.LocksLeft), commas(r.TasksLeft))
	p.line("  %-24s: %.1fs", "took", r.Took.Seconds())
	parts := make([]string, len(stats))
	for i, s := range stats {
		parts[i] = s.name + " " + commas(int(s.n))
	}
	p.line("  %-24s: %s", "dedup.Stats", strings.Join(parts, ", "))
	if len(r.FailedChecks) == 0 {
		p.line("OK")
		return
	}
	for _, f := range r.FailedChecks {
		p.line("FAIL: %s", f)
	}
}

// stat is one dedup.Stats counter, named for the summary.
type stat struct {
	name string
	n    uint64
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
