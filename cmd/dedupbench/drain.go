package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// The worker side: -drain-tasks unique tasks (nothing to deduplicate) are
// enqueued first, untimed; then one asynq server works them off, timed from
// its start until the queue is empty. What the middleware costs shows as
// tasks/s and Redis main-thread CPU per task against the plain server's in
// the same round, and as commands, round trips and scripts per task through
// the shared client (the server's own polling and heartbeats included, on
// both sides).

// Task types of the drain case; each dedup one has its rule in newEnv.
const (
	typeDrainPlain    = "drain:plain"
	typeDrainReject   = "drain:reject"   // Rule{Fields: user_id}: the defaults
	typeDrainReplace  = "drain:replace"  // OnConflict Replace
	typeDrainDefer    = "drain:defer"    // OnConflict Replace, OnRunning RunningDefer
	typeDrainCooldown = "drain:cooldown" // Cooldown 1m
)

// drainRules are the rules of the drain case's task types.
var drainRules = map[string]dedup.Rule{
	typeDrainReject:   {Fields: []string{"user_id"}},
	typeDrainReplace:  {Fields: []string{"user_id"}, OnConflict: dedup.Replace},
	typeDrainDefer:    {Fields: []string{"user_id"}, OnConflict: dedup.Replace, OnRunning: dedup.RunningDefer},
	typeDrainCooldown: {Fields: []string{"user_id"}, Cooldown: time.Minute},
}

// drainVariant is one way of running the worker side.
type drainVariant struct {
	name, title, typ string
	viaDedup         bool // enqueued by the Dedup's client (else asynq's own: the execution guard keys them)
	middleware       bool
	unique           bool // enqueued with asynq.Unique (asynq's own lock, released by asynq's done script)
	wrapped          bool // enqueued by WrapClient over asynq's client (NewClient's path with an asynq other than the pinned one)
}

var drainVariants = []drainVariant{
	{"plain", "plain asynq server", typeDrainPlain, false, false, false, false},
	{"unique", "asynq.Unique, plain", typeDrainPlain, false, false, true, false},
	{"reject", "middleware, Reject", typeDrainReject, true, true, false, false},
	{"reject-asynq", "middleware, Reject, asynq's client", typeDrainReject, true, true, false, true},
	{"guard", "middleware, guard", typeDrainReject, false, true, false, false},
	{"replace", "middleware, Replace", typeDrainReplace, true, true, false, false},
	{"defer", "middleware, Defer", typeDrainDefer, true, true, false, false},
	{"cooldown", "middleware, Cooldown", typeDrainCooldown, true, true, false, false},
}

// drainNames are the names of drainVariants.
func drainNames() []string {
	names := make([]string, len(drainVariants))
	for i, v := range drainVariants {
		names[i] = v.name
	}
	return names
}

// drainResult is one drain.
type drainResult struct {
	tasks     int64
	drain     time.Duration
	redisCPU  time.Duration // Redis main thread, over the drain; 0 if unread
	cnt       counts        // through the shared client, over the drain
	lib       int64         // Redis's commands less the counted clients' calls (scripts' inner commands, the library's own client's calls), over the drain; -1 if unread
	processed int64
	errs      int64
	samples   []string
}

// runDrain enqueues cfg.drainTasks unique tasks of variant v, then times an
// asynq server working them off.
func (e *env) runDrain(ctx context.Context, v drainVariant) (*drainResult, error) {
	q := e.newQueue("drain-" + v.name)
	defer e.cleanupAfter(ctx, q)
	r := &drainResult{tasks: int64(e.cfg.drainTasks)}
	if err := e.fillDrain(ctx, q, v, r); err != nil {
		return nil, err
	}
	var processed atomic.Int64
	var h asynq.Handler = asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		if e.cfg.drainWork > 0 {
			time.Sleep(e.cfg.drainWork)
		}
		processed.Add(1)
		return nil
	})
	if v.middleware {
		h = e.de2e.Middleware()(h)
	}
	srv := asynq.NewServerFromRedisClient(e.rdb, asynq.Config{
		Concurrency:       e.cfg.drainWorkers,
		Queues:            map[string]int{q: 1},
		TaskCheckInterval: e.cfg.e2eCheck,
		IsFailure:         dedup.IsFailure,
		LogLevel:          asynq.WarnLevel,
		ShutdownTimeout:   10 * time.Second,
	})
	err := e.timeDrain(ctx, q, srv, h, r)
	srv.Shutdown()
	r.processed = processed.Load()
	if err == nil && r.processed != r.tasks {
		r.fail(fmt.Errorf("%s: %d tasks processed, want %d", v.title, r.processed, r.tasks))
	}
	return r, err
}

// timeDrain starts srv and times it until q is drained, reading Redis's CPU
// and the shared client's counts on both ends.
func (e *env) timeDrain(ctx context.Context, q string, srv *asynq.Server, h asynq.Handler, r *drainResult) error {
	cpu0, cerr := redisCPU(ctx, e.poll)
	tot0, terr := redisCommands(ctx, e.poll)
	c0, p0 := e.cnt.snapshot(), e.pcnt.snapshot()
	t0 := time.Now()
	if err := srv.Start(h); err != nil {
		return fmt.Errorf("start server: %w", err)
	}
	end, err := e.waitDrained(ctx, q)
	if err != nil {
		return err
	}
	r.drain = end.Sub(t0)
	r.cnt = e.cnt.snapshot().sub(c0)
	if cpu1, err := redisCPU(ctx, e.poll); err == nil && cerr == nil {
		r.redisCPU = cpu1 - cpu0
	}
	// Redis counts every client's commands, and every command a script
	// runs; the shared client's (asynq's, and the library's when it uses
	// that client) and the poll client's calls are counted here: the rest
	// are the scripts' commands and the library's own client's calls.
	r.lib = -1
	if tot1, err := redisCommands(ctx, e.poll); err == nil && terr == nil {
		r.lib = (tot1 - tot0) - r.cnt.cmds - e.pcnt.snapshot().sub(p0).cmds
	}
	return nil
}

// fillDrain enqueues the drain's tasks, each of its own user_id, by
// cfg.e2eProducers goroutines.
func (e *env) fillDrain(ctx context.Context, q string, v drainVariant, r *drainResult) error {
	return fanOut(ctx, r.tasks, e.cfg.e2eProducers, func(i int64) error {
		task := asynq.NewTask(v.typ, payload(e.cfg.payload, e.seq.Add(1), traceOf(i)))
		var err error
		switch {
		case v.wrapped:
			_, err = e.wc.EnqueueContext(ctx, task, asynq.Queue(q))
		case v.viaDedup:
			_, err = e.dc.EnqueueContext(ctx, task, asynq.Queue(q))
		case v.unique:
			_, err = e.ac.EnqueueContext(ctx, task, asynq.Queue(q), asynq.Unique(time.Hour))
		default:
			_, err = e.ac.EnqueueContext(ctx, task, asynq.Queue(q))
		}
		if err != nil {
			return fmt.Errorf("enqueue for the drain: %w", err)
		}
		return nil
	})
}

// fail counts an unexpected outcome and keeps the first few.
func (r *drainResult) fail(err error) {
	r.errs++
	if len(r.samples) < maxSamples {
		r.samples = append(r.samples, err.Error())
	}
}

// drainRound runs round r of the drain variants into runs.
func (e *env) drainRound(ctx context.Context, r int, runs map[string][]*drainResult) error {
	for j := range e.cfg.drains {
		v := e.cfg.drains[(j+r)%len(e.cfg.drains)]
		res, err := e.runDrain(ctx, v)
		if err != nil {
			return fmt.Errorf("round %d, drain, %s: %w", r+1, v.title, err)
		}
		runs[v.name] = append(runs[v.name], res)
		e.cfg.progress("round %d/%d  drain %-22s %7s tasks/s  redis %6.1f µs/task  scripts/task %.2f  rtt/task %.2f  errors %d",
			r+1, e.cfg.rounds, v.title, commas(int64(res.perSec())), res.redisUsPerTask(), res.scriptsPerTask(), res.perTask(res.cnt.rtts), res.errs)
	}
	return nil
}

func (r *drainResult) perSec() float64 {
	if r.drain <= 0 {
		return 0
	}
	return float64(r.tasks) / r.drain.Seconds()
}

func (r *drainResult) perTask(n int64) float64 { return float64(n) / float64(max(r.tasks, 1)) }

func (r *drainResult) redisUsPerTask() float64 {
	return float64(r.redisCPU.Microseconds()) / float64(max(r.tasks, 1))
}

// scriptsPerTask counts the script calls (EVALSHA, and EVAL after a
// NOSCRIPT) per task: asynq's own (dequeue, done) as well as the
// middleware's, so the plain server's count is the baseline.
func (r *drainResult) scriptsPerTask() float64 {
	return r.perTask(r.cnt.byName["evalsha"] + r.cnt.byName["eval"])
}

// drainSummary is one drain variant over all rounds.
type drainSummary struct {
	Variant         string    `json:"variant"`
	Title           string    `json:"title"`
	TasksPerSec     float64   `json:"tasks_per_sec"` // median over rounds
	Ratio           *float64  `json:"ratio,omitempty"`
	RatioRounds     []float64 `json:"ratio_rounds,omitempty"` // tasks/s ÷ the plain server's, round by round
	RedisUsPerTask  float64   `json:"redis_cpu_us_per_task"`
	RCPURatio       *float64  `json:"redis_cpu_ratio,omitempty"`
	RCPURatioRounds []float64 `json:"redis_cpu_ratio_rounds,omitempty"`
	ScriptsPerTask  float64   `json:"scripts_per_task"`
	CmdsPerTask     float64   `json:"cmds_per_task"`
	RttsPerTask     float64   `json:"round_trips_per_task"`
	LibPerTask      *float64  `json:"library_cmds_per_task,omitempty"` // the library's own client's commands; nil unread
	Errors          int64     `json:"errors"`
	ErrorSamples    []string  `json:"error_samples,omitempty"`
}

// summarizeDrain sums up variant v's rounds rs; plain holds the plain
// server's, for the ratios round by round.
func summarizeDrain(v drainVariant, rs, plain []*drainResult) drainSummary {
	s := drainSummary{Variant: v.name, Title: v.title}
	var tps, cpu, scripts, cmds, rtts, lib []float64
	for i, r := range rs {
		if r.lib >= 0 {
			lib = append(lib, r.perTask(r.lib))
		}
		tps = append(tps, r.perSec())
		cpu = append(cpu, r.redisUsPerTask())
		scripts = append(scripts, r.scriptsPerTask())
		cmds = append(cmds, r.perTask(r.cnt.cmds))
		rtts = append(rtts, r.perTask(r.cnt.rtts))
		s.Errors += r.errs
		s.ErrorSamples = append(s.ErrorSamples, r.samples...)
		if i >= len(plain) {
			continue
		}
		if p := plain[i].perSec(); p > 0 {
			s.RatioRounds = append(s.RatioRounds, r.perSec()/p)
		}
		if p := plain[i].redisUsPerTask(); p > 0 && r.redisCPU > 0 {
			s.RCPURatioRounds = append(s.RCPURatioRounds, r.redisUsPerTask()/p)
		}
	}
	s.TasksPerSec, s.RedisUsPerTask = median(tps), median(cpu)
	s.ScriptsPerTask, s.CmdsPerTask, s.RttsPerTask = median(scripts), median(cmds), median(rtts)
	if len(lib) > 0 {
		s.LibPerTask = ptr(median(lib))
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

// summarizeDrains sums up the drains' rounds into rep.
func (rep *report) summarizeDrains(cfg config, runs map[string][]*drainResult) {
	if len(runs) == 0 {
		return
	}
	rep.DrainConfig = &drainConfig{Tasks: cfg.drainTasks, Workers: cfg.drainWorkers, Work: cfg.drainWork.String(), CheckIvl: cfg.e2eCheck.String()}
	for _, v := range cfg.drains {
		s := summarizeDrain(v, runs[v.name], runs["plain"])
		rep.Errors += s.Errors
		rep.Drain = append(rep.Drain, s)
	}
}

// writeDrain writes the drain table and returns the error samples.
func (rep *report) writeDrain(w io.Writer, cfg config) (errs []string) {
	fmt.Fprintf(w, "\nworker side: %s unique tasks enqueued first, then one asynq server (Concurrency %d, handler %s, TaskCheckInterval %v)\n"+
		"works them off; tasks/s and Redis main-thread CPU per task over the drain, ratios to the plain server's in the same round\n"+
		"(medians of %d rounds, range min–max); per task through the shared client: script calls (asynq's own included), commands, round trips;\n"+
		"lib: Redis's commands per task less the counted clients' own calls: the commands run inside scripts (asynq's too: a plain server's are the floor) and the library's own client's calls\n",
		commas(int64(cfg.drainTasks)), cfg.drainWorkers, workDesc(cfg.drainWork), cfg.e2eCheck, rep.Meta.Rounds)
	fmt.Fprintf(w, "  %-22s %8s %5s %-12s %9s %9s %-12s %8s %8s %8s %6s\n", "", "tasks/s", "ratio", " (range)", "rds µs", "rds ratio", " (range)", "scripts", "cmds", "rtts", "lib")
	for _, s := range rep.Drain {
		ratio, rng := fmtRounds(s.Ratio, s.RatioRounds)
		cr, crng := fmtRounds(s.RCPURatio, s.RCPURatioRounds)
		lib := "-"
		if s.LibPerTask != nil {
			lib = fmt.Sprintf("%.3f", *s.LibPerTask)
		}
		fmt.Fprintf(w, "  %-22s %8s %5s %-12s %9.1f %9s %-12s %8.2f %8.2f %8.2f %6s\n", s.Title, commas(int64(s.TasksPerSec)), ratio, rng,
			s.RedisUsPerTask, cr, crng, s.ScriptsPerTask, s.CmdsPerTask, s.RttsPerTask, lib)
		for _, e := range s.ErrorSamples {
			errs = append(errs, fmt.Sprintf("drain %s: %s", s.Title, e))
		}
	}
	return errs
}

func workDesc(d time.Duration) string {
	if d <= 0 {
		return "no-op"
	}
	return "sleeps " + d.String()
}

// fmtRounds is fmtRatio of a median and the rounds it was taken over.
func fmtRounds(med *float64, rounds []float64) (ratio, rng string) {
	if len(rounds) == 0 {
		return fmtRatio(med, nil, nil, 0)
	}
	return fmtRatio(med, ptr(slices.Min(rounds)), ptr(slices.Max(rounds)), len(rounds))
}
