package dedup

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// TestOptionSpace walks the option space against a real asynq server and
// the tests' redis-server. Each run draws a configuration (a Rule for each
// of three task types: key choice, OnConflict, OnRunning, MaxPending,
// Cooldown, Debounce, OnBusy, TTL; drawings that New refuses must be
// refused with ErrInvalidOption and leave nothing behind), then takes
// random steps:
//
//   - enqueues through NewClient, WrapClient, and a WrapClient over an
//     Enqueuer that moves every task to another queue, with random per-call
//     options (Fields, Key, SharedKey, TTL, Skip, OnConflict, MergeWith,
//     WaitForRoom, Cooldown, Debounce, and asynq's Queue, TaskID from a
//     small pool, ProcessIn, MaxRetry, Timeout, Retention, Unique, Group),
//     some with the queue given only in asynq.NewTask;
//   - enqueues through asynq's own client (lockless arrivals);
//   - handler outcomes: each run is reported on a channel and blocks until
//     a step ends it (success, error, panic, SkipRetry, RevokeTask); runs of
//     tasks with a short Timeout can be left to time out and end later;
//   - Inspector DeleteTask, ArchiveTask, RunTask, DeleteAllPendingTasks,
//     ArchiveAllPendingTasks, DeleteQueue(force);
//   - Dedup.Release (owner-checked, forced, or with a wrong holder),
//     Dedup.Lookup, dedupctl's doctor --fix (store.Diagnose and
//     store.ReleaseStuck), a worker restart (Shutdown and a new server),
//     waiting for asynq's clock, and an enqueue at a key whose lock's owner
//     is gone.
//
// After every step the server is let settle (every running handler is
// parked waiting for the test, and nothing is pending that a free worker
// could take) and the invariants are checked against asynq's record:
//
//  1. never two live tasks (pending, scheduled, retry, active) for one key
//     among the tasks the library accepted, except a started RunningAllow
//     task and a RunningDefer holder with its follow-up; and never two
//     handlers of one key running at once (lockless arrivals included),
//     except beside a RunningAllow run (a handler asynq gave up, past its
//     Timeout or a shutdown, no longer counts as running);
//  2. once the work has drained, the last run of each key carried the
//     newest payload accepted for it (unless the operator deleted,
//     archived or released the task carrying it, or RunningAllow; a
//     payload that arrived later without the library and was folded in by
//     BusyFold counts as newer); a task only ever runs payloads of its own
//     key;
//  3. MaxPending: per type and queue, keys whose task waits and never
//     started are at most MaxPending;
//  4. a lock whose owner is gone and that does not cool down does not
//     refuse the key's next enqueue (a lock not written with its task may
//     until it is HealGrace old, and a process that read the owner less
//     than a second ago may answer from the lock alone); no enqueue is
//     folded into a task that will not run; no lock lives longer than its
//     documented lifetime; doctor --fix releases only locks whose owner
//     cannot run; the work drains;
//  5. every error is of a documented class (and ErrInvalidOption exactly
//     where the README refuses a combination, with nothing locked or
//     enqueued); a refused payload never runs;
//  6. each accepted merge unit (payloads carry sets of unit IDs, merged by
//     union) runs successfully exactly once, unless replaced, or its task
//     was deleted, archived, released or failed for good.
//
// A failure prints the seed, the configuration and the steps in words.
// CI runs -optionspace.runs runs of -optionspace.steps steps, seeded from
// the clock unless -optionspace.seed is given; raise both for a longer walk:
//
//	go test -race -run 'TestOptionSpace$' .                                  # CI: 6 runs of 150 steps
//	go test -race -run 'TestOptionSpace$' -optionspace.seed=N -optionspace.runs=1 # one run again
//	go test -run 'TestOptionSpace$' -optionspace.runs=100 -optionspace.steps=300 -timeout 2h .
//
// asynq's clocks are real (due times, retries, timeouts), so a seed
// replays the same configuration and the same choices of operation, but a
// task may come due a step earlier or later than it did.
func TestOptionSpace(t *testing.T) {
	needRealRedis(t)
	t.Parallel() // mostly waiting on asynq's clocks, beside the fault tests' waits
	seed := *osSeedFlag
	if seed == 0 {
		seed = time.Now().UnixNano() % 1_000_000_000
	}
	t.Logf("seed %d (-optionspace.seed=%d), %d runs of %d steps", seed, seed, *osRunsFlag, *osStepsFlag)
	for i := range *osRunsFlag {
		s := seed + int64(i)
		t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) {
			t.Parallel() // each run has its own prefix, queues and server
			runOptionSpace(t, s, *osStepsFlag)
		})
	}
}

var (
	osSeedFlag  = flag.Int64("optionspace.seed", 0, "TestOptionSpace: seed of the first run (0: from the clock); run i uses seed+i")
	osStepsFlag = flag.Int("optionspace.steps", 150, "TestOptionSpace: steps per run")
	osRunsFlag  = flag.Int("optionspace.runs", 6, "TestOptionSpace: runs, each with a configuration of its own")
)

// Durations: short, but long enough to mean something on a loaded 2-core
// machine under -race.
const (
	osConcurrency = 3
	osTTL         = 3 * time.Minute // Config.TTL: no lock expires during a run
	osCallTTLMax  = 4 * time.Minute // the longest dedup.TTL drawn
	osLease       = 6 * time.Second // renewed every 2 s
	osHealGrace   = 2 * time.Second // Config.HealGrace
	osRetryDelay  = time.Second     // the server's RetryDelayFunc
	osDedupRetry  = 2 * time.Second // Config.RetryDelayFunc: a bound of the server's (asynq stores whole seconds)
	osDelayMax    = 2 * time.Second // the longest ProcessIn or Debounce drawn
	osTimeout     = 2 * time.Second // asynq.Timeout of the tasks whose handler may be slow past it
	osCooldown    = 1500 * time.Millisecond
	osDebounce    = time.Second
	osShutdown    = 200 * time.Millisecond // asynq's ShutdownTimeout: a parked handler outlives it
	osCallTimeout = 5 * time.Second
)

var osTypes = []string{"os:a", "os:b", "os:c"}

// osWorld is one run.
type osWorld struct {
	t       *testing.T
	seed    int64
	steps   int
	rng     *rand.Rand
	h       *harness
	m       *osModel
	rules   map[string]Rule
	cfgDesc string
	queues  [3]string // served; queues[2] is where the relocating enqueuer sends every task
	newc    *Client
	wrap    *Client
	reloc   *Client
	srv     *asynq.Server
	stop    chan struct{}
	orphans []osLock
	locks   []osLock // as read after the last step
	probes  map[string]osProbe
	live    osLive
	seq     int
	submits int
}

// osRelocator is an Enqueuer that sends every task to another queue.
type osRelocator struct {
	next *asynq.Client
	to   string
}

func (r osRelocator) Enqueue(t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return r.EnqueueContext(context.Background(), t, opts...)
}

func (r osRelocator) EnqueueContext(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return r.next.EnqueueContext(ctx, t, append(slices.Clip(opts), asynq.Queue(r.to))...)
}

func runOptionSpace(t *testing.T, seed int64, steps int) {
	w := &osWorld{t: t, seed: seed, steps: steps, rng: rand.New(rand.NewPCG(uint64(seed), 0x05)), m: newOSModel(), probes: map[string]osProbe{}}
	w.drawConfig()
	w.setup()
	began := time.Now()
	for step := 1; step <= steps; step++ {
		w.m.logf("step %d (%.2fs):", step, time.Since(began).Seconds())
		w.pick()()
		w.quiesce(fmt.Sprintf("step %d", step))
		w.live = w.checkStep()
		w.failOnViolations()
	}
	w.drain()
	w.checkEnd()
	w.failOnViolations()
}

func (w *osWorld) fail(why string) {
	w.t.Helper()
	w.t.Fatal(w.report(why))
}

func (w *osWorld) failOnViolations() {
	w.t.Helper()
	w.m.mu.Lock()
	n := len(w.m.violations)
	w.m.mu.Unlock()
	if n > 0 {
		w.fail(fmt.Sprintf("%d invariant violation(s), seed %d", n, w.seed))
	}
}

// The configuration.

func (w *osWorld) drawRule() Rule {
	rng := w.rng
	var r Rule
	switch x := rng.IntN(20); {
	case x < 14:
		r.Fields = []string{"k"}
	case x < 17:
		r.Key = "fixed"
	default:
		r.Key, r.Shared = "sh", true
	}
	r.OnConflict = Conflict(rng.IntN(3))
	if r.OnConflict == Merge {
		r.MergeFunc = osMerge
	}
	if rng.IntN(30) == 0 { // Merge without its function, or a function without Merge
		if r.MergeFunc == nil {
			r.MergeFunc = osMerge
		} else {
			r.MergeFunc = nil
		}
	}
	switch x := rng.IntN(10); {
	case x < 5:
		r.OnRunning = RunningReject
	case x < 7:
		r.OnRunning = RunningAllow
	default:
		r.OnRunning = RunningDefer
	}
	r.OnBusy = Busy(rng.IntN(3))
	if rng.IntN(4) == 0 {
		r.MaxPending = 1 + rng.IntN(2)
	}
	if rng.IntN(6) == 0 {
		r.Cooldown = osCooldown
	}
	if rng.IntN(6) == 0 {
		r.Debounce = osDebounce
	}
	if rng.IntN(5) == 0 {
		r.TTL = 2 * time.Minute
	}
	return r
}

// ruleRefusal says why the README refuses a rule ("" when it does not).
func ruleRefusal(r Rule) string {
	switch {
	case (r.OnConflict == Merge) != (r.MergeFunc != nil):
		return "OnConflict Merge and MergeFunc go together"
	case r.Cooldown > 0 && r.OnRunning != RunningReject:
		return "Cooldown needs RunningReject"
	case r.Debounce > 0 && r.OnConflict == Reject:
		return "Debounce needs Replace or Merge"
	case r.Debounce > 0 && r.OnRunning == RunningDefer:
		return "Debounce cannot be combined with RunningDefer"
	}
	return ""
}

func describeRule(r Rule) string {
	var parts []string
	switch {
	case r.Shared:
		parts = append(parts, fmt.Sprintf("Key %q Shared", r.Key))
	case r.Key != "":
		parts = append(parts, fmt.Sprintf("Key %q", r.Key))
	default:
		parts = append(parts, fmt.Sprintf("Fields %v", r.Fields))
	}
	parts = append(parts, "OnConflict "+r.OnConflict.String())
	if r.MergeFunc != nil {
		parts = append(parts, "MergeFunc union")
	}
	parts = append(parts, "OnRunning "+r.OnRunning.String(), "OnBusy "+r.OnBusy.String())
	if r.MaxPending > 0 {
		parts = append(parts, fmt.Sprintf("MaxPending %d", r.MaxPending))
	}
	if r.Cooldown > 0 {
		parts = append(parts, "Cooldown "+r.Cooldown.String())
	}
	if r.Debounce > 0 {
		parts = append(parts, "Debounce "+r.Debounce.String())
	}
	if r.TTL > 0 {
		parts = append(parts, "TTL "+r.TTL.String())
	}
	return strings.Join(parts, ", ")
}

func (w *osWorld) baseConfig(rules map[string]Rule) Config {
	return Config{TTL: osTTL, heartbeat: (osLease) / 3, healGrace: osHealGrace, Rules: rules, OnDecision: w.decide,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return osDedupRetry }}
}

// drawConfig draws rules until New accepts them; every drawing the README
// refuses must be refused with ErrInvalidOption, leaving no key behind.
func (w *osWorld) drawConfig() {
	rdb := newRDB(w.t)
	for try := 1; ; try++ {
		rules := map[string]Rule{}
		var desc []string
		refusal := ""
		for _, typ := range osTypes {
			r := w.drawRule()
			rules[typ] = r
			desc = append(desc, fmt.Sprintf("  %s: %s", typ, describeRule(r)))
			if why := ruleRefusal(r); why != "" && refusal == "" {
				refusal = typ + ": " + why
			}
		}
		w.cfgDesc = strings.Join(desc, "\n") + fmt.Sprintf("\n  Config: TTL %v, Lease %v, HealGrace %v, RetryDelayFunc %v; server: Concurrency %d, RetryDelayFunc %v, ShutdownTimeout %v",
			osTTL, osLease, osHealGrace, osDedupRetry, osConcurrency, osRetryDelay, osShutdown)
		if refusal == "" {
			w.rules = rules
			w.h = newHarnessOn(w.t, rdb, w.baseConfig(rules))
			return
		}
		cfg := w.baseConfig(rules)
		cfg.Prefix, cfg.Logger = "dd-"+uniq(w.t), quietLogger()
		d, err := New(context.Background(), rdb, cfg)
		if err == nil {
			_ = d.Close()
		}
		w.m.logf("configuration %d refused as documented (%s): New returned %v", try, refusal, err)
		if !errors.Is(err, ErrInvalidOption) {
			w.m.mu.Lock()
			w.m.violate("5", "New with a rule the README refuses (%s) returned %v, want ErrInvalidOption", refusal, err)
			w.m.mu.Unlock()
		}
		if keys, err := rdb.Keys(context.Background(), cfg.Prefix+"*").Result(); err != nil || len(keys) > 0 {
			w.m.mu.Lock()
			w.m.violate("5", "a refused configuration left keys: %v (%v)", keys, err)
			w.m.mu.Unlock()
		}
		w.failOnViolations()
		if try > 50 {
			w.fail("no valid configuration in 50 drawings")
		}
	}
}

func (w *osWorld) setup() {
	h := w.h
	for i := range w.queues {
		w.queues[i] = fmt.Sprintf("%s-%d", h.queue, i)
	}
	w.newc = h.d.NewClient()
	w.wrap = h.client
	w.reloc = h.d.WrapClient(osRelocator{next: h.asynq, to: w.queues[2]})
	w.stop = make(chan struct{})
	w.t.Cleanup(func() {
		close(w.stop)
		if w.srv != nil {
			w.srv.Shutdown()
		}
		for _, q := range w.queues {
			_ = h.insp.DeleteQueue(q, true)
		}
	})
	w.m.logf("queues q-0, q-1 (served), q-2 (served; the relocating WrapClient sends every task there); prefix %s", h.prefix)
	w.startServer()
}

func (w *osWorld) startServer() {
	qs := map[string]int{}
	for _, q := range w.queues {
		qs[q] = 1
	}
	srv := asynq.NewServerFromRedisClient(w.h.rdb, asynq.Config{
		Concurrency: osConcurrency, Queues: qs,
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.FatalLevel, ShutdownTimeout: osShutdown, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return osRetryDelay },
		ErrorHandler:   asynq.ErrorHandlerFunc(w.serverError),
	})
	if err := srv.Start(w.handler()); err != nil {
		w.fail("server start: " + err.Error())
	}
	w.srv = srv
}

// The steps.

type osOp struct {
	name   string
	weight int
	ok     func() bool
	do     func()
}

func (w *osWorld) pick() func() {
	always := func() bool { return true }
	ops := []osOp{
		{"enqueue", 30, always, func() { w.submit(w.drawSpec(), true) }},
		{"lockless enqueue", 6, always, w.lockless},
		{"end a run", 24, func() bool { return len(w.parked(false)) > 0 }, w.endRun},
		{"let a run time out", 3, func() bool { return len(w.slowable()) > 0 }, w.timeOut},
		{"end a given-up run", 6, func() bool { return len(w.parked(true)) > 0 }, w.endZombie},
		{"inspector on a task", 5, func() bool { return len(w.waitingIDs()) > 0 }, w.inspectTask},
		{"inspector on a queue", 2, always, w.inspectQueue},
		{"release", 3, func() bool { return len(w.probes) > 0 }, w.release},
		{"lookup", 2, func() bool { return len(w.probes) > 0 }, w.lookup},
		{"doctor --fix", 2, always, w.doctor},
		{"worker restart", 2, always, w.restart},
		{"wait for asynq's clock", 4, func() bool { return len(w.live.due) > 0 }, w.tick},
		{"enqueue at an orphaned key", 8, func() bool { return len(w.orphanProbes()) > 0 }, w.probeOrphan},
	}
	total := 0
	for i := range ops {
		if !ops[i].ok() {
			ops[i].weight = 0
		}
		total += ops[i].weight
	}
	x := w.rng.IntN(total)
	for _, op := range ops {
		if x < op.weight {
			return op.do
		}
		x -= op.weight
	}
	panic("unreachable")
}

// osSpec is one enqueue through the library.
type osSpec struct {
	client    string
	typ, k    string
	noK       bool
	taskQueue string
	queue     string
	opts      []asynq.Option
	desc      []string
	keyOpts   []asynq.Option
	keyDesc   []string
	skip      bool
	wait      bool
	refusal   string // why the README refuses the call, "" if it does not
}

func (s *osSpec) add(o asynq.Option, desc string) {
	s.opts = append(s.opts, o)
	s.desc = append(s.desc, desc)
}

func (w *osWorld) drawSpec() *osSpec {
	rng := w.rng
	s := &osSpec{typ: osTypes[rng.IntN(len(osTypes))], k: fmt.Sprintf("k%d", rng.IntN(2)), noK: rng.IntN(50) == 0}
	switch x := rng.IntN(20); {
	case x < 9:
		s.client = "NewClient"
	case x < 16:
		s.client = "WrapClient"
	default:
		s.client = "WrapClient→q-2"
	}
	if rng.IntN(6) == 0 {
		s.taskQueue = w.queues[1]
	}
	if s.taskQueue == "" || rng.IntN(4) == 0 {
		s.queue = w.queues[rng.IntN(2)]
		s.add(asynq.Queue(s.queue), "Queue("+qn(s.queue)+")")
	}
	keyOpt := func(o asynq.Option, d string) {
		s.add(o, d)
		s.keyOpts, s.keyDesc = append(s.keyOpts, o), append(s.keyDesc, d)
	}
	switch rng.IntN(24) {
	case 0, 1:
		keyOpt(Fields("k"), "Fields(k)")
	case 2, 3:
		keyOpt(Key("x"+s.k), "Key(x"+s.k+")")
	case 4, 5:
		keyOpt(SharedKey("sh"), "SharedKey(sh)")
	case 6:
		keyOpt(Key("x"+s.k), "Key(x"+s.k+")")
		keyOpt(SharedKey("sh"), "SharedKey(sh)")
	}
	if rng.IntN(25) == 0 {
		s.skip = true
		keyOpt(Skip(), "Skip()")
	}
	if rng.IntN(10) == 0 {
		d := []time.Duration{90 * time.Second, osCallTTLMax}[rng.IntN(2)]
		s.add(TTL(d), "TTL("+d.String()+")")
	}
	switch {
	case rng.IntN(8) == 0:
		c := Conflict(rng.IntN(2))
		s.add(OnConflict(c), "OnConflict("+c.String()+")")
	case rng.IntN(30) == 0:
		s.add(OnConflict(Merge), "OnConflict(merge)")
	case rng.IntN(9) == 0:
		s.add(MergeWith(osMerge), "MergeWith(union)")
	}
	if rng.IntN(12) == 0 {
		s.wait = true
		s.add(WaitForRoom(), "WaitForRoom()")
	}
	if rng.IntN(20) == 0 {
		s.add(Cooldown(osCooldown), "Cooldown("+osCooldown.String()+")")
	}
	if rng.IntN(14) == 0 {
		s.add(Debounce(osDebounce), "Debounce("+osDebounce.String()+")")
	}
	switch {
	case rng.IntN(7) == 0:
		id := fmt.Sprintf("cid-%d", rng.IntN(4))
		s.add(asynq.TaskID(id), "TaskID("+id+")")
	case rng.IntN(80) == 0:
		s.add(asynq.TaskID(" "), `TaskID(" ")`)
	}
	if rng.IntN(8) == 0 {
		d := time.Duration(1+rng.IntN(2)) * time.Second
		s.add(asynq.ProcessIn(d), "ProcessIn("+d.String()+")")
	}
	if rng.IntN(4) == 0 {
		n := rng.IntN(3)
		s.add(asynq.MaxRetry(n), fmt.Sprintf("MaxRetry(%d)", n))
	}
	if rng.IntN(10) == 0 {
		s.add(asynq.Timeout(osTimeout), "Timeout("+osTimeout.String()+")")
	}
	if rng.IntN(20) == 0 {
		s.add(asynq.Retention(time.Minute), "Retention(1m)")
	}
	if rng.IntN(10) == 0 { // (a task's headers play no part in its lock: any mode, any path)
		s.add(Headers(map[string]string{"os": "1"}), "Headers(os=1)")
	}
	if !s.skip {
		switch {
		case rng.IntN(40) == 0:
			s.add(asynq.Unique(time.Minute), "Unique(1m)")
		case rng.IntN(60) == 0:
			s.add(asynq.Group("g"), "Group(g)")
		}
	}
	// per-call options follow their precedence whatever their order
	perm := rng.Perm(len(s.opts))
	opts, desc := make([]asynq.Option, len(perm)), make([]string, len(perm))
	for i, j := range perm {
		opts[i], desc[i] = s.opts[j], s.desc[j]
	}
	s.opts, s.desc = opts, desc
	s.refusal = w.callRefusal(s)
	return s
}

// callRefusal says why the README refuses a call ("" when it does not):
// Key with SharedKey, OnConflict(Merge) without a merge function, a blank
// task ID; with deduplication on also asynq.Unique or asynq.Group, a
// Cooldown without RunningReject, a Debounce with Reject or RunningDefer.
func (w *osWorld) callRefusal(s *osSpec) string {
	r := w.rules[s.typ]
	conflict, merge, cooldown, debounce := r.OnConflict, r.MergeFunc != nil, r.Cooldown, r.Debounce
	key := ""
	for _, d := range s.desc {
		switch {
		case strings.HasPrefix(d, "Key(") || strings.HasPrefix(d, "SharedKey("):
			if key != "" && key != d {
				return "Key and SharedKey in one call"
			}
			key = d
		case d == "OnConflict(merge)":
			if !merge {
				return "OnConflict(Merge) without a merge function"
			}
			conflict = Merge
		case strings.HasPrefix(d, "OnConflict("):
			conflict = map[string]Conflict{"OnConflict(reject)": Reject, "OnConflict(replace)": Replace}[d]
		case d == "MergeWith(union)":
			conflict, merge = Merge, true
		case strings.HasPrefix(d, "Cooldown("):
			cooldown = osCooldown
		case strings.HasPrefix(d, "Debounce("):
			debounce = osDebounce
		case d == `TaskID(" ")`:
			return "a blank task ID"
		}
	}
	if s.skip {
		return ""
	}
	for _, d := range s.desc {
		if strings.HasPrefix(d, "Unique(") || strings.HasPrefix(d, "Group(") {
			return d + " with deduplication on"
		}
	}
	switch {
	case cooldown > 0 && r.OnRunning != RunningReject:
		return "Cooldown with OnRunning " + r.OnRunning.String()
	case debounce > 0 && conflict == Reject:
		return "Debounce with Reject"
	case debounce > 0 && r.OnRunning == RunningDefer:
		return "Debounce with RunningDefer"
	}
	return ""
}

func (w *osWorld) nextSeq() int { w.seq++; return w.seq }

// kidOf is the fingerprint of the key a task of typ with key field k
// takes with the key options ("" when it has none).
func (w *osWorld) kidOf(typ, k string, noK bool, keyOpts []asynq.Option) string {
	p := osPayload{}
	if !noK {
		p.K = &k
	}
	ref, err := w.h.d.lockKeyOf(asynq.NewTask(typ, p.bytes()), keyOpts)
	if err != nil {
		return ""
	}
	return ref.FP
}

func (w *osWorld) lockKey(q, kid string) string { return store.NewKeys(w.h.prefix).Lock(q, kid) }

func (w *osWorld) clientOf(name string) *Client {
	switch name {
	case "NewClient":
		return w.newc
	case "WrapClient":
		return w.wrap
	}
	return w.reloc
}
