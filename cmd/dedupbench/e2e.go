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
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := e.cleanup(cctx, q); err != nil {
			fmt.Fprintf(e.cfg.stderr, "dedupbench: cleanup: %v\n", err)
		}
	}()
	var processed atomic.Int64
	var h asynq.Handler = asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		time.Sleep(e.cfg.e2eWork)
		processed.Add(1)
		return nil
	})
	if v.dedup {
		h = e.de2e.Middleware()(h)
	}
	srv := asynq.NewServerFromRedisClient(e.rdb, asynq.Config{
		Concurrency: e.cfg.e2eWorkers,
		Queues:      map[string]int{q: 1},
		// asynq's dispatcher sleeps this long (±50%) whenever it finds the
		// queue empty; its default, 1 s, would dominate the live mode.
		TaskCheckInterval:        e.cfg.e2eCheck,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		IsFailure:                dedup.IsFailure,
		LogLevel:                 asynq.WarnLevel,
		ShutdownTimeout:          10 * time.Second,
	})
	started := false
	defer func() {
		if started {
			srv.Shutdown()
		}
	}()

	r := &e2eResult{}
	var mu sync.Mutex
	fail := func(err error) {
		if atomic.AddInt64(&r.errs, 1) <= maxSamples {
			mu.Lock()
			r.samples = append(r.samples, err.Error())
			mu.Unlock()
		}
	}
	enqueue := func() {
		var wg sync.WaitGroup
		var next atomic.Int64
		pprof.Do(ctx, pprof.Labels("case", "e2e-"+v.name, "mode", mode), func(ctx context.Context) {
			for range e.cfg.e2eProducers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for ctx.Err() == nil {
						i := next.Add(1) - 1
						if i >= int64(e.cfg.e2eTasks) {
							return
						}
						task := asynq.NewTask(v.typ, payload(e.cfg.payload, i%int64(e.cfg.e2eKeys), traceOf(i)))
						if !v.dedup {
							if _, err := e.ac.EnqueueContext(ctx, task, asynq.Queue(q)); err != nil {
								fail(err)
							} else {
								atomic.AddInt64(&r.created, 1)
							}
							continue
						}
						res, err := e.dc.Submit(ctx, task, asynq.Queue(q))
						var dup *dedup.DuplicateTaskError
						switch {
						case err == nil && res.Outcome == dedup.Created:
							atomic.AddInt64(&r.created, 1)
						case err == nil:
							atomic.AddInt64(&r.folded, 1)
						case errors.As(err, &dup) && v.name == "reject":
							atomic.AddInt64(&r.rejected, 1)
						case errors.As(err, &dup):
							// Replace should fold every update: a rejection loses one.
							atomic.AddInt64(&r.rejected, 1)
							fail(fmt.Errorf("update rejected under Replace: %w", err))
						default:
							fail(err)
						}
					}
				}()
			}
		})
		wg.Wait()
	}

	before := e.cnt.cmds.Load()
	t0 := time.Now()
	if mode == modeBefore {
		enqueue()
		t1 := time.Now()
		r.enqueue = t1.Sub(t0)
		if err := srv.Start(h); err != nil {
			return nil, fmt.Errorf("start server: %w", err)
		}
		started = true
		end, err := e.waitDrained(ctx, q)
		if err != nil {
			return nil, err
		}
		r.drain, r.total = end.Sub(t1), end.Sub(t0)
	} else {
		if err := srv.Start(h); err != nil {
			return nil, fmt.Errorf("start server: %w", err)
		}
		started = true
		time.Sleep(100 * time.Millisecond) // let the server settle into polling
		before = e.cnt.cmds.Load()
		t0 = time.Now()
		enqueue()
		t1 := time.Now()
		end, err := e.waitDrained(ctx, q)
		if err != nil {
			return nil, err
		}
		r.enqueue, r.drain, r.total = t1.Sub(t0), end.Sub(t1), end.Sub(t0)
	}
	r.cmds = e.cnt.cmds.Load() - before
	r.processed = processed.Load()

	// What must hold, whatever the timing.
	n, keys := int64(e.cfg.e2eTasks), int64(min(e.cfg.e2eKeys, e.cfg.e2eTasks))
	switch {
	case !v.dedup && r.processed != n:
		fail(fmt.Errorf("plain: %d tasks processed, want %d", r.processed, n))
	case v.dedup && mode == modeBefore && (r.processed != keys || r.created != keys):
		fail(fmt.Errorf("%s: %d created, %d processed, want one per key (%d)", v.title, r.created, r.processed, keys))
	case v.dedup && (r.processed < keys || r.processed > n):
		fail(fmt.Errorf("%s: %d processed, want between %d and %d", v.title, r.processed, keys, n))
	case r.created+r.folded+r.rejected+r.errs < n && ctx.Err() == nil:
		fail(fmt.Errorf("%s: only %d of %d enqueues accounted for", v.title, r.created+r.folded+r.rejected, n))
	}
	return r, ctx.Err()
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
