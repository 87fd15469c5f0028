package main

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Task types. The dedup cases key on the payload field user_id.
const (
	typePlain   = "bench:plain"
	typeUnique  = "bench:unique"
	typeDedup   = "bench:dedup"   // per-call dedup.Fields("user_id"), Reject
	typeReplace = "bench:replace" // Rule{Fields: user_id, OnConflict: Replace}
)

// env is what every case shares: one go-redis client (with the counting
// hook) under asynq's client, dedup's wrapper and the Inspector, as a real
// process would have.
type env struct {
	cfg   config
	rdb   *redis.Client
	cnt   *counter
	ac    *asynq.Client
	d     *dedup.Dedup
	dc    *dedup.Client
	wc    *dedup.Client // through asynq's client: the path of an asynq other than the pinned one
	insp  *asynq.Inspector
	de2e  *dedup.Dedup  // a second Dedup for the end-to-end servers (its heartbeat runs)
	poll  *redis.Client // client for polling queue lengths and INFO, counted apart (pcnt)
	pcnt  *counter
	runID string
	seq   atomic.Int64 // monotonic: distinct user_ids and trace_ids
	nq    atomic.Int64
}

// newQueue returns a queue name no other case or run uses.
func (e *env) newQueue(tag string) string {
	return fmt.Sprintf("dedupbench-%s-%s-%d", e.runID, tag, e.nq.Add(1))
}

// cleanup deletes everything a case created in queue q: asynq's queue (its
// task records and lists, with force) and then, by SCAN+UNLINK, what that
// leaves (asynq.Unique's locks, processed counters) and dedup's keys for q.
func (e *env) cleanup(ctx context.Context, q string) error {
	if err := e.insp.DeleteQueue(q, true); err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
		return fmt.Errorf("delete queue %s: %w", q, err)
	}
	for _, pat := range []string{"asynq:{" + q + "}:*", dedupPrefix + ":{" + q + "}:*"} {
		if _, err := unlinkMatching(ctx, e.rdb, pat); err != nil {
			return fmt.Errorf("unlink %s: %w", pat, err)
		}
	}
	return nil
}

// payload returns a JSON payload of exactly size bytes:
// {"user_id":N,"trace_id":"<16 hex>","pad":"xxx…"}.
func payload(size int, user int64, trace uint64) []byte {
	const hexd = "0123456789abcdef"
	b := make([]byte, 0, size)
	b = append(b, `{"user_id":`...)
	b = strconv.AppendInt(b, user, 10)
	b = append(b, `,"trace_id":"`...)
	for s := 60; s >= 0; s -= 4 {
		b = append(b, hexd[(trace>>uint(s))&15])
	}
	b = append(b, `","pad":"`...)
	for len(b) < size-2 {
		b = append(b, 'x')
	}
	return append(b, `"}`...)
}

// traceOf spreads a counter into a trace ID; fixedTrace is the one trace
// ID of key k, for payloads that must repeat byte for byte.
func traceOf(seq int64) uint64     { return uint64(seq) * 0x9E3779B97F4A7C15 }
func fixedTrace(k int64) uint64    { return uint64(k+1) * 0xC2B2AE3D27D4EB4F }
func (e *env) next() int64         { return e.seq.Add(1) }
func (e *env) key(seq int64) int64 { return seq % int64(e.cfg.keys) }

// caseDef is one throughput case. setup (optional) pre-enqueues into the
// case's fresh queue before the timed run; op is one timed call and returns
// an error only when the outcome is not the one the case expects.
type caseDef struct {
	name, title string
	opts        func(q string) []asynq.Option
	setup       func(ctx context.Context, e *env, opts []asynq.Option) error
	op          func(ctx context.Context, e *env, opts []asynq.Option) error
}

var errAccepted = errors.New("duplicate accepted")

func wantOutcome(res dedup.Result, err error, want dedup.Outcome) error {
	if err != nil {
		return err
	}
	if res.Outcome != want {
		return fmt.Errorf("outcome %v, want %v", res.Outcome, want)
	}
	return nil
}

func wantDuplicate(err error) error {
	var dup *dedup.DuplicateTaskError
	switch {
	case err == nil:
		return errAccepted
	case errors.As(err, &dup):
		return nil
	}
	return err
}

var allCases = []*caseDef{
	{
		name: "plain", title: "plain Enqueue",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q)} },
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next()
			_, err := e.ac.EnqueueContext(ctx, asynq.NewTask(typePlain, payload(e.cfg.payload, s, traceOf(s))), opts...)
			return err
		},
	},
	{
		name: "unique-new", title: "asynq.Unique new",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q), asynq.Unique(time.Hour)} },
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next()
			_, err := e.ac.EnqueueContext(ctx, asynq.NewTask(typeUnique, payload(e.cfg.payload, s, traceOf(s))), opts...)
			return err
		},
	},
	{
		name: "unique-dup", title: "asynq.Unique dup",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q), asynq.Unique(time.Hour)} },
		setup: func(ctx context.Context, e *env, opts []asynq.Option) error {
			return e.preEnqueue(ctx, func(k int64) error {
				_, err := e.ac.EnqueueContext(ctx, asynq.NewTask(typeUnique, payload(e.cfg.payload, k, fixedTrace(k))), opts...)
				return err
			})
		},
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			k := e.key(e.next())
			_, err := e.ac.EnqueueContext(ctx, asynq.NewTask(typeUnique, payload(e.cfg.payload, k, fixedTrace(k))), opts...)
			if errors.Is(err, asynq.ErrDuplicateTask) {
				return nil
			}
			if err == nil {
				return errAccepted
			}
			return err
		},
	},
	{
		name: "accepted", title: "dedup accepted",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q), dedup.Fields("user_id")} },
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next()
			res, err := e.dc.Submit(ctx, asynq.NewTask(typeDedup, payload(e.cfg.payload, s, traceOf(s))), opts...)
			return wantOutcome(res, err, dedup.Created)
		},
	},
	{
		name: "accepted-asynq", title: "dedup accepted, asynq's client",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q), dedup.Fields("user_id")} },
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next()
			res, err := e.wc.Submit(ctx, asynq.NewTask(typeDedup, payload(e.cfg.payload, s, traceOf(s))), opts...)
			return wantOutcome(res, err, dedup.Created)
		},
	},
	{
		name: "rejected", title: "dedup rejected",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q), dedup.Fields("user_id")} },
		setup: func(ctx context.Context, e *env, opts []asynq.Option) error {
			return e.preEnqueue(ctx, func(k int64) error {
				res, err := e.dc.Submit(ctx, asynq.NewTask(typeDedup, payload(e.cfg.payload, k, fixedTrace(k))), opts...)
				return wantOutcome(res, err, dedup.Created)
			})
		},
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next() // same user_id as a waiting task, a different trace_id
			_, err := e.dc.Submit(ctx, asynq.NewTask(typeDedup, payload(e.cfg.payload, e.key(s), traceOf(s))), opts...)
			return wantDuplicate(err)
		},
	},
	{
		name: "replaced", title: "dedup replaced",
		opts: func(q string) []asynq.Option { return []asynq.Option{asynq.Queue(q)} },
		setup: func(ctx context.Context, e *env, opts []asynq.Option) error {
			return e.preEnqueue(ctx, func(k int64) error {
				res, err := e.dc.Submit(ctx, asynq.NewTask(typeReplace, payload(e.cfg.payload, k, fixedTrace(k))), opts...)
				return wantOutcome(res, err, dedup.Created)
			})
		},
		op: func(ctx context.Context, e *env, opts []asynq.Option) error {
			s := e.next() // an update of a waiting task: its payload is rewritten
			res, err := e.dc.Submit(ctx, asynq.NewTask(typeReplace, payload(e.cfg.payload, e.key(s), traceOf(s))), opts...)
			return wantOutcome(res, err, dedup.Replaced)
		},
	},
}

// preEnqueue calls one(k) for every key k, 64 at a time.
func (e *env) preEnqueue(ctx context.Context, one func(k int64) error) error {
	return fanOut(ctx, int64(e.cfg.keys), 64, func(k int64) error {
		if err := one(k); err != nil {
			return fmt.Errorf("pre-enqueue key %d: %w", k, err)
		}
		return nil
	})
}

// fanOut calls one(i) for i from 0 to n-1 on the given number of
// goroutines, and returns the first error (or ctx's), after which no new
// calls start.
func fanOut(ctx context.Context, n int64, goroutines int, one func(i int64) error) error {
	var (
		wg    sync.WaitGroup
		next  atomic.Int64
		mu    sync.Mutex
		first error
	)
	for range goroutines {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := one(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					next.Store(n) // stop the others too
					return
				}
			}
		})
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// runResult is one timed run of one case at one concurrency.
type runResult struct {
	ops     int64
	elapsed time.Duration
	errs    int64
	samples []string
	cmds    counts
	h       *hist
	cpu     time.Duration // this process (client side: Go code, go-redis, GC)
	rcpu    time.Duration // Redis's main thread
	rcpuOK  bool          // both INFO cpu readings succeeded (else rcpu is 0)
}

func (r *runResult) opsPerSec() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.ops) / r.elapsed.Seconds()
}

// redisPerOp is Redis's main-thread CPU seconds per call, and false when the
// run has no usable reading (INFO failed, no calls, a counter that went back).
func (r *runResult) redisPerOp() (float64, bool) {
	if !r.rcpuOK || r.ops <= 0 || r.rcpu < 0 {
		return 0, false
	}
	return r.rcpu.Seconds() / float64(r.ops), true
}

const maxSamples = 5

// measure runs cd in a fresh queue with c goroutines for dur, after its
// setup, and deletes the queue's keys afterwards. Each goroutine loops over
// timed calls into its own histogram until the deadline.
func (e *env) measure(ctx context.Context, cd *caseDef, c int, dur time.Duration) (*runResult, error) {
	q := e.newQueue(cd.name)
	defer e.cleanupAfter(ctx, q)
	opts := cd.opts(q)
	if cd.setup != nil {
		if err := cd.setup(ctx, e, opts); err != nil {
			return nil, fmt.Errorf("%s: setup: %w", cd.title, err)
		}
	}
	w := newCallers(c)
	done := ctx.Done()
	pprof.Do(ctx, pprof.Labels("case", cd.name, "c", strconv.Itoa(c)), func(ctx context.Context) {
		w.spawn(done, func() error { return cd.op(ctx, e, opts) })
	})
	rcpu0, rerr := redisCPU(ctx, e.poll) // on the uncounted client
	before := e.cnt.snapshot()
	cpu0 := processCPU()
	t0 := time.Now()
	w.deadline = t0.Add(dur)
	close(w.start)
	w.wg.Wait()
	elapsed := time.Since(t0)
	cpu1 := processCPU()
	r := &runResult{elapsed: elapsed, errs: w.errs.Load(), samples: w.samples, cmds: e.cnt.snapshot().sub(before), h: new(hist), cpu: cpu1 - cpu0}
	if rcpu1, err := redisCPU(ctx, e.poll); err == nil && rerr == nil {
		r.rcpu, r.rcpuOK = rcpu1-rcpu0, true
	}
	for i := range c {
		r.ops += w.ops[i]
		r.h.merge(w.hs[i])
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}
	return r, nil
}

// cleanupAfter runs cleanup from a defer: it goes on when ctx was cancelled
// (an interrupt), gives up after a minute, and prints a failure, as there
// is no one left to return it to.
func (e *env) cleanupAfter(ctx context.Context, q string) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	if err := e.cleanup(cctx, q); err != nil {
		fmt.Fprintf(e.cfg.stderr, "dedupbench: cleanup: %v\n", err)
	}
}

// callers are the goroutines of one timed run. Each owns a histogram and a
// count, so they share only the error count and samples.
type callers struct {
	wg       sync.WaitGroup
	start    chan struct{}
	deadline time.Time // written before start is closed
	hs       []*hist
	ops      []int64
	errs     atomic.Int64
	mu       sync.Mutex
	samples  []string
}

func newCallers(c int) *callers {
	w := &callers{start: make(chan struct{}), hs: make([]*hist, c), ops: make([]int64, c)}
	for i := range w.hs {
		w.hs[i] = new(hist)
	}
	return w
}

// spawn starts one goroutine per histogram; each waits for start, then
// calls op until the deadline or until done is closed.
func (w *callers) spawn(done <-chan struct{}, op func() error) {
	for i := range w.hs {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			w.ops[i] = w.loop(w.hs[i], done, op)
		}()
	}
}

// loop is one goroutine's timed calls; it returns how many it made.
func (w *callers) loop(h *hist, done <-chan struct{}, op func() error) int64 {
	<-w.start
	var n int64
	for {
		select {
		case <-done:
			return n
		default:
		}
		t0 := time.Now()
		err := op()
		t1 := time.Now()
		h.record(t1.Sub(t0))
		n++
		if err != nil && w.errs.Add(1) <= maxSamples {
			w.mu.Lock()
			w.samples = append(w.samples, err.Error())
			w.mu.Unlock()
		}
		if !t1.Before(w.deadline) {
			return n
		}
	}
}
