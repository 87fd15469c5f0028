// Command dedupbench measures what deduplication costs and saves, against a
// real redis-server on loopback, in one process, with every case and its
// baseline interleaved:
//
//  1. plain asynq Client.Enqueue (the baseline of every ratio);
//  2. Enqueue with asynq.Unique(time.Hour), every payload new;
//  3. asynq.Unique, every payload a duplicate of a waiting task;
//  4. this library (dedup.Fields("user_id")), every enqueue accepted;
//  5. every enqueue rejected as a duplicate of a waiting task;
//  6. every enqueue replaces (Rule{OnConflict: Replace}): the waiting
//     task's payload is rewritten;
//  7. end to end: 10,000 enqueues over 1,000 user_ids worked off by an asynq
//     server whose handler sleeps 1 ms, plain asynq (10,000 tasks) against
//     dedup Replace and dedup Reject (1,000 tasks). Two modes: "before", all
//     enqueued before the server starts, timed from server start until the
//     queue is drained; "live", the server already running, timed from the
//     first enqueue until the queue is drained;
//  8. the worker side (-cases drain): unique tasks worked off by one server,
//     with and without the middleware (drain.go);
//  9. a batch (-cases batch): Client.EnqueueBatch of -batch-size new keys
//     against the same tasks Submitted one by one (batch.go).
//
// Cases 1–6 run at each concurrency (-c) for -duration per round; each round
// visits every case once (the order rotates), and a ratio is the case's ops/s
// over plain Enqueue's in the same round at the same concurrency, reported as
// the median over rounds (with its range); so is the Redis CPU ratio, the
// case's Redis main-thread CPU per call over plain Enqueue's, which bounds
// a Redis shared by many producers. p50/p99 come from all rounds'
// latencies; cmds/op counts the commands the shared go-redis client sent
// (a hook on it), per call.
//
// Without -redis it starts its own redis-server (--save "" --appendonly no)
// on a free 127.0.0.1 port and kills it at exit. Every case uses a queue of
// its own and deletes that queue's keys when it is done (asynq Inspector
// DeleteQueue with force, then SCAN+UNLINK of what remains and of dedup's
// keys for it), so a Redis given with -redis is never flushed.
//
//	go run ./cmd/dedupbench                        # defaults: 2s × 3 rounds, c=1,64
//	go run ./cmd/dedupbench -rounds 5 -json > out.json
//	go run ./cmd/dedupbench -cases accepted -c 64 -cpuprofile cpu.out
//
// It exits with status 1 if any call had an unexpected outcome (they are
// printed), 2 on a usage or setup error.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// dedupPrefix is the key prefix of the benchmark's Dedup.
const dedupPrefix = "dedupbench"

type config struct {
	redisAddr   string
	duration    time.Duration
	warmup      time.Duration
	rounds      int
	conc        []int
	cases       []string // selected case names, in table order
	jsonOut     bool
	cpuprofile  string
	keys        int
	payload     int
	pool        int
	ctxTimeouts bool
	maxBatch    int
	verbose     bool
	quiet       bool

	e2eTasks, e2eKeys, e2eWorkers, e2eProducers int
	e2eWork, e2eCheck, e2eTimeout               time.Duration
	e2eModes                                    []string

	drainTasks, drainWorkers int
	drainWork                time.Duration
	drains                   []drainVariant // the drain's variants, plain first

	batchSize, batchRuns int

	stdout, stderr io.Writer
}

func (c *config) has(name string) bool { return slices.Contains(c.cases, name) }

func caseNames() []string {
	names := make([]string, 0, len(allCases)+1)
	for _, cd := range allCases {
		names = append(names, cd.name)
	}
	return append(names, "e2e", "drain", "batch")
}

// listFlags are the flags that take a comma-separated list, split after
// parsing.
type listFlags struct{ conc, cases, modes, drains *string }

func parseFlags(args []string, stdout, stderr io.Writer) (config, error) {
	cfg := config{stdout: stdout, stderr: stderr}
	fs := flag.NewFlagSet("dedupbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	lists := cfg.define(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if cfg.conc, err = parseConc(*lists.conc); err != nil {
		return cfg, err
	}
	if cfg.cases, err = parseCases(*lists.cases); err != nil {
		return cfg, err
	}
	if cfg.e2eModes, err = parseModes(*lists.modes); err != nil {
		return cfg, err
	}
	if cfg.drains, err = parseDrains(*lists.drains); err != nil {
		return cfg, err
	}
	return cfg, cfg.check()
}

// define defines the flags on fs, into c.
func (c *config) define(fs *flag.FlagSet) listFlags {
	fs.StringVar(&c.redisAddr, "redis", "", "Redis `address` (host:port or redis:// URL); default: start a redis-server on a free loopback port")
	fs.DurationVar(&c.duration, "duration", 2*time.Second, "timed run of each case, per concurrency and round")
	fs.DurationVar(&c.warmup, "warmup", 500*time.Millisecond, "untimed run of each case before the first round (0: none)")
	fs.IntVar(&c.rounds, "rounds", 3, "rounds; each runs every case once, interleaved")
	conc := fs.String("c", "1,64", "comma-separated `list` of concurrencies (goroutines calling Enqueue)")
	cases := fs.String("cases", "all", "comma-separated cases to run: all or "+strings.Join(caseNames(), ","))
	fs.BoolVar(&c.jsonOut, "json", false, "print the results as JSON instead of a table")
	fs.StringVar(&c.cpuprofile, "cpuprofile", "", "write a CPU profile of the timed rounds to `file` (samples are labelled case=…, c=…)")
	fs.IntVar(&c.keys, "keys", 1000, "keys pre-enqueued for the duplicate, rejected and replaced cases")
	fs.IntVar(&c.payload, "payload", 200, "payload size in `bytes` (JSON)")
	fs.IntVar(&c.pool, "pool", 0, "go-redis PoolSize of the shared client (0: max(c, e2e producers) + e2e workers + 16)")
	fs.BoolVar(&c.ctxTimeouts, "ctx-timeouts", false, "set go-redis ContextTimeoutEnabled on the shared client (go-redis's default is off)")
	fs.IntVar(&c.maxBatch, "max-batch", 0, "dedup Config.MaxBatch (0: the library's default; -1: no batching)")
	fs.BoolVar(&c.verbose, "v", false, "also print the commands per call by name, and per-round numbers")
	fs.BoolVar(&c.quiet, "q", false, "no progress lines on stderr")
	fs.IntVar(&c.e2eTasks, "e2e-tasks", 10_000, "end to end: enqueues")
	fs.IntVar(&c.e2eKeys, "e2e-keys", 1_000, "end to end: distinct user_ids they are spread over")
	fs.DurationVar(&c.e2eWork, "e2e-work", time.Millisecond, "end to end: simulated work per task (sleep)")
	fs.IntVar(&c.e2eWorkers, "e2e-workers", 64, "end to end: asynq server Concurrency")
	fs.IntVar(&c.e2eProducers, "e2e-producers", 64, "end to end: goroutines enqueueing")
	fs.DurationVar(&c.e2eCheck, "e2e-check", 10*time.Millisecond, "end to end: asynq TaskCheckInterval (its sleep when the queue is empty)")
	fs.DurationVar(&c.e2eTimeout, "e2e-timeout", 5*time.Minute, "end to end: give up on a queue that does not drain")
	fs.IntVar(&c.drainTasks, "drain-tasks", 10_000, "worker side: unique tasks the server drains")
	fs.IntVar(&c.drainWorkers, "drain-workers", 64, "worker side: asynq server Concurrency")
	fs.DurationVar(&c.drainWork, "drain-work", 0, "worker side: simulated work per task (sleep; 0: a no-op handler)")
	fs.IntVar(&c.batchSize, "batch-size", 1000, "batch: tasks per EnqueueBatch call")
	fs.IntVar(&c.batchRuns, "batch-runs", 20, "batch: calls per run (each variant enqueues batch-size × batch-runs tasks per round)")
	modes := fs.String("e2e-mode", "before,live", "end to end: modes, before (enqueue all, then start the server) and/or live (server already running)")
	drains := fs.String("drain-variants", "all", "worker side: comma-separated variants to run beside plain: all or "+strings.Join(drainNames(), ","))
	return listFlags{conc: conc, cases: cases, modes: modes, drains: drains}
}

// parseConc parses -c: distinct concurrencies, in the order given.
func parseConc(list string) ([]int, error) {
	var conc []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return conc, fmt.Errorf("-c: bad concurrency %q", f)
		}
		if !slices.Contains(conc, n) {
			conc = append(conc, n)
		}
	}
	return conc, nil
}

// parseCases parses -cases into case names in table order, whatever the
// order given.
func parseCases(list string) (cases []string, _ error) {
	want := map[string]bool{}
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		switch {
		case f == "all":
			for _, n := range caseNames() {
				want[n] = true
			}
		case slices.Contains(caseNames(), f):
			want[f] = true
		default:
			return nil, fmt.Errorf("-cases: unknown case %q (have all, %s)", f, strings.Join(caseNames(), ", "))
		}
	}
	for _, n := range caseNames() {
		if want[n] {
			cases = append(cases, n)
		}
	}
	return cases, nil
}

// parseDrains parses -drain-variants: the plain server first (the ratios'
// base), then the variants named, in drainVariants' order.
func parseDrains(list string) ([]drainVariant, error) {
	names := strings.Split(list, ",")
	for _, n := range names {
		if n != "all" && !slices.Contains(drainNames(), n) {
			return nil, fmt.Errorf("-drain-variants: unknown variant %q (have %s)", n, strings.Join(drainNames(), ", "))
		}
	}
	var vs []drainVariant
	for _, v := range drainVariants {
		if v.name == "plain" || slices.Contains(names, "all") || slices.Contains(names, v.name) {
			vs = append(vs, v)
		}
	}
	return vs, nil
}

// parseModes parses -e2e-mode: distinct modes, in the order given.
func parseModes(list string) (modes []string, _ error) {
	for _, m := range strings.Split(list, ",") {
		m = strings.TrimSpace(m)
		if m != modeBefore && m != modeLive {
			return modes, fmt.Errorf("-e2e-mode: unknown mode %q (have before, live)", m)
		}
		if !slices.Contains(modes, m) {
			modes = append(modes, m)
		}
	}
	return modes, nil
}

// check rejects values no run can use.
func (c *config) check() error {
	switch {
	case c.duration <= 0 || c.warmup < 0:
		return errors.New("-duration must be positive, -warmup not negative")
	case c.rounds < 1:
		return errors.New("-rounds must be at least 1")
	case c.keys < 1:
		return errors.New("-keys must be at least 1")
	case c.payload < 64:
		return errors.New("-payload must be at least 64 bytes")
	case c.pool < 0:
		return errors.New("-pool must not be negative")
	case c.e2eTasks < 1 || c.e2eKeys < 1 || c.e2eWorkers < 1 || c.e2eProducers < 1 || c.e2eWork < 0 || c.e2eCheck <= 0:
		return errors.New("-e2e-*: bad value")
	case c.drainTasks < 1 || c.drainWorkers < 1 || c.drainWork < 0:
		return errors.New("-drain-*: bad value")
	case c.batchSize < 1 || c.batchRuns < 1:
		return errors.New("-batch-size and -batch-runs must be at least 1")
	}
	return nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dedupbench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, cfg)
	stop()
	os.Exit(code)
}

func (c *config) progress(format string, args ...any) {
	if !c.quiet {
		fmt.Fprintf(c.stderr, format+"\n", args...)
	}
}

// run runs the benchmark and returns the exit status.
func run(ctx context.Context, cfg config) int {
	fail := func(err error) int {
		if ctx.Err() != nil {
			err = fmt.Errorf("interrupted: %w", err)
		}
		fmt.Fprintln(cfg.stderr, "dedupbench:", err)
		return 2
	}
	opts, where, stop, err := redisTarget(ctx, cfg.redisAddr)
	if err != nil {
		return fail(err)
	}
	defer stop()
	if cfg.pool == 0 {
		cfg.pool = max(slices.Max(cfg.conc), cfg.e2eProducers) + cfg.e2eWorkers + 16
	}
	e, err := newEnv(ctx, cfg, opts)
	if err != nil {
		return fail(err)
	}
	defer e.close()
	rep := newReport(ctx, e, where)
	selected := selectedCases(cfg)
	cfg.progress("dedupbench: %s, %d cases × c=%v × %v × %d rounds", where, len(selected), cfg.conc, cfg.duration, cfg.rounds)
	if err := e.warmUp(ctx, selected); err != nil {
		return fail(err)
	}
	if cfg.cpuprofile != "" {
		stopProfile, err := startProfile(cfg.cpuprofile)
		if err != nil {
			return fail(err)
		}
		defer stopProfile()
	}
	runs, err := e.rounds(ctx, selected)
	if err != nil {
		return fail(err)
	}
	rep.summarize(cfg, selected, runs)
	e.countLeft(ctx, rep)
	if cfg.jsonOut {
		if err := rep.writeJSON(cfg.stdout); err != nil {
			return fail(err)
		}
	} else {
		rep.writeTable(cfg.stdout, cfg)
	}
	if rep.Errors > 0 {
		fmt.Fprintf(cfg.stderr, "dedupbench: %d calls had an unexpected outcome (see the table)\n", rep.Errors)
		return 1
	}
	return 0
}

// redisTarget starts a redis-server of our own, or takes -redis, and
// returns its options, a description for the header and what to call at
// exit.
func redisTarget(ctx context.Context, addr string) (opts *redis.Options, where string, stop func(), err error) {
	if addr == "" {
		own, err := startRedis(ctx)
		if err != nil {
			return nil, "", nil, err
		}
		return &redis.Options{Addr: own.addr}, "own redis-server on " + own.addr + ` (--save "" --appendonly no)`, own.stop, nil
	}
	if opts, err = redisOptions(addr); err != nil {
		return nil, "", nil, fmt.Errorf("-redis: %w", err)
	}
	return opts, "redis at " + opts.Addr + " (-redis; only this run's keys are touched)", func() {}, nil
}

// newEnv connects the clients every case shares; on an error it closes
// what it opened.
func newEnv(ctx context.Context, cfg config, opts *redis.Options) (*env, error) {
	opts.PoolSize = cfg.pool
	opts.ContextTimeoutEnabled = cfg.ctxTimeouts
	pollOpts := *opts
	pollOpts.PoolSize = 2

	e := &env{cfg: cfg, cnt: &counter{}, pcnt: &counter{}, runID: randomHex(4)}
	e.rdb = redis.NewClient(opts)
	e.rdb.AddHook(e.cnt)
	e.poll = redis.NewClient(&pollOpts)
	e.poll.AddHook(e.pcnt)
	if err := e.rdb.Ping(ctx).Err(); err != nil {
		e.close()
		return nil, fmt.Errorf("redis at %s: %w", opts.Addr, err)
	}
	logger := slog.New(slog.NewTextHandler(cfg.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	dcfg := dedup.Config{
		Prefix:   dedupPrefix,
		Logger:   logger,
		MaxBatch: cfg.maxBatch,
		Rules: map[string]dedup.Rule{
			typeReplace:    {Fields: []string{"user_id"}, OnConflict: dedup.Replace},
			typeE2EReplace: {Fields: []string{"user_id"}, OnConflict: dedup.Replace, OnRunning: dedup.RunningDefer},
			typeE2EReject:  {Fields: []string{"user_id"}},
		},
	}
	maps.Copy(dcfg.Rules, drainRules)
	var err error
	if e.d, err = dedup.New(ctx, e.rdb, dcfg); err != nil {
		e.close()
		return nil, err
	}
	if cfg.has("e2e") || cfg.has("drain") {
		// The servers' middleware starts a Dedup's heartbeat: keep it off
		// the one the throughput cases use.
		if e.de2e, err = dedup.New(ctx, e.rdb, dcfg); err != nil {
			e.close()
			return nil, err
		}
		// As a long-running worker's: its middleware's owed subscription
		// (RunningDefer) is up and steady before the first task runs; a
		// worker's first seconds after Middleware make a call at every such
		// success (docs/lifecycle.md, "The owed signal").
		e.de2e.Middleware()
		time.Sleep(3 * time.Second)
	}
	e.ac = asynq.NewClientFromRedisClient(e.rdb)
	e.dc = e.d.NewClient()      // one shared Redis: accepted enqueues take one round trip
	e.wc = e.d.WrapClient(e.ac) // the lock, then asynq's enqueue: what NewClient does with another asynq
	e.insp = asynq.NewInspectorFromRedisClient(e.rdb)
	return e, nil
}

// close closes what newEnv opened, the last first.
func (e *env) close() {
	if e.de2e != nil {
		e.de2e.Close()
	}
	if e.d != nil {
		e.d.Close()
	}
	e.poll.Close()
	e.rdb.Close()
}

// newReport starts the report with what describes the run.
func newReport(ctx context.Context, e *env, where string) *report {
	cfg := e.cfg
	return &report{
		Meta: meta{
			Date: time.Now().Format("2006-01-02"), Go: runtime.Version(),
			Asynq: depVersion("github.com/hibiken/asynq"), GoRedis: depVersion("github.com/redis/go-redis/v9"),
			Redis: redisVersion(ctx, e.rdb), CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0),
			Where: where, Pool: cfg.pool, ContextTimeouts: cfg.ctxTimeouts, MaxBatch: cfg.maxBatch,
			Duration: cfg.duration.String(), Rounds: cfg.rounds, Concurrency: cfg.conc,
			Payload: cfg.payload, Keys: cfg.keys,
		},
	}
}

// selectedCases are the throughput cases cfg selects, in table order.
func selectedCases(cfg config) []*caseDef {
	var selected []*caseDef
	for _, cd := range allCases {
		if cfg.has(cd.name) {
			selected = append(selected, cd)
		}
	}
	return selected
}

// warmUp fills the connection pool, loads the scripts and settles the heap.
func (e *env) warmUp(ctx context.Context, selected []*caseDef) error {
	if e.cfg.warmup <= 0 {
		return nil
	}
	for _, cd := range selected {
		if _, err := e.measure(ctx, cd, slices.Max(e.cfg.conc), e.cfg.warmup); err != nil {
			return fmt.Errorf("warm-up %s: %w", cd.title, err)
		}
	}
	return nil
}

// startProfile starts the CPU profile into path and returns what stops it.
func startProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// allRuns holds every round's results: throughput by concurrency and
// case, end to end by mode and variant, drains and batches by variant.
type allRuns struct {
	throughput map[int]map[string][]*runResult
	e2e        map[string]map[string][]*e2eResult
	drain      map[string][]*drainResult
	batch      map[string][]*batchResult
}

// rounds runs every round: each case at each concurrency, then the end to
// end variants in each mode, then the drains and the batches, each round starting one later
// in the order, so that no case always runs right after the same one.
func (e *env) rounds(ctx context.Context, selected []*caseDef) (*allRuns, error) {
	runs := &allRuns{throughput: map[int]map[string][]*runResult{}, e2e: map[string]map[string][]*e2eResult{},
		drain: map[string][]*drainResult{}, batch: map[string][]*batchResult{}}
	for _, c := range e.cfg.conc {
		runs.throughput[c] = map[string][]*runResult{}
	}
	for r := range e.cfg.rounds {
		if err := e.throughputRound(ctx, r, selected, runs.throughput); err != nil {
			return nil, err
		}
		if e.cfg.has("e2e") {
			if err := e.e2eRound(ctx, r, runs.e2e); err != nil {
				return nil, err
			}
		}
		if e.cfg.has("drain") {
			if err := e.drainRound(ctx, r, runs.drain); err != nil {
				return nil, err
			}
		}
		if e.cfg.has("batch") {
			if err := e.batchRound(ctx, r, runs.batch); err != nil {
				return nil, err
			}
		}
	}
	return runs, nil
}

// throughputRound runs round r of the throughput cases into runs.
func (e *env) throughputRound(ctx context.Context, r int, selected []*caseDef, runs map[int]map[string][]*runResult) error {
	cfg := e.cfg
	for _, c := range cfg.conc {
		for j := range selected {
			cd := selected[(j+r)%len(selected)]
			res, err := e.measure(ctx, cd, c, cfg.duration)
			if err != nil {
				return fmt.Errorf("round %d, c=%d, %s: %w", r+1, c, cd.title, err)
			}
			runs[c][cd.name] = append(runs[c][cd.name], res)
			cfg.progress("round %d/%d  c=%-3d %-18s %9s ops/s  p50 %-7s p99 %-7s cmds/op %.2f  errors %d",
				r+1, cfg.rounds, c, cd.title, commas(int64(res.opsPerSec())), fmtLat(res.h.quantile(0.5)),
				fmtLat(res.h.quantile(0.99)), float64(res.cmds.cmds)/float64(max(res.ops, 1)), res.errs)
		}
	}
	return nil
}

// e2eRound runs round r of the end-to-end variants into e2eRuns.
func (e *env) e2eRound(ctx context.Context, r int, e2eRuns map[string]map[string][]*e2eResult) error {
	cfg := e.cfg
	for _, m := range cfg.e2eModes {
		if e2eRuns[m] == nil {
			e2eRuns[m] = map[string][]*e2eResult{}
		}
		for j := range e2eVariants {
			v := e2eVariants[(j+r)%len(e2eVariants)]
			res, err := e.runE2E(ctx, m, v)
			if err != nil {
				return fmt.Errorf("round %d, end to end %s, %s: %w", r+1, m, v.title, err)
			}
			e2eRuns[m][v.name] = append(e2eRuns[m][v.name], res)
			cfg.progress("round %d/%d  e2e %-6s %-14s enqueue %-7s drain %-7s total %-7s processed %s  errors %d",
				r+1, cfg.rounds, m, v.title, fmtSec(res.enqueue), fmtSec(res.drain), fmtSec(res.total), commas(res.processed), res.errs)
		}
	}
	return nil
}

// countLeft notes what this run left behind in Redis (nothing, if the
// cleanup works).
func (e *env) countLeft(ctx context.Context, rep *report) {
	if n, err := countMatching(ctx, e.rdb, "*"+e.runID+"*"); err == nil {
		rep.Meta.KeysLeft = n
		if n > 0 {
			fmt.Fprintf(e.cfg.stderr, "dedupbench: warning: %d keys of this run left in Redis after cleanup\n", n)
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
