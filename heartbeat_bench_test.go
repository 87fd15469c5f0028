//go:build ignore

package dedup

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// roundTripHook counts what a go-redis client sends, one round trip per
// single command or pipeline, and singles out calls of the extend script
// (the heartbeat's lock renewals). A call is counted once its replies are in,
// all its counts at once, so a snapshot never sees half a call. The
// handshake go-redis makes on a new connection (HELLO, CLIENT SETINFO) is in
// no count.
type roundTripHook struct {
	full atomic.Int64 // extends per heartbeat round that make it "full"

	mu sync.Mutex
	c  rtCounts
}

// rtCounts is what a roundTripHook counted.
type rtCounts struct {
	singles         int64 // single commands: one round trip each
	singleExtends   int64 // of which extend calls
	pipelines       int64 // pipelines: one round trip each
	pipelinedCmds   int64 // commands in them
	extendPipelines int64 // pipelines carrying extends
	extendCmds      int64 // extends in them
	mixedPipelines  int64 // pipelines carrying extends and other commands
	fullPipelines   int64 // pipelines carrying exactly full extends and nothing else
}

func (h *roundTripHook) snapshot() rtCounts {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.c
}

func (c rtCounts) sub(o rtCounts) rtCounts {
	return rtCounts{c.singles - o.singles, c.singleExtends - o.singleExtends, c.pipelines - o.pipelines,
		c.pipelinedCmds - o.pipelinedCmds, c.extendPipelines - o.extendPipelines, c.extendCmds - o.extendCmds,
		c.mixedPipelines - o.mixedPipelines, c.fullPipelines - o.fullPipelines}
}

func (c rtCounts) roundTrips() int64 { return c.singles + c.pipelines }
func (c rtCounts) commands() int64   { return c.singles + c.pipelinedCmds }

// isHandshake reports whether cmd is part of go-redis's connection set-up.
func isHandshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "auth", "client", "select", "readonly":
		return true
	}
	return false
}

// isExtend reports whether cmd runs the extend script (EVALSHA, or EVAL
// after a NOSCRIPT).
func isExtend(cmd redis.Cmder) bool {
	args := cmd.Args()
	if len(args) < 2 {
		return false
	}
	switch cmd.Name() {
	case "evalsha":
		return args[1] == store.ScriptHash("extend")
	case "eval":
		src, ok := args[1].(string)
		sum := sha1.Sum([]byte(src))
		return ok && hex.EncodeToString(sum[:]) == store.ScriptHash("extend")
	}
	return false
}

func (h *roundTripHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *roundTripHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if isHandshake(cmd) {
			return err
		}
		h.mu.Lock()
		h.c.singles++
		if isExtend(cmd) {
			h.c.singleExtends++
		}
		h.mu.Unlock()
		return err
	}
}

func (h *roundTripHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		var ext, hs int64
		for _, c := range cmds {
			switch {
			case isExtend(c):
				ext++
			case isHandshake(c):
				hs++
			}
		}
		if hs == int64(len(cmds)) {
			return err
		}
		full := h.full.Load()
		h.mu.Lock()
		defer h.mu.Unlock()
		h.c.pipelines++
		h.c.pipelinedCmds += int64(len(cmds))
		if ext > 0 {
			h.c.extendPipelines++
			h.c.extendCmds += ext
			if ext != int64(len(cmds)) {
				h.c.mixedPipelines++
			}
			if ext == int64(len(cmds)) && ext == full {
				h.c.fullPipelines++
			}
		}
		return err
	}
}

// goroutineCensus sorts this process's goroutines by what they run.
type goroutineCensus struct {
	total     int
	handlers  int // handlers inside the middleware (Dedup.process on the stack)
	asynqTask int // asynq's per-task goroutine that waits for the handler's result
	dedupBG   int // other goroutines running this package's code (not tests)
	heartbeat int // heartbeat loops, among dedupBG
}

// rest is every goroutine that is neither a handler nor asynq's per-task one.
func (g goroutineCensus) rest() int { return g.total - g.handlers - g.asynqTask }

func takeGoroutineCensus() goroutineCensus {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var g goroutineCensus
	for _, st := range strings.Split(string(buf), "\n\n") {
		if !strings.HasPrefix(st, "goroutine ") {
			continue
		}
		g.total++
		switch {
		case strings.Contains(st, "asynq-dedup/dedup.(*Dedup).process("):
			g.handlers++
		case strings.Contains(st, "hibiken/asynq.(*processor).exec.func"):
			g.asynqTask++
		case strings.Contains(st, "testing.tRunner") || strings.Contains(st, "testing.(*M)"):
		case strings.Contains(st, "github.com/asynq-dedup/dedup."):
			g.dedupBG++
			if strings.Contains(st, "dedup.(*heartbeater).loop") {
				g.heartbeat++
			}
		}
	}
	return g
}

// TestHeartbeat1000Handlers runs 1,000 handlers at once in one asynq server
// with the middleware, and checks on behaviour (never on speed) that their
// locks are renewed by one pipelined round trip per heartbeat, never by
// per-handler commands, and that the heartbeat adds a constant number of
// goroutines however many handlers run.
func TestHeartbeat1000Handlers(t *testing.T) {
	needRealRedis(t) // miniredis serves each connection with goroutines of its own, which would blur the census
	const (
		few   = 10
		n     = 1000
		lease = 900 * time.Millisecond // heartbeat every 300 ms
		beats = 5                      // heartbeat rounds observed with all n running
	)
	interval := lease / 3
	// The Dedup gets a client of its own, so the hook sees its traffic only;
	// the asynq server uses another (same redis-server).
	dedupRDB := newRDB(t)
	hook := &roundTripHook{}
	dedupRDB.AddHook(hook)
	h := newHarnessOn(t, dedupRDB, Config{heartbeat: (lease) / 3})
	h.rdb = newRDB(t)

	started := make(chan struct{}, n)
	release := make(chan struct{})
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		started <- struct{}{}
		<-release
		return nil
	}, func(c *asynq.Config) { c.Concurrency = n })
	released := false
	defer func() {
		if !released {
			close(release) // let the server shut down on failure
		}
	}()
	enqueue := func(from, to int) {
		var wg sync.WaitGroup
		errs := make(chan error, to-from)
		next := atomic.Int64{}
		next.Store(int64(from))
		for range 8 {
			wg.Go(func() {
				for i := int(next.Add(1) - 1); i < to; i = int(next.Add(1) - 1) {
					if _, err := h.client.EnqueueContext(context.Background(), userTask(i, ""), asynq.Queue(h.queue)); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("enqueue: %v", err)
		}
		for range to - from {
			waitFor(t, started, "handlers running")
		}
	}

	// Goroutines with few handlers running, then with n.
	enqueue(0, few)
	atFew := takeGoroutineCensus()
	enqueue(few, n)
	var atN goroutineCensus
	// Transient goroutines (asynq's periodic work) come and go: poll until
	// the census settles, with a deadline. A per-handler heartbeat never
	// would: it keeps n-few more goroutines for as long as the handlers run.
	const slack = 20
	deadline := time.Now().Add(5 * time.Second)
	for {
		atN = takeGoroutineCensus()
		if (atN.rest()-atFew.rest() <= slack && atN.dedupBG == atFew.dedupBG) || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("goroutines with %d handlers: %d (%d in handlers, %d asynq per-task, %d dedup background of which %d heartbeat, %d other)",
		few, atFew.total, atFew.handlers, atFew.asynqTask, atFew.dedupBG, atFew.heartbeat, atFew.rest()-atFew.dedupBG)
	t.Logf("goroutines with %d handlers: %d (%d in handlers, %d asynq per-task, %d dedup background of which %d heartbeat, %d other); %.2f more per extra handler",
		n, atN.total, atN.handlers, atN.asynqTask, atN.dedupBG, atN.heartbeat, atN.rest()-atN.dedupBG, float64(atN.total-atFew.total)/float64(n-few))
	for _, c := range []struct {
		running int
		g       goroutineCensus
	}{{few, atFew}, {n, atN}} {
		if c.g.handlers != c.running {
			t.Fatalf("census found %d handlers in the middleware, want %d", c.g.handlers, c.running)
		}
		if c.g.heartbeat != 1 {
			t.Errorf("%d heartbeat loops with %d handlers, want 1", c.g.heartbeat, c.running)
		}
	}
	if atN.dedupBG != atFew.dedupBG {
		t.Errorf("this package runs %d background goroutines with %d handlers, %d with %d: want a constant number", atN.dedupBG, n, atFew.dedupBG, few)
	}
	if grow := atN.rest() - atFew.rest(); grow > slack {
		t.Errorf("%d more goroutines (beyond the handlers' own and asynq's per-task ones) with %d handlers than with %d: want O(1)", grow, n, few)
	}

	// Round trips over a few heartbeats with all n running. The first full
	// round shows every lease registered; then count beats more.
	hook.full.Store(n)
	waitRounds := func(k int64, what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for hook.snapshot().fullPipelines < k {
			if time.Now().After(deadline) {
				c := hook.snapshot()
				t.Fatalf("timed out waiting for %s (a pipeline of exactly %d extends): so far %d extends in %d pipelines, %d single extends",
					what, n, c.extendCmds, c.extendPipelines, c.singleExtends)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitRounds(1, "a heartbeat renewing all locks")
	from, t0 := hook.snapshot(), time.Now()
	waitRounds(from.fullPipelines+beats, fmt.Sprintf("%d more heartbeats", beats))
	win, elapsed := hook.snapshot().sub(from), time.Since(t0)
	rounds := win.fullPipelines
	t.Logf("%d heartbeat rounds in %v (interval %v): %d round trips, %d commands (%d extends in %d pipelines, %d single extends); %.1f round trips and %.0f commands per round",
		rounds, elapsed.Round(time.Millisecond), interval, win.roundTrips(), win.commands(), win.extendCmds, win.extendPipelines, win.singleExtends,
		float64(win.roundTrips())/float64(rounds), float64(win.commands())/float64(rounds))
	if win.singleExtends != 0 {
		t.Errorf("%d extends sent as single commands, want every renewal in the heartbeat's pipeline", win.singleExtends)
	}
	if win.extendPipelines != rounds || win.mixedPipelines != 0 {
		t.Errorf("%d pipelines carried extends (%d mixed with other commands) in %d heartbeat rounds: want one pipeline of %d extends per round", win.extendPipelines, win.mixedPipelines, rounds, n)
	}
	if win.extendCmds != rounds*n {
		t.Errorf("%d extends in %d rounds, want %d each", win.extendCmds, rounds, n)
	}
	if win.roundTrips() != rounds {
		t.Errorf("%d round trips on the Dedup's client in %d heartbeat rounds: with every handler waiting, the heartbeat's pipeline should be all", win.roundTrips(), rounds)
	}
	if limit := int64(elapsed/interval) + 2; rounds > limit {
		t.Errorf("%d heartbeat rounds in %v, more than one per %v", rounds, elapsed, interval)
	}
	if total := hook.snapshot().singleExtends; total != 0 {
		t.Errorf("%d single extend commands over the whole test", total)
	}

	// The heartbeat kept every lock: each is still its task's.
	ctx := context.Background()
	cmds := make([]*redis.StringCmd, n)
	if _, err := h.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range n {
			cmds[i] = p.HGet(ctx, h.keyOf(userTask(i, ""), h.queue), "tok")
		}
		return nil
	}); err != nil {
		t.Fatalf("reading locks: %v", err)
	}
	for i, c := range cmds {
		if c.Val() == "" {
			t.Fatalf("lock %d is not held by its running task after %d leases: %v", i, int(elapsed/lease)+1, c.Err())
		}
	}
	if s := h.d.Stats(); s.LockLost != 0 {
		t.Errorf("LockLost = %d", s.LockLost)
	}

	close(release)
	released = true
	eventually(t, "all handlers settled", func() bool { return h.d.Stats().Processed == n })
	eventually(t, "all locks released", func() bool { return len(h.locks()) == 0 })
}

// BenchmarkHeartbeat measures one heartbeat round for 1,000 running locks:
// the library's heartbeat (one goroutine, one pipeline) against a goroutine
// per lock, each calling extend once per round, with auto-pipelining off
// (one round trip per call: the design the heartbeat replaced) and on (the
// default Config.MaxBatch). It reports ns/round, round trips and commands
// per round, counted with a hook on the Dedup's client.
func BenchmarkHeartbeat(b *testing.B) {
	const n = 1000
	ctx := context.Background()
	setup := func(b *testing.B, cfg Config) (*Dedup, *roundTripHook, []*lease) {
		rdb := newRDB(b)
		hook := &roundTripHook{}
		rdb.AddHook(hook)
		cfg.Prefix = "bench-" + uniq(b)
		cfg.Logger = quietLogger()
		d, err := New(ctx, rdb, cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = d.Close() })
		queue := "q-" + uniq(b)
		ls := make([]*lease, n)
		keys := make([]string, 0, n)
		for i := range ls {
			fp := newToken() // 16 random hex digits, as a fingerprint
			id := newLockedID(fp)
			ref := d.newRef(queue, fp, id, "bench:task", false)
			tok := newToken()
			if st, holder, err := d.start(ctx, ref, tok, RunningReject); err != nil || st != store.StatusTaken {
				b.Fatalf("start: %d %q %v", st, holder, err)
			}
			ls[i] = &lease{ref: *ref, token: tok, cancel: func(error) {}}
			keys = append(keys, d.lockKey(ref))
		}
		b.Cleanup(func() { _ = rdb.Del(context.Background(), keys...).Err() })
		return d, hook, ls
	}
	report := func(b *testing.B, hook *roundTripHook, from rtCounts) {
		c := hook.snapshot().sub(from)
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/round")
		b.ReportMetric(float64(c.roundTrips())/float64(b.N), "roundtrips/round")
		b.ReportMetric(float64(c.commands())/float64(b.N), "cmds/round")
	}

	b.Run("pipelined", func(b *testing.B) {
		d, hook, ls := setup(b, Config{})
		for _, l := range ls {
			d.hb.add(l)
		}
		d.hb.beat() // warm-up, untimed
		from := hook.snapshot()
		b.ResetTimer()
		for b.Loop() {
			d.hb.beat()
		}
		b.StopTimer()
		report(b, hook, from)
		if s := d.Stats(); s.LockLost != 0 || s.RedisErrors != 0 {
			b.Fatalf("stats %+v", s)
		}
	})

	perGoroutine := func(cfg Config) func(*testing.B) {
		return func(b *testing.B) {
			d, hook, ls := setup(b, cfg)
			// A goroutine per running lock, as a per-handler heartbeat has;
			// each renews its lock once per round.
			var (
				wg     sync.WaitGroup
				failed atomic.Int64
			)
			ticks := make([]chan struct{}, n)
			quit := make(chan struct{})
			defer close(quit)
			for i, l := range ls {
				ticks[i] = make(chan struct{}, 1)
				go func() {
					for {
						select {
						case <-quit:
							return
						case <-ticks[i]:
						}
						if ok, err := d.extend(ctx, &l.ref, l.token, 3*d.cfg.heartbeat); err != nil || !ok {
							failed.Add(1)
						}
						wg.Done()
					}
				}()
			}
			round := func() {
				wg.Add(n)
				for _, c := range ticks {
					c <- struct{}{}
				}
				wg.Wait()
			}
			round() // warm-up, untimed: fills the connection pool
			from := hook.snapshot()
			b.ResetTimer()
			for b.Loop() {
				round()
			}
			b.StopTimer()
			report(b, hook, from)
			if f := failed.Load(); f != 0 {
				b.Fatalf("%d renewals failed", f)
			}
		}
	}
	b.Run("per-goroutine", perGoroutine(Config{MaxBatch: -1}))
	b.Run("per-goroutine-autobatch", perGoroutine(Config{}))
}
