package main

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// End-to-end task types: the dedup ones key on user_id through Config.Rules.
const (
	typeE2EPlain   = "e2e:plain"
	typeE2EReplace = "e2e:replace" // Replace while waiting, RunningDefer while running
	typeE2EReject  = "e2e:reject"  // Reject (the default policies)
)

// e2eVariant is one way of enqueueing the same stream of updates.
type e2eVariant struct {
	name, title, typ string
	dedup            bool
}

var e2eVariants = []e2eVariant{
	{"plain", "plain asynq", typeE2EPlain, false},
	{"replace", "dedup Replace", typeE2EReplace, true},
	{"reject", "dedup Reject", typeE2EReject, true},
}

// The two end-to-end modes.
const (
	modeBefore = "before" // all enqueued, then the server starts: time to drain
	modeLive   = "live"   // server already running: time from the first enqueue until drained
)

var modeTitles = map[string]string{
	modeBefore: "enqueued before workers start (time: server start → queue drained)",
	modeLive:   "server already running (time: first enqueue → queue drained)",
}

// e2eResult is one end-to-end run.
type e2eResult struct {
	enqueue   time.Duration // all producers done (live: counted from the first enqueue)
	drain     time.Duration // before: server start → drained; live: last enqueue → drained
	total     time.Duration // before: enqueue + drain; live: first enqueue → drained
	processed int64         // handler runs
	created   int64         // enqueues that created a task
	folded    int64         // replaced, merged or deferred into another task
	rejected  int64         // refused as duplicates
	errs      int64
	samples   []string
	cmds      int64 // commands through the shared client, enqueue start → drained
}

// key is what the speedup compares: processing time when the tasks were
// waiting before the workers started, the whole time when they run live.
func (r *e2eResult) key(mode string) time.Duration {
	if mode == modeBefore {
		return r.drain
	}
	return r.total
}

// runE2E enqueues cfg.e2eTasks updates over cfg.e2eKeys user_ids through
// variant v and measures how long an asynq server (Concurrency
// cfg.e2eWorkers, each task sleeping cfg.e2eWork) takes to work them off.
func (e *env) runE2E(ctx context.Context, mode string, v e2eVariant) (*e2eResult, error) {
	q := e.newQueue("e2e-" + mode + "-" + v.name)
	defer e.cleanupAfter(ctx, q)
	x := &e2eRun{e: e, mode: mode, v: v, q: q, r: &e2eResult{}}
	h := x.newServer()
	defer func() {
		if x.started {
			x.srv.Shutdown()
		}
	}()
	timed := x.timeBefore
	if mode != modeBefore {
		timed = x.timeLive
	}
	if err := timed(ctx, h); err != nil {
		return nil, err
	}
	x.r.processed = x.processed.Load()
	x.check(ctx)
	return x.r, ctx.Err()
}

// e2eRun is one end-to-end run under way.
type e2eRun struct {
	e         *env
	mode      string
	v         e2eVariant
	q         string
	r         *e2eResult
	mu        sync.Mutex // guards r.samples
	processed atomic.Int64
	srv       *asynq.Server
	started   bool // srv is started and must be shut down
}

// newServer sets up, without starting it, the asynq server working off
// x.q, and returns its handler (through dedup's middleware for a dedup
// variant).
func (x *e2eRun) newServer() asynq.Handler {
	var h asynq.Handler = asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		time.Sleep(x.e.cfg.e2eWork)
		x.processed.Add(1)
		return nil
	})
	if x.v.dedup {
		h = x.e.de2e.Middleware()(h)
	}
	x.srv = asynq.NewServerFromRedisClient(x.e.rdb, asynq.Config{
		Concurrency: x.e.cfg.e2eWorkers,
		Queues:      map[string]int{x.q: 1},
		// asynq's dispatcher sleeps this long (±50%) whenever it finds the
		// queue empty; its default, 1 s, would dominate the live mode.
		TaskCheckInterval:        x.e.cfg.e2eCheck,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		IsFailure:                dedup.IsFailure,
		LogLevel:                 asynq.WarnLevel,
		ShutdownTimeout:          10 * time.Second,
	})
	return h
}

// fail counts an unexpected outcome and keeps the first few.
func (x *e2eRun) fail(err error) {
	if atomic.AddInt64(&x.r.errs, 1) <= maxSamples {
		x.mu.Lock()
		x.r.samples = append(x.r.samples, err.Error())
		x.mu.Unlock()
	}
}

// timeBefore enqueues everything, then starts the server and times it until
// the queue is drained.
func (x *e2eRun) timeBefore(ctx context.Context, h asynq.Handler) error {
	before := x.e.cnt.cmds.Load()
	t0 := time.Now()
	x.enqueue(ctx)
	t1 := time.Now()
	x.r.enqueue = t1.Sub(t0)
	if err := x.srv.Start(h); err != nil {
		return fmt.Errorf("start server: %w", err)
	}
	x.started = true
	end, err := x.e.waitDrained(ctx, x.q)
	if err != nil {
		return err
	}
	x.r.drain, x.r.total = end.Sub(t1), end.Sub(t0)
	x.r.cmds = x.e.cnt.cmds.Load() - before
	return nil
}

// timeLive starts the server, then times from the first enqueue until the
// queue is drained.
func (x *e2eRun) timeLive(ctx context.Context, h asynq.Handler) error {
	if err := x.srv.Start(h); err != nil {
		return fmt.Errorf("start server: %w", err)
	}
	x.started = true
	time.Sleep(100 * time.Millisecond) // let the server settle into polling
	before := x.e.cnt.cmds.Load()
	t0 := time.Now()
	x.enqueue(ctx)
	t1 := time.Now()
	end, err := x.e.waitDrained(ctx, x.q)
	if err != nil {
		return err
	}
	x.r.enqueue, x.r.drain, x.r.total = t1.Sub(t0), end.Sub(t1), end.Sub(t0)
	x.r.cmds = x.e.cnt.cmds.Load() - before
	return nil
}

// enqueue runs cfg.e2eProducers goroutines until all cfg.e2eTasks updates
// are enqueued.
func (x *e2eRun) enqueue(ctx context.Context) {
	var wg sync.WaitGroup
	var next atomic.Int64
	pprof.Do(ctx, pprof.Labels("case", "e2e-"+x.v.name, "mode", x.mode), func(ctx context.Context) {
		for range x.e.cfg.e2eProducers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					i := next.Add(1) - 1
					if i >= int64(x.e.cfg.e2eTasks) {
						return
					}
					x.submit(ctx, i)
				}
			}()
		}
	})
	wg.Wait()
}

// submit enqueues update i and counts its outcome.
func (x *e2eRun) submit(ctx context.Context, i int64) {
	e, r := x.e, x.r
	task := asynq.NewTask(x.v.typ, payload(e.cfg.payload, i%int64(e.cfg.e2eKeys), traceOf(i)))
	if !x.v.dedup {
		if _, err := e.ac.EnqueueContext(ctx, task, asynq.Queue(x.q)); err != nil {
			x.fail(err)
		} else {
			atomic.AddInt64(&r.created, 1)
		}
		return
	}
	res, err := e.dc.Submit(ctx, task, asynq.Queue(x.q))
	var dup *dedup.DuplicateTaskError
	switch {
	case err == nil && res.Outcome == dedup.Created:
		atomic.AddInt64(&r.created, 1)
	case err == nil:
		atomic.AddInt64(&r.folded, 1)
	case errors.As(err, &dup) && x.v.name == "reject":
		atomic.AddInt64(&r.rejected, 1)
	case errors.As(err, &dup):
		// Replace should fold every update: a rejection loses one.
		atomic.AddInt64(&r.rejected, 1)
		x.fail(fmt.Errorf("update rejected under Replace: %w", err))
	default:
		x.fail(err)
	}
}

// check counts as unexpected what must hold, whatever the timing.
func (x *e2eRun) check(ctx context.Context) {
	r, v := x.r, x.v
	n, keys := int64(x.e.cfg.e2eTasks), int64(min(x.e.cfg.e2eKeys, x.e.cfg.e2eTasks))
	switch {
	case !v.dedup && r.processed != n:
		x.fail(fmt.Errorf("plain: %d tasks processed, want %d", r.processed, n))
	case v.dedup && x.mode == modeBefore && (r.processed != keys || r.created != keys):
		x.fail(fmt.Errorf("%s: %d created, %d processed, want one per key (%d)", v.title, r.created, r.processed, keys))
	case v.dedup && (r.processed < keys || r.processed > n):
		x.fail(fmt.Errorf("%s: %d processed, want between %d and %d", v.title, r.processed, keys, n))
	case r.created+r.folded+r.rejected+r.errs < n && ctx.Err() == nil:
		x.fail(fmt.Errorf("%s: only %d of %d enqueues accounted for", v.title, r.created+r.folded+r.rejected, n))
	}
}

// waitDrained polls q (on a separate client, so the polls are not counted)
// until nothing is pending, active, scheduled (Defer follow-ups park there)
// or waiting for a retry, and returns when it saw that.
func (e *env) waitDrained(ctx context.Context, q string) (time.Time, error) {
	deadline := time.Now().Add(e.cfg.e2eTimeout)
	pre := "asynq:{" + q + "}:"
	for {
		cmds, err := e.poll.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.LLen(ctx, pre+"pending")
			p.LLen(ctx, pre+"active")
			p.ZCard(ctx, pre+"scheduled")
			p.ZCard(ctx, pre+"retry")
			return nil
		})
		now := time.Now()
		if err != nil {
			return now, fmt.Errorf("polling queue %s: %w", q, err)
		}
		left := int64(0)
		for _, c := range cmds {
			left += c.(*redis.IntCmd).Val()
		}
		if left == 0 {
			return now, nil
		}
		if now.After(deadline) {
			return now, fmt.Errorf("queue %s not drained after %v: %d tasks left", q, e.cfg.e2eTimeout, left)
		}
		time.Sleep(time.Millisecond)
	}
}
