package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// The batch case: -batch-runs calls of -batch-size tasks of new keys
// through Client.EnqueueBatch, against the same tasks Submitted one after
// another, both through NewClient with dedup.Fields("user_id") from one
// goroutine, interleaved round by round. Reported side by side: tasks/s,
// Redis main-thread CPU per task, this process's CPU and round trips per
// task, and the batch's ratios to the Submits' in the same round.

// batchVariant is one way of enqueueing the tasks.
type batchVariant struct {
	name, title string
	batched     bool
}

var batchVariants = []batchVariant{
	{"sequential", "Submit, one by one", false},
	{"batch", "EnqueueBatch", true},
}

// batchResult is one run of a variant.
type batchResult struct {
	tasks    int64
	elapsed  time.Duration
	cpu      time.Duration // this process
	redisCPU time.Duration // Redis main thread
	rcpuOK   bool          // both INFO cpu readings succeeded
	cnt      counts        // through the shared client
	errs     int64
	samples  []string
}

// runBatch times cfg.batchRuns calls of cfg.batchSize new tasks of variant
// v in a fresh queue (the tasks made first, untimed).
func (e *env) runBatch(ctx context.Context, v batchVariant) (*batchResult, error) {
	q := e.newQueue("batch-" + v.name)
	defer e.cleanupAfter(ctx, q)
	opts := []asynq.Option{asynq.Queue(q), dedup.Fields("user_id")}
	// The queue's first enqueue registers it (once per process): untimed.
	if res, err := e.dc.Submit(ctx, e.newTask(), opts...); err != nil || res.Outcome != dedup.Created {
		return nil, fmt.Errorf("%s: first enqueue: %v, %w", v.title, res.Outcome, err)
	}
	calls := make([][]*asynq.Task, e.cfg.batchRuns)
	for i := range calls {
		calls[i] = make([]*asynq.Task, e.cfg.batchSize)
		for j := range calls[i] {
			calls[i][j] = e.newTask()
		}
	}
	r := &batchResult{tasks: int64(e.cfg.batchRuns * e.cfg.batchSize)}
	rcpu0, rerr := redisCPU(ctx, e.poll) // on the uncounted client
	c0, cpu0, t0 := e.cnt.snapshot(), processCPU(), time.Now()
	for _, tasks := range calls {
		e.enqueueAll(ctx, v, tasks, opts, r)
	}
	r.elapsed, r.cpu, r.cnt = time.Since(t0), processCPU()-cpu0, e.cnt.snapshot().sub(c0)
	if rcpu1, err := redisCPU(ctx, e.poll); err == nil && rerr == nil {
		r.redisCPU, r.rcpuOK = rcpu1-rcpu0, true
	}
	return r, ctx.Err()
}

// newTask is a task of the batch case: a new user_id, a new trace.
func (e *env) newTask() *asynq.Task {
	s := e.next()
	return asynq.NewTask(typeDedup, payload(e.cfg.payload, s, traceOf(s)))
}

// enqueueAll enqueues tasks as variant v does, every one expected created.
func (e *env) enqueueAll(ctx context.Context, v batchVariant, tasks []*asynq.Task, opts []asynq.Option, r *batchResult) {
	if v.batched {
		for _, res := range e.dc.EnqueueBatch(ctx, tasks, opts...) {
			if err := wantOutcome(res.Result, res.Err, dedup.Created); err != nil {
				r.fail(err)
			}
		}
		return
	}
	for _, task := range tasks {
		res, err := e.dc.Submit(ctx, task, opts...)
		if err := wantOutcome(res, err, dedup.Created); err != nil {
			r.fail(err)
		}
	}
}

// fail counts an unexpected outcome and keeps the first few.
func (r *batchResult) fail(err error) {
	r.errs++
	if len(r.samples) < maxSamples {
		r.samples = append(r.samples, err.Error())
	}
}

func (r *batchResult) perSec() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.tasks) / r.elapsed.Seconds()
}

func (r *batchResult) perTask(n int64) float64 { return float64(n) / float64(max(r.tasks, 1)) }

func (r *batchResult) usPerTask(d time.Duration) float64 {
	return float64(d.Nanoseconds()) / 1e3 / float64(max(r.tasks, 1))
}

// batchRound runs round r of the batch variants into runs.
func (e *env) batchRound(ctx context.Context, r int, runs map[string][]*batchResult) error {
	for j := range batchVariants {
		v := batchVariants[(j+r)%len(batchVariants)]
		res, err := e.runBatch(ctx, v)
		if err != nil {
			return fmt.Errorf("round %d, batch, %s: %w", r+1, v.title, err)
		}
		runs[v.name] = append(runs[v.name], res)
		e.cfg.progress("round %d/%d  batch %-20s %8s tasks/s  redis %6.2f µs/task  client %6.2f µs/task  rtt/task %.4f  errors %d",
			r+1, e.cfg.rounds, v.title, commas(int64(res.perSec())), res.usPerTask(res.redisCPU), res.usPerTask(res.cpu), res.perTask(res.cnt.rtts), res.errs)
	}
	return nil
}

// batchSummary is one batch variant over all rounds.
type batchSummary struct {
	Variant         string    `json:"variant"`
	Title           string    `json:"title"`
	TasksPerSec     float64   `json:"tasks_per_sec"` // median over rounds
	Ratio           *float64  `json:"ratio,omitempty"`
	RatioRounds     []float64 `json:"ratio_rounds,omitempty"` // tasks/s ÷ the sequential Submits', round by round
	RedisUsPerTask  float64   `json:"redis_cpu_us_per_task"`
	RCPURatio       *float64  `json:"redis_cpu_ratio,omitempty"`
	RCPURatioRounds []float64 `json:"redis_cpu_ratio_rounds,omitempty"`
	ClientUsPerTask float64   `json:"client_cpu_us_per_task"`
	CmdsPerTask     float64   `json:"cmds_per_task"`
	RttsPerTask     float64   `json:"round_trips_per_task"`
	Errors          int64     `json:"errors"`
	ErrorSamples    []string  `json:"error_samples,omitempty"`
}

type batchConfig struct {
	Size int `json:"batch_size"`
	Runs int `json:"calls_per_run"`
}

// summarizeBatch sums up variant v's rounds rs; seq holds the sequential
// Submits', for the ratios round by round.
func summarizeBatch(v batchVariant, rs, seq []*batchResult) batchSummary {
	s := batchSummary{Variant: v.name, Title: v.title}
	var tps, rcpu, cpu, cmds, rtts []float64
	for i, r := range rs {
		tps, cpu = append(tps, r.perSec()), append(cpu, r.usPerTask(r.cpu))
		cmds, rtts = append(cmds, r.perTask(r.cnt.cmds)), append(rtts, r.perTask(r.cnt.rtts))
		if r.rcpuOK {
			rcpu = append(rcpu, r.usPerTask(r.redisCPU))
		}
		s.Errors += r.errs
		s.ErrorSamples = append(s.ErrorSamples, r.samples...)
		if i >= len(seq) {
			continue
		}
		if p := seq[i].perSec(); p > 0 {
			s.RatioRounds = append(s.RatioRounds, r.perSec()/p)
		}
		if p := seq[i].usPerTask(seq[i].redisCPU); p > 0 && r.rcpuOK && seq[i].rcpuOK {
			s.RCPURatioRounds = append(s.RCPURatioRounds, r.usPerTask(r.redisCPU)/p)
		}
	}
	s.TasksPerSec, s.ClientUsPerTask, s.CmdsPerTask, s.RttsPerTask = median(tps), median(cpu), median(cmds), median(rtts)
	if len(rcpu) > 0 {
		s.RedisUsPerTask = median(rcpu)
	}
	if len(s.RatioRounds) > 0 {
		s.Ratio = ptr(median(s.RatioRounds))
	}
	if len(s.RCPURatioRounds) > 0 {
		s.RCPURatio = ptr(median(s.RCPURatioRounds))
	}
	s.ErrorSamples = s.ErrorSamples[:min(len(s.ErrorSamples), maxSamples)]
	return s
}

// summarizeBatches sums up the batch case's rounds into rep.
func (rep *report) summarizeBatches(cfg config, runs map[string][]*batchResult) {
	if len(runs) == 0 {
		return
	}
	rep.BatchConfig = &batchConfig{Size: cfg.batchSize, Runs: cfg.batchRuns}
	for _, v := range batchVariants {
		s := summarizeBatch(v, runs[v.name], runs["sequential"])
		rep.Errors += s.Errors
		rep.Batch = append(rep.Batch, s)
	}
}

// writeBatch writes the batch table and returns the error samples.
func (rep *report) writeBatch(w io.Writer, cfg config) (errs []string) {
	fmt.Fprintf(w, "\nbatch: %d calls of %s tasks of new keys through NewClient (dedup.Fields(\"user_id\")), one goroutine, per run:\n"+
		"EnqueueBatch against the same tasks Submitted one by one; tasks/s, Redis main-thread and this process's CPU per task, round trips\n"+
		"per task through the shared client; ratios to the Submits' in the same round (medians of %d rounds, range min–max)\n",
		cfg.batchRuns, commas(int64(cfg.batchSize)), rep.Meta.Rounds)
	fmt.Fprintf(w, "  %-20s %9s %6s %-14s %10s %9s %-14s %10s %10s\n", "", "tasks/s", "ratio", " (range)", "rds µs/tsk", "rds ratio", " (range)", "cli µs/tsk", "rtts/task")
	for _, s := range rep.Batch {
		ratio, rng := fmtRounds(s.Ratio, s.RatioRounds)
		cr, crng := fmtRounds(s.RCPURatio, s.RCPURatioRounds)
		fmt.Fprintf(w, "  %-20s %9s %6s %-14s %10.2f %9s %-14s %10.2f %10.4f\n", s.Title, commas(int64(s.TasksPerSec)), ratio, rng,
			s.RedisUsPerTask, cr, crng, s.ClientUsPerTask, s.RttsPerTask)
		for _, e := range s.ErrorSamples {
			errs = append(errs, fmt.Sprintf("batch %s: %s", s.Title, e))
		}
	}
	return errs
}
