package dedup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// leakOpts ignores what the fallback miniredis runs per connection.
func leakOpts() []goleak.Option {
	return []goleak.Option{goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer.func2"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).ServeConn.func1")}
}

// diagDedup is a Dedup on rdb under prefix, closed when the test ends.
func diagDedup(t *testing.T, rdb redis.UniversalClient, prefix string) *Dedup {
	t.Helper()
	d, err := New(context.Background(), rdb, Config{Prefix: prefix, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func countN(d *Dedup, typ string, e event, n int) {
	for range n {
		d.count(typ, e)
	}
}

func readStats(t *testing.T, rdb redis.UniversalClient, prefix string) map[string]Stats {
	t.Helper()
	s, err := ReadStats(context.Background(), rdb, prefix)
	if err != nil {
		t.Fatalf("ReadStats: %v", err)
	}
	return s
}

// Every event has a name and a Stats field of its own, so a new event
// cannot be added without being flushed, read back and exported.
func TestEventNamesCoverStats(t *testing.T) {
	if n := reflect.TypeFor[Stats]().NumField(); n != int(numEvents) {
		t.Fatalf("Stats has %d fields, there are %d events", n, numEvents)
	}
	seenName := map[string]bool{}
	seenField := map[*uint64]bool{}
	var s Stats
	for e := range numEvents {
		name := eventNames[e]
		if name == "" || seenName[name] {
			t.Fatalf("event %d: name %q empty or repeated", e, name)
		}
		seenName[name] = true
		f := s.field(e)
		if seenField[f] {
			t.Fatalf("event %s: Stats field shared", name)
		}
		seenField[f] = true
		*f = uint64(e) + 1
	}
	m := s.Map()
	for i, name := range eventNames[:] {
		if m[name] != uint64(i)+1 {
			t.Fatalf("Map()[%q] = %d, want %d", name, m[name], i+1)
		}
	}
	// Field order follows event order.
	v := reflect.ValueOf(s)
	for i := range v.NumField() {
		if v.Field(i).Uint() != uint64(i)+1 {
			t.Fatalf("Stats field %s is not event %s", v.Type().Field(i).Name, eventNames[i])
		}
	}
}

func TestStatsByType(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	countN(d, "a", evLocked, 3)
	countN(d, "b", evDuplicate, 2)
	countN(d, "b", evReplaced, 1)
	got := d.StatsByType()
	want := map[string]Stats{"a": {Locked: 3}, "b": {Duplicates: 2, Replaced: 1}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("StatsByType = %+v, want %+v", got, want)
	}
	if s := d.Stats(); s != (Stats{Locked: 3, Duplicates: 2, Replaced: 1}) {
		t.Fatalf("Stats = %+v", s)
	}
}

// Two processes flush into the same totals; each flush adds only what was
// counted since the one before.
func TestFlushAddsDeltasOfAllProcesses(t *testing.T) {
	rdb := newRDB(t)
	prefix := uniq(t)
	ctx := context.Background()
	p1, p2 := diagDedup(t, rdb, prefix), diagDedup(t, rdb, prefix)
	const odd = "email:send {x}" // any type name: colons, braces, spaces
	countN(p1, odd, evLocked, 5)
	countN(p1, odd, evReplaced, 2)
	countN(p2, odd, evLocked, 1)
	countN(p2, "other", evLockLost, 4)
	for _, d := range []*Dedup{p1, p2} {
		if err := d.FlushStats(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]Stats{odd: {Locked: 6, Replaced: 2}, "other": {LockLost: 4}}
	if got := readStats(t, rdb, prefix); !reflect.DeepEqual(got, want) {
		t.Fatalf("totals %+v, want %+v", got, want)
	}
	// Nothing new: nothing added. Then only the new counts.
	if err := p1.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	countN(p1, odd, evLocked, 1)
	countN(p2, "other", evProcessed, 1)
	for _, d := range []*Dedup{p1, p2, p1} {
		if err := d.FlushStats(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want = map[string]Stats{odd: {Locked: 7, Replaced: 2}, "other": {LockLost: 4, Processed: 1}}
	if got := readStats(t, rdb, prefix); !reflect.DeepEqual(got, want) {
		t.Fatalf("totals %+v, want %+v", got, want)
	}
	// Another prefix sees nothing.
	if got := readStats(t, rdb, prefix+"-other"); len(got) != 0 {
		t.Fatalf("other prefix: %+v", got)
	}
	if m, _ := rdb.SMembers(ctx, statsTypesKey(prefix)).Result(); len(m) != 2 {
		t.Fatalf("types set %v", m)
	}
}

// A flush is one pipelined round trip, however many types and events.
func TestFlushIsOneRoundTrip(t *testing.T) {
	rdb := newRDB(t)
	prefix := uniq(t)
	d := diagDedup(t, rdb, prefix)
	for i := range 20 {
		countN(d, "t"+string(rune('a'+i)), evLocked, i+1)
		countN(d, "t"+string(rune('a'+i)), evReleased, 1)
	}
	hook := &countingHook{}
	rdb.AddHook(hook)
	if err := d.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	hook.mu.Lock()
	single, pipes := hook.single, hook.pipes
	hook.mu.Unlock()
	// Connection set-up (HELLO, CLIENT SETINFO) may show up too: look at
	// the stats commands only.
	if len(single) != 0 || len(pipes) != 1 || len(pipes[0]) != 20*2+1 {
		t.Fatalf("flush sent single commands %v and pipelines %v; want one pipeline of 41 commands", single, pipes)
	}
	if got := readStats(t, rdb, prefix); got["tt"].Locked != 20 || got["ta"].Released != 1 || len(got) != 20 {
		t.Fatalf("totals %+v", got)
	}
}

// countingHook records the stats commands (HINCRBY, SADD) a client sends,
// alone or in pipelines.
type countingHook struct {
	mu     sync.Mutex
	single []string
	pipes  [][]string
}

func isStatsCmd(c redis.Cmder) bool { return c.Name() == "hincrby" || c.Name() == "sadd" }

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isStatsCmd(cmd) {
			h.mu.Lock()
			h.single = append(h.single, cmd.Name())
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var names []string
		for _, c := range cmds {
			if isStatsCmd(c) {
				names = append(names, c.Name())
			}
		}
		if len(names) > 0 {
			h.mu.Lock()
			h.pipes = append(h.pipes, names)
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// A command that fails keeps its counts for the next flush; the commands
// that went through in the same pipeline are not sent again.
func TestFlushPartialFailureKeepsCounts(t *testing.T) {
	rdb := newRDB(t)
	prefix := uniq(t)
	ctx := context.Background()
	d := diagDedup(t, rdb, prefix)
	countN(d, "good", evLocked, 2)
	countN(d, "bad", evLocked, 3)
	// Make the "bad" hash unwritable: HINCRBY fails with WRONGTYPE.
	if err := rdb.Set(ctx, statsKey(prefix, "bad"), "not a hash", 0).Err(); err != nil {
		t.Fatal(err)
	}
	err := d.FlushStats(ctx)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("flush error %v, want ErrUnavailable", err)
	}
	if err := rdb.Del(ctx, statsKey(prefix, "bad")).Err(); err != nil {
		t.Fatal(err)
	}
	countN(d, "good", evLocked, 1)
	if err := d.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[string]Stats{"good": {Locked: 3}, "bad": {Locked: 3}}
	if got := readStats(t, rdb, prefix); !reflect.DeepEqual(got, want) {
		t.Fatalf("totals %+v, want %+v", got, want)
	}
}

// Redis down: the flush fails, counts stay, and go out once it is back.
// Deleting the keys starts the totals again; the types set is refilled.
func TestFlushOutageKeepsCounts(t *testing.T) {
	t.Parallel()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	d := diagDedup(t, rdb, "p")
	countN(d, "x", evLocked, 4)
	if err := d.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	mr.Close()
	countN(d, "x", evLocked, 1)
	countN(d, "x", evRedisError, 1)
	for range 2 {
		if err := d.FlushStats(ctx); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("flush with Redis down: %v", err)
		}
	}
	if err := mr.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := d.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readStats(t, rdb, "p"); got["x"] != (Stats{Locked: 5, RedisErrors: 1}) {
		t.Fatalf("totals %+v", got)
	}
	mr.FlushAll()
	countN(d, "x", evLocked, 1)
	if err := d.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readStats(t, rdb, "p"); got["x"] != (Stats{Locked: 1}) {
		t.Fatalf("totals after reset %+v", got)
	}
}

// A flush while Redis refuses connections (the server is gone) says why,
// as a lock call does: ErrUnavailable, "connection refused", and the dial
// error kept for errors.As, not the bare cancellation of the call; with
// the caller's client (ContextTimeoutEnabled) and the library's own copy
// of it alike.
func TestFlushStatsWithRedisRefusingConnectionsSaysWhy(t *testing.T) {
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", shared), func(t *testing.T) {
			p, rdb := ownRedis(t, func(o *redis.Options) { o.ContextTimeoutEnabled = shared })
			d := diagDedup(t, rdb, uniq(t))
			ctx := context.Background()
			countN(d, "x", evLocked, 1)
			if err := d.FlushStats(ctx); err != nil {
				t.Fatal(err) // warm: connections pooled
			}
			p.Kill() // nothing listens on its port now
			countN(d, "x", evLocked, 1)
			err := d.FlushStats(ctx)
			var dial *net.OpError
			switch {
			case !errors.Is(err, ErrUnavailable):
				t.Fatalf("flush: %v, want ErrUnavailable", err)
			case !strings.Contains(err.Error(), "connection refused"):
				t.Fatalf("flush: %q does not say the connection was refused", err)
			case !errors.As(err, &dial) || dial.Op != "dial":
				t.Fatalf("flush: %v does not keep the dial error (got %#v)", err, dial)
			}
		})
	}
}

func TestFlusherTicksAndFlushesOnClose(t *testing.T) {
	rdb := newRDB(t) // before the leak check: the fallback miniredis outlives it
	defer goleak.VerifyNone(t, leakOpts()...)
	prefix := uniq(t)
	d, err := New(context.Background(), rdb, Config{Prefix: prefix, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.StartFlusher(5 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	countN(d, "t", evLocked, 2)
	eventually(t, "flusher flushed", func() bool { return readStats(t, rdb, prefix)["t"].Locked == 2 })

	// A long interval: only Close flushes. Restarting keeps what was flushed.
	if err := d.StartFlusher(time.Hour); err != nil {
		t.Fatal(err)
	}
	countN(d, "t", evReleased, 2)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if got := readStats(t, rdb, prefix)["t"]; got != (Stats{Locked: 2, Released: 2}) {
		t.Fatalf("after Close: %+v", got)
	}
	_ = d.Close()
	if err := d.StartFlusher(time.Second); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("StartFlusher after Close: %v", err)
	}
}

// Close returns the failure of its last flush (Redis gone), naming it and
// keeping its cause, and still closes the rest: the client it owns, the
// flusher (StartFlusher fails after it); a second Close has nothing to
// report.
func TestCloseReportsAFailedFinalFlush(t *testing.T) {
	p, rdb := ownRedis(t, nil)
	ctx := context.Background()
	d, err := NewFromRedisConnOpt(ctx, asynq.RedisClientOpt{Addr: rdb.Options().Addr}, Config{Prefix: uniq(t), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.StartFlusher(time.Hour); err != nil { // only Close flushes
		t.Fatal(err)
	}
	countN(d, "t", evLocked, 1)
	p.Kill() // nothing listens on its port now
	err = d.Close()
	var dial *net.OpError
	switch {
	case !errors.Is(err, ErrUnavailable) || !errors.As(err, &dial):
		t.Fatalf("Close: %v, want the flush's ErrUnavailable with its dial error", err)
	case !strings.Contains(err.Error(), "final stats flush failed"):
		t.Fatalf("Close: %q does not name the final stats flush", err)
	case strings.Count(err.Error(), "dedup:") != 1:
		t.Fatalf("Close: %q names the package more than once", err)
	}
	if err := d.rdb.Ping(ctx).Err(); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("the Dedup's own client after Close: %v, want closed", err)
	}
	if err := d.StartFlusher(time.Second); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("StartFlusher after Close: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestStartFlusherRejectsNegative(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	if err := d.StartFlusher(-time.Second); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("negative interval: %v", err)
	}
}

func TestReadStatsIgnoresForeignFields(t *testing.T) {
	rdb := newRDB(t)
	prefix := uniq(t)
	ctx := context.Background()
	rdb.SAdd(ctx, statsTypesKey(prefix), "t", "gone")
	rdb.HSet(ctx, statsKey(prefix, "t"), "locked", "7", "future_event", "3", "released", "junk")
	got := readStats(t, rdb, prefix)
	want := map[string]Stats{"t": {Locked: 7}, "gone": {}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ReadStats = %+v, want %+v", got, want)
	}
}

// TestReadStatsAddsRenamedEvents: a stats hash flushed before the rename
// of coalesced (replaced) and failure_held (fail_held) keeps its counts.
func TestReadStatsAddsRenamedEvents(t *testing.T) {
	rdb := newRDB(t)
	prefix := uniq(t)
	ctx := context.Background()
	rdb.SAdd(ctx, statsTypesKey(prefix), "t")
	rdb.HSet(ctx, statsKey(prefix, "t"), "coalesced", "4", "replaced", "2", "failure_held", "1")
	got := readStats(t, rdb, prefix)
	want := map[string]Stats{"t": {Replaced: 6, FailHeld: 1}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ReadStats = %+v, want %+v", got, want)
	}
}

func TestReadStatsDefaultPrefixAndErrors(t *testing.T) {
	t.Parallel()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	rdb.SAdd(ctx, "dedup:stats:types", "t")
	rdb.HSet(ctx, "dedup:stats:type:t", "duplicate", 2)
	if got := readStats(t, rdb, ""); got["t"] != (Stats{Duplicates: 2}) {
		t.Fatalf("default prefix: %+v", got)
	}
	mr.Close()
	if _, err := ReadStats(ctx, rdb, ""); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Redis down: %v", err)
	}
}

func BenchmarkCount(b *testing.B) {
	rdb := newRDB(b)
	d, err := New(context.Background(), rdb, Config{Prefix: uniq(b), Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			d.count("bench", evLocked)
		}
	})
}

// README (operations): a RunningAllow task counts started, released (only
// when a lock was actually dropped as it started) and processed. A
// RunningAllow task from asynq's own client (no lock to drop), one that
// fails once (its retry finds no lock) and one that panics once: exact
// counts, no release counted for nothing, nothing held.
func TestRunningAllowCountsExactly(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"a11:allow": {Fields: []string{"user_id"}, OnRunning: RunningAllow}}})
	var mu sync.Mutex
	tries := map[string]int{}
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		tries[id]++
		n := tries[id]
		mu.Unlock()
		switch {
		case task.Type() == "a11:allow:fail" && n == 1:
			return errors.New("a11: first attempt fails")
		case task.Type() == "a11:allow:panic" && n == 1:
			panic("a11: first attempt panics")
		}
		return nil
	}, nil)
	if _, err := h.asynq.Enqueue(asynq.NewTask("a11:allow:arrival", []byte(`{"user_id":1}`)), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	h.enqueue(asynq.NewTask("a11:allow:fail", []byte(`{"user_id":2}`)))
	if _, err := h.d.NewClient().Enqueue(asynq.NewTask("a11:allow:panic", []byte(`{"user_id":3}`)), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	want := map[string][3]uint64{ // started, processed, released
		"a11:allow:arrival": {1, 1, 0},
		"a11:allow:fail":    {2, 2, 1},
		"a11:allow:panic":   {2, 2, 1},
	}
	eventually(t, "every task done", func() bool {
		by := h.d.StatsByType()
		for typ, w := range want {
			if by[typ].Processed < w[1] {
				return false
			}
		}
		return h.queueSize(h.queue) == 0
	})
	by := h.d.StatsByType()
	for typ, w := range want {
		s := by[typ]
		if s.Started != w[0] || s.Processed != w[1] || s.Released != w[2] || s.Held != 0 || s.Busy != 0 || s.LockLost != 0 {
			t.Errorf("%s: %v; want started %d processed %d released %d, nothing held, busy or lost", typ, s.Map(), w[0], w[1], w[2])
		}
	}
	if len(h.locks()) != 0 {
		t.Errorf("locks left: %v", h.locks())
	}
}

// A success whose lock could not be released (Redis did not answer the
// call that releases it) counts a Redis error, not a release: Released
// counts locks released. So for a task that arrived without a lock, whose
// success is released together with others (releases.go).
func TestArrivalSuccessWhoseReleaseFailedIsNotCountedReleased(t *testing.T) {
	h := newHarness(t, Config{})
	proxy, slow := proxiedLockStore(t, h, Config{LockTimeout: 200 * time.Millisecond})
	t.Cleanup(proxy.resume)
	serveWith(t, h.rdb, slow, h.queue, asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		proxy.stall() // (the attempt's start went through; its end's call does not)
		return nil
	}), nil)
	info, err := h.asynq.Enqueue(userTask(1, ""), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the release fails", func() bool { return slow.Stats().RedisErrors >= 1 })
	eventually(t, "asynq done with it", func() bool { return h.finished(info.ID) })
	if s := slow.Stats(); s.Processed != 1 || s.RedisErrors != 1 || s.Released != 0 {
		t.Fatalf("processed %d, redis errors %d, released %d; want 1, 1, 0", s.Processed, s.RedisErrors, s.Released)
	}
}

// A task that arrived without a lock may find its key held under its own
// ID already, in another form than a start's: a caller-chosen ID that
// WrapClient took the key for ('~w'), whose task an operator deleted
// before it ran, enqueued again through asynq's client. Its start takes
// the lock as its own, as it is; its success must release that lock and
// count it released, as a settle did, not count it lost (the shared
// release compares the value with '~a<token>:<id>' only) and leave it for
// the key's next use to heal.
func TestArrivalSuccessUnderALockItsIDHeldAlreadyIsReleased(t *testing.T) {
	h := newHarness(t, Config{})
	task := userTask(1, "")
	key := h.keyOf(task, h.queue)
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID("job-1")); err != nil {
		t.Fatal(err)
	}
	if err := h.insp.DeleteTask(h.queue, "job-1"); err != nil {
		t.Fatal(err)
	}
	if owner := h.lockOwner(key); owner != "job-1" {
		t.Fatalf("lock owner %q after the delete, want job-1 (its lock stays for the key's next use)", owner)
	}
	ran := make(chan struct{}, 1)
	h.serve(func(context.Context, *asynq.Task) error { ran <- struct{}{}; return nil }, nil)
	info, err := h.asynq.Enqueue(task, asynq.Queue(h.queue), asynq.TaskID("job-1"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "job-1 runs")
	eventually(t, "asynq done with it", func() bool { return h.finished(info.ID) })
	eventually(t, "its end counted", func() bool { s := h.d.Stats(); return s.Released+s.LockLost+s.RedisErrors >= 1 })
	if s := h.d.Stats(); s.Released != 1 || s.LockLost != 0 {
		t.Fatalf("released %d, lock lost %d; want 1, 0 (the lock was its own)", s.Released, s.LockLost)
	}
	if owner := h.lockOwner(key); owner != "" {
		t.Fatalf("lock left after its success, owner %q", owner)
	}
}

// holdReleaseAll holds the first release_all call back before it is sent
// until resume is closed (reached: it is about to be sent).
type holdReleaseAll struct {
	once    sync.Once
	reached chan struct{}
	resume  chan struct{}
}

func (p *holdReleaseAll) before(c redis.Cmder) {
	if isScript(c, "release_all") {
		p.once.Do(func() { close(p.reached); <-p.resume })
	}
}

// A task that arrived without a lock succeeds; its lock is released with
// the other successes of the moment, and the handler's result reaches
// asynq only once that release has answered. So asynq never records the
// success (and the key's next enqueue never heals the lock) before the
// release: it is counted Released, never a lost lock, and no warning is
// logged (were it sent after asynq's done, every success of a key enqueued
// again at once would count a lost lock and warn).
func TestArrivalSuccessIsReleasedBeforeAsynqRecordsIt(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, Config{})
	hold := &holdReleaseAll{reached: make(chan struct{}), resume: make(chan struct{})}
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	rdb.AddHook(redistest.CmdHook(hold.before))
	var logs lockedLog
	worker, err := New(context.Background(), rdb, Config{Prefix: h.prefix, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = worker.Close() })
	t.Cleanup(func() {
		select {
		case <-hold.resume:
		default:
			close(hold.resume)
		}
	})
	task := userTask(1, "")
	key := h.keyOf(task, h.queue)
	serveWith(t, h.rdb, worker, h.queue, asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }), nil)
	info, err := h.asynq.Enqueue(task, asynq.Queue(h.queue)) // past the wrapper: it takes its lock as it starts
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, hold.reached, "its success's release about to be sent")
	if st := h.taskState(info.ID); st != asynq.TaskStateActive {
		t.Fatalf("asynq records the task %v while its lock's release is still to be sent, want active", st)
	}
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, new(*DuplicateTaskError)) {
		t.Fatalf("enqueue of the key before the release: %v, want a duplicate of the running task", err)
	}
	close(hold.resume)
	eventually(t, "asynq done with it", func() bool { return h.finished(info.ID) })
	if owner := h.lockOwner(key); owner != "" {
		t.Fatalf("lock left after the success, owner %q", owner)
	}
	if s := worker.Stats(); s.Released != 1 || s.LockLost != 0 {
		t.Fatalf("released %d, lock lost %d; want 1, 0", s.Released, s.LockLost)
	}
	if strings.Contains(logs.String(), "no longer this task's") {
		t.Fatalf("a success warned of a lost lock:\n%s", logs.String())
	}
}

// lockedLog is a log sink written from several goroutines.
type lockedLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
