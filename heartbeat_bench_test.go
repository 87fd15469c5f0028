package dedup

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// extendHook counts what a go-redis client sends: round trips (a command
// sent alone, or a pipeline), and among them the calls of the extend
// script (the heartbeat's), with what each found, by task. A call is
// counted once its reply is in. go-redis's connection set-up (HELLO,
// CLIENT SETINFO) is in no count.
type extendHook struct {
	mu    sync.Mutex
	c     extendCounts
	tasks map[string]*extended // by task ID
	// want: once every one of want tasks has had at least rounds
	// extensions that found its key its own, done is closed.
	want, rounds int
	reached      int
	done         chan struct{}
}

// extendCounts is what an extendHook counted.
type extendCounts struct {
	trips       int64 // round trips
	cmds        int64 // commands in them
	scripts     int64 // script calls (EVALSHA, EVAL) of any kind
	extends     int64 // extend calls answered
	extendTrips int64 // round trips carrying extends
	lost        int64 // extends that found the key not its task's
	lookups     int64 // reads of a task's lock from its record answered (HGET unique_key: findLock)
	lookupTrips int64 // round trips carrying them
}

// extended is what the extends of one task found.
type extended struct {
	first time.Time // when its first extend was sent
	owned int       // extends that found the key its task's
}

func newExtendHook(want, rounds int) *extendHook {
	return &extendHook{tasks: map[string]*extended{}, want: want, rounds: rounds, done: make(chan struct{})}
}

func (h *extendHook) snapshot() extendCounts {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.c
}

// extendedTasks returns a copy of what the extends found, by task.
func (h *extendHook) extendedTasks() map[string]extended {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]extended, len(h.tasks))
	for id, e := range h.tasks {
		out[id] = *e
	}
	return out
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

func isHandshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "auth", "client", "select", "readonly":
		return true
	}
	return false
}

func (h *extendHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *extendHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		sent := time.Now()
		err := next(ctx, cmd)
		h.note(sent, []redis.Cmder{cmd})
		return err
	}
}

func (h *extendHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		sent := time.Now()
		err := next(ctx, cmds)
		h.note(sent, cmds)
		return err
	}
}

// note counts one round trip, sent at sent.
func (h *extendHook) note(sent time.Time, cmds []redis.Cmder) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var n, ext, look int64
	for _, c := range cmds {
		if isHandshake(c) {
			continue
		}
		n++
		if a := c.Args(); c.Name() == "hget" && len(a) == 3 && a[2] == "unique_key" && c.Err() == nil {
			look++
		}
		if name := c.Name(); name == "evalsha" || name == "eval" {
			h.c.scripts++
		}
		if isExtend(c) && c.Err() == nil { // (a NOSCRIPT is sent again, with EVAL)
			ext++
			h.extendOf(sent, c)
		}
	}
	if n == 0 {
		return
	}
	h.c.trips++
	h.c.cmds += n
	if ext > 0 {
		h.c.extendTrips++
		h.c.extends += ext
	}
	if look > 0 {
		h.c.lookupTrips++
		h.c.lookups += look
	}
}

// extendOf records one extend's answer (ARGV[1] is its task's ID).
func (h *extendHook) extendOf(sent time.Time, c redis.Cmder) {
	args := c.Args() // EVALSHA sha numkeys key... taskID ...
	nkeys, _ := strconv.Atoi(fmt.Sprint(args[2]))
	id := fmt.Sprint(args[3+nkeys])
	e := h.tasks[id]
	if e == nil {
		e = &extended{first: sent}
		h.tasks[id] = e
	}
	if v, _ := c.(*redis.Cmd).Int64(); v != 1 {
		h.c.lost++
		return
	}
	e.owned++
	if e.owned == h.rounds {
		h.reached++
		if h.reached == h.want {
			close(h.done)
		}
	}
}

// goroutineCensus sorts this process's goroutines by what they run.
type goroutineCensus struct {
	total     int
	handlers  int // this test's handlers inside the middleware (Dedup.process on the stack)
	strays    int // other handlers inside the middleware: an earlier test's, winding down
	asynqTask int // asynq's per-task goroutine that waits for the handler's result
	dedupBG   int // other goroutines running this package's code (not tests)
	heartbeat int // heartbeat loops, among dedupBG
	extenders int // the heartbeat's extend calls in flight (internal/store's ExtendAll)
}

// rest is every goroutine that is neither a handler, nor asynq's per-task
// one, nor an extend call in flight.
func (g goroutineCensus) rest() int { return g.total - g.handlers - g.asynqTask - g.extenders }

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
		case strings.Contains(st, "asynq-dedup/dedup.(*Dedup).process(") && strings.Contains(st, "dedup.TestHeartbeat1000Handlers."):
			g.handlers++
		case strings.Contains(st, "asynq-dedup/dedup.(*Dedup).process("):
			g.strays++
		case strings.Contains(st, "hibiken/asynq.(*processor).exec.func"):
			g.asynqTask++
		case strings.Contains(st, "dedup/internal/store.(*Store).ExtendAll"):
			g.extenders++
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

// Heartbeat timing for TestHeartbeat1000Handlers: a handler's key is first
// extended once it has run hbInterval, then each hbTTL/2.
const (
	hbInterval = 100 * time.Millisecond
	hbTTL      = 3 * time.Second // above the time 1,000 tasks may wait to start (under -race)
	hbRounds   = 3               // extensions per handler observed: the last one past the lock's first TTL
)

// TestHeartbeat1000Handlers runs 1,000 handlers at once in one asynq server
// with the middleware, and checks on behaviour (never on speed) that the
// heartbeat extends every one of their locks, and only once its handler
// has run one heartbeat interval, again each half TTL, from one goroutine,
// in batched calls, and that no lock is lost though each outlives the TTL
// it was taken with.
func TestHeartbeat1000Handlers(t *testing.T) {
	needRealRedis(t) // miniredis serves each connection with goroutines of its own, which would blur the census
	const few, n = 10, 1000
	// The Dedup gets a client of its own, so that the hook sees its calls
	// only; the asynq server and the test's reads use another.
	dedupRDB := newRDB(t)
	hook := newExtendHook(n, hbRounds)
	dedupRDB.AddHook(hook)
	h := newHarnessOn(t, dedupRDB, Config{heartbeat: hbInterval, TTL: hbTTL})
	h.client = h.d.NewClient() // plain tasks: the middleware makes no call of its own at start or end
	h.rdb = newRDB(t)

	var starts sync.Map // task ID → when its handler started
	started := make(chan struct{}, n)
	release := make(chan struct{})
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		starts.Store(id, time.Now())
		started <- struct{}{}
		<-release
		return nil
	}, func(c *asynq.Config) { c.Concurrency = n })
	var once sync.Once
	stop := func() { once.Do(func() { close(release) }) }
	defer stop() // let the server shut down on failure

	t0 := time.Now()
	ids := hbEnqueue(t, h, started, 0, few)
	atFew := takeGoroutineCensus()
	ids = append(ids, hbEnqueue(t, h, started, few, n)...)
	hbCensus(t, atFew, few, n)
	t.Logf("%d handlers running %v after the first enqueue", n, time.Since(t0).Round(time.Millisecond))

	from := hook.snapshot()
	waitFor(t, hook.done, fmt.Sprintf("every lock extended %d times", hbRounds))
	elapsed := time.Since(t0)
	if elapsed < hbTTL {
		t.Fatalf("every lock extended %d times within %v, under the TTL %v: more often than each half TTL", hbRounds, elapsed, hbTTL)
	}
	hbCheckExtends(t, hook, &starts, ids, hook.snapshot().sub(from))
	hbCheckLocks(t, h, ids)
	if s := h.d.Stats(); s.LockLost != 0 {
		t.Errorf("LockLost = %d", s.LockLost)
	}

	stop()
	eventually(t, "all handlers settled", func() bool { return h.d.Stats().Processed == n })
	eventually(t, "all locks released", func() bool { return len(h.locks()) == 0 })
}

func (c extendCounts) sub(o extendCounts) extendCounts {
	return extendCounts{c.trips - o.trips, c.cmds - o.cmds, c.scripts - o.scripts, c.extends - o.extends,
		c.extendTrips - o.extendTrips, c.lost - o.lost, c.lookups - o.lookups, c.lookupTrips - o.lookupTrips}
}

// hbEnqueue enqueues tasks from to to (from 8 goroutines) and waits until
// their handlers run; it returns their IDs.
func hbEnqueue(t *testing.T, h *harness, started <-chan struct{}, from, to int) []string {
	t.Helper()
	ids := make([]string, to-from)
	errs := make([]error, to-from)
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 8 {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(ids); i = int(next.Add(1) - 1) {
				info, err := h.client.EnqueueContext(context.Background(), userTask(from+i, ""), asynq.Queue(h.queue))
				if errs[i] = err; err == nil {
					ids[i] = info.ID
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("enqueue: %v", err)
		}
	}
	for range ids {
		waitFor(t, started, "handlers running")
	}
	return ids
}

// hbCensus checks that n handlers running cost the heartbeat no more
// goroutines than few did: one loop, whatever the count.
func hbCensus(t *testing.T, atFew goroutineCensus, few, n int) {
	t.Helper()
	// Transient goroutines (asynq's periodic work) come and go: poll until
	// the census settles, with a deadline. A heartbeat per handler never
	// would: it keeps n-few more goroutines for as long as the handlers run.
	const slack = 20
	var atN goroutineCensus
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		atN = takeGoroutineCensus()
		if (atN.rest()-atFew.rest() <= slack && atN.dedupBG == atFew.dedupBG) || time.Now().After(deadline) {
			break
		}
	}
	for _, c := range []struct {
		running int
		g       goroutineCensus
	}{{few, atFew}, {n, atN}} {
		t.Logf("goroutines with %d handlers: %d (%d in handlers, %d asynq per-task, %d dedup background of which %d heartbeat, %d extends in flight, %d other)",
			c.running, c.g.total, c.g.handlers, c.g.asynqTask, c.g.dedupBG, c.g.heartbeat, c.g.extenders, c.g.rest()-c.g.dedupBG)
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
		t.Errorf("%d more goroutines (beyond the handlers' own, asynq's per-task ones and extends in flight) with %d handlers than with %d: want O(1)", grow, n, few)
	}
}

// hbCheckExtends checks what the extends of the tasks ids did: each task's
// first only once its handler had run one interval, all batched, none
// finding its key lost, and no more than the rounds the wait asked for
// (plus those under way): not one per beat.
func hbCheckExtends(t *testing.T, hook *extendHook, starts *sync.Map, ids []string, win extendCounts) {
	t.Helper()
	tasks := hook.extendedTasks()
	early := time.Duration(1<<63 - 1)
	for _, id := range ids {
		v, ok := starts.Load(id)
		e, extended := tasks[id]
		if !ok || !extended {
			t.Fatalf("task %s: started %v, extended %v", id, ok, extended)
		}
		early = min(early, e.first.Sub(v.(time.Time)))
	}
	total := hook.snapshot()
	t.Logf("extends: %d in %d round trips (%.1f a trip), %d finding the key lost; the earliest first extension %v after its handler started (interval %v); "+
		"%d lookups of a task's lock (its record's unique_key, once per attempt) in %d round trips; over the wait: %d round trips, %d commands, %d extends",
		total.extends, total.extendTrips, float64(total.extends)/float64(total.extendTrips), total.lost, early.Round(time.Millisecond), hbInterval,
		total.lookups, total.lookupTrips, win.trips, win.cmds, win.extends)
	if n := int64(len(ids)); total.lookups != n {
		t.Errorf("%d lookups of the locks of %d plain tasks: want one each (the lease keeps it)", total.lookups, n)
	}
	if slack := hbInterval / 5; early < hbInterval-slack {
		t.Errorf("a lock was first extended %v after its handler started: want one heartbeat interval (%v)", early, hbInterval)
	}
	if total.lost != 0 {
		t.Errorf("%d extends found the key no longer its task's", total.lost)
	}
	if n := int64(len(ids)); total.extends > n*(hbRounds+1) {
		t.Errorf("%d extends for %d handlers in %d rounds: extended more often than each half TTL", total.extends, n, hbRounds)
	}
	if total.extendTrips*2 > total.extends {
		t.Errorf("%d extends in %d round trips: want them batched (at least 2 a trip on average)", total.extends, total.extendTrips)
	}
	if win.scripts != win.extends {
		t.Errorf("%d script calls while the handlers ran, %d of them extends: plain tasks make no other", win.scripts, win.extends)
	}
}

// hbCheckLocks checks that each task's lock is still its own, and lives.
func hbCheckLocks(t *testing.T, h *harness, ids []string) {
	t.Helper()
	ctx := context.Background()
	vals := make([]*redis.StringCmd, len(ids))
	ttls := make([]*redis.DurationCmd, len(ids))
	if _, err := h.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, id := range ids {
			lock := taskLock(t, h.rdb, h.queue, id)
			vals[i], ttls[i] = p.Get(ctx, lock), p.PTTL(ctx, lock)
		}
		return nil
	}); err != nil {
		t.Fatalf("reading locks: %v", err)
	}
	for i, id := range ids {
		if v, d := vals[i].Val(), ttls[i].Val(); v != id || d <= 0 {
			t.Fatalf("task %s's lock: value %q, PTTL %v, after running past its TTL %v", id, v, d, hbTTL)
		}
	}
}

// BenchmarkHeartbeat measures one heartbeat round that extends 1,000
// running locks (lua/extend.lua, from ExtendAll's bounded fan-out):
// batched (auto-pipelining, the default Config.MaxBatch) and unbatched (a
// round trip per lock). ns/op is per round; it reports the round trips and
// extends of a round too, counted with a hook on the Dedup's client.
func BenchmarkHeartbeat(b *testing.B) {
	for _, c := range []struct {
		name     string
		maxBatch int
	}{{"batched", 0}, {"unbatched", -1}} {
		b.Run(c.name, func(b *testing.B) {
			d, hook, base := hbBenchLeases(b, Config{MaxBatch: c.maxBatch}, 1000)
			now := base
			round := func() {
				now = now.Add(time.Hour) // every lease due again (TTL one hour: each half hour)
				d.hb.beat(now)
			}
			round() // warm-up, untimed: fills the connection pool
			from := hook.snapshot()
			for b.Loop() {
				round()
			}
			c := hook.snapshot().sub(from)
			b.ReportMetric(float64(c.trips)/float64(b.N), "roundtrips/round")
			b.ReportMetric(float64(c.extends)/float64(b.N), "extends/round")
			if s := d.Stats(); s.LockLost != 0 || s.RedisErrors != 0 || c.lost != 0 {
				b.Fatalf("stats %+v, %d extends found the key lost", s, c.lost)
			}
		})
	}
}

// hbBenchLeases gives a Dedup n running attempts of tasks NewClient
// stored, registered with its heartbeat (whose loop does not run: the
// benchmark beats by hand) as started at base, with a hook on its client.
func hbBenchLeases(b *testing.B, cfg Config, n int) (*Dedup, *extendHook, time.Time) {
	rdb := newRDB(b)
	hook := newExtendHook(-1, 0)
	rdb.AddHook(hook)
	cfg.Prefix, cfg.Logger = "bench-"+uniq(b), quietLogger()
	ctx := context.Background()
	d, err := New(ctx, rdb, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	queue := "q-" + uniq(b)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	b.Cleanup(func() { _ = insp.DeleteQueue(queue, true) })
	base := time.Now()
	c := d.NewClient()
	for i := range n {
		info, err := c.EnqueueContext(ctx, userTask(i, ""), asynq.Queue(queue))
		if err != nil {
			b.Fatal(err)
		}
		lock := taskLock(b, rdb, queue, info.ID)
		l := &lease{ref: store.Ref{Queue: queue, ID: info.ID, Type: "user:reindex", Lock: lock, FP: fpOfLock(lock)},
			kind: store.IDPlain, ttl: time.Hour, cancel: func(error) {}}
		d.hb.add(l)
		d.hb.entries[l].since = base
	}
	b.Cleanup(func() { _ = rdb.Del(context.Background(), hbLockKeys(d, queue)...).Err() })
	return d, hook, base
}

// hbLockKeys lists the locks of queue the heartbeat of d extends.
func hbLockKeys(d *Dedup, queue string) []string {
	d.hb.mu.Lock()
	defer d.hb.mu.Unlock()
	var out []string
	for l := range d.hb.entries {
		if l.ref.Queue == queue {
			out = append(out, l.ref.Lock)
		}
	}
	return out
}

// BenchmarkMiddlewarePerTask measures what the middleware costs per task
// a worker runs (a handler that returns at once), by the Redis calls the
// Dedup's own client makes: none for a plain task NewClient stored, a
// Cooldown's, or a RunningDefer one that owes no follow-up, one at success
// for a Cooldown's under a caller-chosen ID, a start and a share of a
// shared release (releases.go: at most one a task) for a task that arrived without a lock.
// ns/op is per task; it reports scripts/task and cmds/task too.
func BenchmarkMiddlewarePerTask(b *testing.B) {
	needRealRedis(b)
	for _, c := range []struct {
		name    string
		scripts float64 // per task, as docs/lifecycle.md promises
		shared  bool    // plus a share of the shared releases (at most one a task)
		enqueue func(w *hbWorker, i int) error
	}{
		{"plain", 0, false, func(w *hbWorker, i int) error {
			_, err := w.client.Enqueue(userTask(i, ""), asynq.Queue(w.queue))
			return err
		}},
		{"cooldown", 0, false, func(w *hbWorker, i int) error { // (asynq's record of the success holds the key)
			_, err := w.client.Enqueue(userTask(i, ""), asynq.Queue(w.queue), Cooldown(time.Hour))
			return err
		}},
		{"cooldown-own-id", 1, false, func(w *hbWorker, i int) error {
			_, err := w.client.Enqueue(userTask(i, ""), asynq.Queue(w.queue), Cooldown(time.Hour), asynq.TaskID(fmt.Sprintf("own-%s-%d", w.queue, i)))
			return err
		}},
		{"arrived-without-lock", 1, true, func(w *hbWorker, i int) error {
			_, err := w.asynq.Enqueue(userTask(i, ""), asynq.Queue(w.queue))
			return err
		}},
		{"defer", 0, false, func(w *hbWorker, i int) error { // (no follow-up owed: the owed signal says so, owed.go)
			_, err := w.client.Enqueue(counterTask(fmt.Sprint("k", i), 1, 1), asynq.Queue(w.queue))
			return err
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			got := hbBenchWorker(b, c.enqueue)
			if got != c.scripts && (!c.shared || got < c.scripts || got > c.scripts+1) {
				b.Errorf("%.2f scripts per task, want %v (shared releases: %v)", got, c.scripts, c.shared)
			}
		})
	}
}

// hbWorker is a Dedup with a hook on its own client, NewClient and asynq's
// client (on another client), and a queue.
type hbWorker struct {
	d      *Dedup
	hook   *extendHook
	srvRDB redis.UniversalClient
	client *Client
	asynq  *asynq.Client
	queue  string
}

// hbBenchWorker enqueues b.N tasks with enqueue, then times a server with
// the middleware (8 workers, a handler that returns at once) running them
// all, and returns the scripts the Dedup's client called per task.
func hbBenchWorker(b *testing.B, enqueue func(w *hbWorker, i int) error) float64 {
	rdb := newRDB(b)
	w := &hbWorker{hook: newExtendHook(-1, 0), srvRDB: newRDB(b), queue: "q-" + uniq(b)}
	rdb.AddHook(w.hook)
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}) // (the "counter" type's; userTask's keep the defaults)
	cfg.Prefix, cfg.Logger = "bench-"+uniq(b), quietLogger()
	d, err := New(context.Background(), rdb, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	d.Middleware() // (its owed subscription confirmed before the first task runs)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if up, _ := d.owed.state(); up {
			d.owed.steady()
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("the owed subscription is not confirmed")
		}
	}
	w.d, w.client, w.asynq = d, d.NewClient(), asynq.NewClientFromRedisClient(w.srvRDB)
	insp := asynq.NewInspectorFromRedisClient(w.srvRDB)
	b.Cleanup(func() { _ = insp.DeleteQueue(w.queue, true) })
	for i := range b.N {
		if err := enqueue(w, i); err != nil {
			b.Fatal(err)
		}
	}
	from := w.hook.snapshot()
	b.ResetTimer()
	srv := asynq.NewServerFromRedisClient(w.srvRDB, asynq.Config{Concurrency: 8, Queues: map[string]int{w.queue: 1},
		TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel})
	if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))); err != nil {
		b.Fatal(err)
	}
	defer srv.Shutdown()
	// asynq counts a task processed in the script that marks it done,
	// after the middleware's last call: no signal but its counter.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		if n, _ := w.srvRDB.Get(context.Background(), store.ProcessedKey(w.queue)).Int(); n >= b.N {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d tasks not processed within a minute", b.N)
		}
	}
	b.StopTimer()
	c := w.hook.snapshot().sub(from)
	b.ReportMetric(float64(c.scripts)/float64(b.N), "scripts/task")
	b.ReportMetric(float64(c.cmds)/float64(b.N), "cmds/task")
	return float64(c.scripts) / float64(b.N)
}

// lookupFailer fails each HGET of a task's unique_key while armed, as a
// Redis error would.
type lookupFailer struct{ armed atomic.Bool }

func (f *lookupFailer) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f *lookupFailer) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if a := cmd.Args(); f.armed.Load() && cmd.Name() == "hget" && len(a) == 3 && a[2] == "unique_key" {
			err := fmt.Errorf("injected: connection reset")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}
func (f *lookupFailer) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A beat that cannot read a running plain task's lock from its record (a
// Redis error, the breaker open) must try again at the next beat, as it
// does when the extension itself fails (heartbeater.again): else the lock
// goes unextended for half its TTL, and one whose task waited long in its
// queue expires under the running handler.
func TestHeartbeatRetriesAFailedLockLookup(t *testing.T) {
	rdb := newRDB(t)
	fail, hook := &lookupFailer{}, newExtendHook(-1, 0)
	rdb.AddHook(hook)
	rdb.AddHook(fail)
	h := newHarnessOn(t, rdb, Config{})
	h.client = h.d.NewClient()
	info := h.enqueue(userTask(1, ""))
	// Its attempt runs, as the middleware registers a plain task's: the
	// lease learns the lock at its first beat (findLock). The heartbeat's
	// loop does not run (no Middleware): the test beats by hand.
	l := &lease{ref: store.Ref{Queue: h.queue, ID: info.ID, Type: "user:reindex"}, kind: store.IDPlain, ttl: h.d.ttlOf(&resolved{}), cancel: func(error) {}}
	hb, base := h.d.hb, time.Now()
	hb.add(l)
	hb.mu.Lock()
	hb.entries[l].since = base
	hb.mu.Unlock()

	fail.armed.Store(true)
	hb.beat(base.Add(hb.interval)) // due: the lookup fails
	fail.armed.Store(false)
	if c := hook.snapshot(); c.extends != 0 || c.lookups != 0 {
		t.Fatalf("the failed beat: %d extends, %d lookups answered", c.extends, c.lookups)
	}
	hb.beat(base.Add(2 * hb.interval)) // the next beat
	if c := hook.snapshot(); c.extends != 1 {
		t.Errorf("the beat after a failed lookup of a running task's lock made %d extends, %d lookups: its extension waits half the TTL (%v), not the next beat (%v)",
			c.extends, c.lookups, l.ttl/2, hb.interval)
	}
}

// The heartbeat renews the note that a handler asynq gave up still runs
// only while that handler runs: a beat that picked the attempt just before
// its handler returned makes no renewal after it (the handler's settle
// clears the note, and the task's next attempt, under the same ID, may
// hold the key by then). Before the return, the same beat renews the note.
func TestHeartbeatRenewsNoNoteAfterTheHandlerReturned(t *testing.T) {
	h := newHarnessOn(t, newRDB(t), Config{})
	h.client = h.d.NewClient()
	task := userTask(1, "")
	info := h.enqueue(task)
	key := h.keyOf(task, h.queue)
	for _, returned := range []bool{true, false} {
		// An attempt asynq gave up; the heartbeat's loop does not run (no
		// Middleware): the test beats by hand.
		l := &lease{ref: store.Ref{Queue: h.queue, ID: info.ID, Type: task.Type(), Lock: key}, kind: store.IDPlain, ttl: h.d.ttlOf(&resolved{}), cancel: func(error) {}}
		l.outlivedMark.Store(true)
		l.returned = returned
		h.d.hb.add(l)
		h.d.hb.beat(time.Now())
		h.d.hb.remove(l)
		noted := h.rdb.HExists(context.Background(), store.ModeOf(key), store.FieldOutlived).Val()
		if noted == returned {
			t.Errorf("handler returned %v: the beat left the note %v, want %v", returned, noted, !returned)
		}
	}
}
