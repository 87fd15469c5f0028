package dedup

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// state reads the subscription's state, for tests.
func (o *owedSignal) state() (up bool, gen uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.up, o.gen
}

// age makes everything the subscriber remembers (kept messages, quiet
// ends) d older, as though d had passed: for tests of what it forgets.
func (o *owedSignal) age(d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for id, at := range o.recent {
		o.recent[id] = at.Add(-d)
	}
	for i := range o.recentAt {
		o.recentAt[i].at = o.recentAt[i].at.Add(-d)
	}
	for id, q := range o.quiet {
		q.at = q.at.Add(-d)
		o.quiet[id] = q
	}
	for i := range o.order {
		o.order[i].at = o.order[i].at.Add(-d)
	}
}

// subscribed starts the Dedup's owed subscriber (as Middleware does) and
// waits for it to be confirmed; it returns its generation.
func subscribed(t *testing.T, d *Dedup) uint64 {
	t.Helper()
	d.Middleware()
	var gen uint64
	eventually(t, "the owed subscription is confirmed", func() bool {
		up, g := d.owed.state()
		gen = g
		return up
	})
	d.owed.steady()
	return gen
}

// steady makes the subscription's confirmation owedLookback old, as a
// worker's that has run a while (a test does not wait that long).
func (o *owedSignal) steady() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.since = o.since.Add(-owedLookback)
}

// deferHarness is a harness under Replace + RunningDefer whose Dedup's
// client counts the start and settle scripts it runs (and may gate them).
func deferHarness(t *testing.T, hooks ...redis.Hook) (*harness, *libraryScripts) {
	t.Helper()
	needRealRedis(t)
	base := newRDB(t).(*redis.Client).Options()
	rdb := redis.NewClient(&redis.Options{Addr: base.Addr, Password: base.Password, PoolSize: 64, ContextTimeoutEnabled: true, ClientName: "owed-" + uniq(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	calls := &libraryScripts{}
	rdb.AddHook(calls.hook())
	for _, hk := range hooks {
		rdb.AddHook(hk)
	}
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.LockTimeout = 10 * time.Second // (a gated settle stays within its bound)
	h := newHarnessOn(t, rdb, cfg)
	h.client = h.d.NewClient()
	return h, calls
}

// A task stored under Replace + RunningDefer that succeeds while no
// follow-up is owed to its key costs the worker no Redis call of the
// library's (asynq's done releases its key), once the owed subscription is
// confirmed; its key is free after it.
func TestDeferSuccessThatOwesNoFollowUpCostsTheWorkerNoRedisCall(t *testing.T) {
	h, calls := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	var ids []string
	for i := range 10 {
		ids = append(ids, h.enqueue(counterTask(fmt.Sprint("k", i), 1, 1)).ID)
	}
	h.serve(func(context.Context, *asynq.Task) error { return nil }, nil)
	eventually(t, "asynq records every success", func() bool {
		for _, id := range ids {
			if !h.finished(id) {
				return false
			}
		}
		return true
	})
	if n := calls.n.Load(); n != 0 {
		t.Fatalf("the middleware called start or settle %d times for %d tasks, want 0", n, len(ids))
	}
	res, err := h.client.Submit(ctx, counterTask("k0", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Created {
		t.Fatalf("enqueue after the success: %+v %v, want created (the key is free)", res, err)
	}
}

// A follow-up made while its holder runs, with no call at the holder's
// start, still runs after the holder, with the newest payload: the owed
// message makes the holder's end call.
func TestDeferFollowUpOfAQuietHolderRunsAfterItWithTheNewestPayload(t *testing.T) {
	h, calls := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	tr := newSeqTracker(1)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	a := h.enqueue(counterTask("k", 1, 1))
	waitSeqStart(tr, 1, 10*time.Second)
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the holder runs: %+v %v, want a follow-up", f, err)
	}
	if g, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil || g.TaskID != f.TaskID {
		t.Fatalf("second update: %+v %v, want folded into the follow-up %s", g, err, f.TaskID)
	}
	tr.open(1)
	r := waitSeqStart(tr, 3, 10*time.Second)
	if r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run with seq 3 after its holder %s: %+v", f.TaskID, a.ID, tr.runs())
	}
	if n := calls.n.Load(); n < 1 {
		t.Fatalf("the holder's end made %d calls, want its settle", n)
	}
}

// The in-flight race: a follow-up made after the holder's handler returned
// (its end made no call) and before asynq's done, whose settle by the owed
// subscriber comes after asynq's done deleted the lock, still gets queued
// and holds the key, and runs with its payload; whether asynq keeps the
// holder's record (completed) or deletes it.
func TestDeferFollowUpMadeAfterAQuietEndBeforeAsynqsDoneIsQueuedAndHoldsTheKey(t *testing.T) {
	for name, retention := range map[string]time.Duration{"kept": time.Hour, "deleted": 0} {
		t.Run(name, func(t *testing.T) {
			gate := newSettleGate()
			h, _ := deferHarness(t, gate)
			ctx := context.Background()
			subscribed(t, h.d)
			ended, resume := make(chan string, 1), make(chan struct{})
			type run struct {
				seq   int
				owner string
			}
			ran := make(chan run, 4)
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			mw := h.d.Middleware()(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
				ran <- run{decodeCounter(t).Seq, h.lockOwner(key)}
				return nil
			}))
			var once sync.Once
			outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
				err := mw.ProcessTask(ctx, task)
				once.Do(func() {
					id, _ := asynq.GetTaskID(ctx)
					ended <- id
					<-resume // the middleware returned; asynq's done has not run
				})
				return err
			})
			srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{h.queue: 1},
				TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure})
			if err := srv.Start(outer); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv.Shutdown)
			a := h.enqueue(counterTask("k", 1, 1), asynq.Retention(retention))
			if id := waitFor(t, ended, "the holder's end"); id != a.ID {
				t.Fatalf("ran %s", id)
			}
			if r := <-ran; r.seq != 1 {
				t.Fatalf("first run seq %d", r.seq)
			}
			gate.arm(a.ID)
			f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || f.Outcome != Deferred {
				t.Fatalf("update after the handler returned, before asynq's done: %+v %v, want a follow-up", f, err)
			}
			waitFor(t, gate.held, "the subscriber settles the quiet end")
			close(resume)
			eventually(t, "asynq's done deletes the lock", func() bool { return h.finished(a.ID) && h.lockOwner(key) == "" })
			gate.open()
			r := waitFor(t, ran, "the follow-up runs")
			if r.seq != 2 || r.owner != f.TaskID {
				t.Fatalf("ran seq %d holding %q, want the follow-up %s (seq 2) holding the key", r.seq, r.owner, f.TaskID)
			}
		})
	}
}

// settleGate is a go-redis hook that holds the settle script call naming
// one task ID until opened.
type settleGate struct {
	mu     sync.Mutex
	id     string
	held   chan struct{}
	opened chan struct{}
}

func newSettleGate() *settleGate {
	return &settleGate{held: make(chan struct{}, 1), opened: make(chan struct{})}
}

func (g *settleGate) arm(id string) { g.mu.Lock(); g.id = id; g.mu.Unlock() }
func (g *settleGate) open()         { close(g.opened) }

func (g *settleGate) wait(cmd redis.Cmder) {
	a := cmd.Args()
	if cmd.Name() != "evalsha" || len(a) < 2 || a[1] != store.ScriptHash("settle") {
		return
	}
	g.mu.Lock()
	id := g.id
	g.mu.Unlock()
	for _, v := range a[2:] {
		if s, ok := v.(string); ok && id != "" && s == id {
			g.held <- struct{}{}
			<-g.opened
			return
		}
	}
}

func (g *settleGate) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *settleGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { g.wait(cmd); return next(ctx, cmd) }
}
func (g *settleGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// Once the owed subscription is lost (its connection killed) while a task
// runs, the task's success calls settle, as before the signal existed:
// a message could have been missed. A task that begins once the subscription
// has been back a while (owedLookback) makes no call again.
func TestDeferSuccessCallsWhenTheOwedSubscriptionWasLostWhileItRan(t *testing.T) {
	h, calls := deferHarness(t)
	gen := subscribed(t, h.d)
	tr := newSeqTracker(1)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	a := h.enqueue(counterTask("k", 1, 1))
	waitSeqStart(tr, 1, 10*time.Second)
	killOwedSubscriber(t, h)
	eventually(t, "the subscription is back", func() bool {
		up, g := h.d.owed.state()
		return up && g > gen+1
	})
	tr.open(1)
	eventually(t, "asynq records the success", func() bool { return h.finished(a.ID) })
	if n := calls.n.Load(); n != 1 {
		t.Fatalf("the success made %d calls, want its settle", n)
	}
	h.d.owed.steady()
	b := h.enqueue(counterTask("k2", 1, 2))
	eventually(t, "asynq records the next success", func() bool { return h.finished(b.ID) })
	if n := calls.n.Load(); n != 1 {
		t.Fatalf("%d calls after the subscription came back, want none for the next task", n-1)
	}
}

// killOwedSubscriber kills the harness Dedup's subscribed connection (and
// only it: other tests' subscribers share the Redis), found by its client's
// name (deferHarness).
func killOwedSubscriber(t *testing.T, h *harness) {
	t.Helper()
	ctx := context.Background()
	name := h.rdb.(*redis.Client).Options().ClientName
	var id string
	eventually(t, "the subscriber's connection is listed", func() bool {
		for _, line := range strings.Split(h.rdb.ClientList(ctx).Val(), "\n") {
			fs := strings.Fields(line)
			if !slices.Contains(fs, "name="+name) || !slices.Contains(fs, "sub=1") {
				continue
			}
			for _, f := range fs {
				if v, ok := strings.CutPrefix(f, "id="); ok {
					id = v
					return true
				}
			}
		}
		return false
	})
	if err := h.rdb.Do(ctx, "CLIENT", "KILL", "ID", id).Err(); err != nil {
		t.Fatal(err)
	}
}

// A caller-chosen task ID may be used again once no task has it. A task
// under such an ID that ended quietly is remembered (quietLife); a new task
// under the same ID, holding the same key, may not have its key handed to
// its follow-up while it still runs: the follow-up runs after it, never
// beside it.
func TestDeferFollowUpOfATaskReusingAQuietlyEndedIDWaitsForItsHolder(t *testing.T) {
	h, calls := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	tr := newSeqTracker(2)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	first, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID("job-k"))
	if err != nil || first.Outcome != Created {
		t.Fatalf("first enqueue: %+v %v", first, err)
	}
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil {
		t.Fatal("the first task did not run")
	}
	eventually(t, "the first task's record and lock are gone", func() bool {
		return h.taskState("job-k") == 0 && h.lockOwner(key) == ""
	})
	if n := calls.n.Load(); n != 0 {
		t.Fatalf("the first success made %d calls; want a quiet end", n)
	}
	again, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID("job-k"))
	if err != nil || again.Outcome != Created {
		t.Fatalf("the ID used again: %+v %v, want created", again, err)
	}
	holder := waitSeqStart(tr, 2, 10*time.Second)
	if holder == nil {
		t.Fatal("the second task under the ID did not run")
	}
	f, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the holder runs: %+v %v, want a follow-up", f, err)
	}
	// The follow-up may not start while its holder (seq 2) runs.
	if r := waitSeqStart(tr, 3, 3*time.Second); r != nil {
		t.Fatalf("the follow-up %s started while its holder %s still ran (lock now %q, holder state %s); overlaps %v",
			r.id, holder.id, h.lockOwner(key), taskStateName(h, "job-k"), r.overlaps)
	}
	tr.open(2)
	if r := waitSeqStart(tr, 3, 10*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run after its holder: %+v", f.TaskID, r)
	}
}

// dialGate is a go-redis hook that holds new connections while closed.
type dialGate struct {
	mu sync.Mutex
	ch chan struct{} // nil: open
}

func (g *dialGate) close() { g.mu.Lock(); g.ch = make(chan struct{}); g.mu.Unlock() }
func (g *dialGate) open() {
	g.mu.Lock()
	if g.ch != nil {
		close(g.ch)
		g.ch = nil
	}
	g.mu.Unlock()
}

func (g *dialGate) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		g.mu.Lock()
		ch := g.ch
		g.mu.Unlock()
		if ch != nil {
			select {
			case <-ch:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return next(ctx, network, addr)
	}
}
func (g *dialGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (g *dialGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// A worker Dedup (w) on its own gated client, sharing h's prefix; h's
// Dedup only enqueues.
func gatedWorker(t *testing.T, h *harness) (*Dedup, *redis.Client, *dialGate) {
	t.Helper()
	base := newRDB(t).(*redis.Client).Options()
	gate := &dialGate{}
	rw := redis.NewClient(&redis.Options{Addr: base.Addr, Password: base.Password, PoolSize: 16, ContextTimeoutEnabled: true, ClientName: "owedw-" + uniq(t)})
	t.Cleanup(func() { _ = rw.Close() })
	rw.AddHook(gate)
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.Prefix, cfg.Logger = h.prefix, quietLogger()
	w, err := New(context.Background(), rw, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w, rw, gate
}

// killSubscriberOf kills rdb's subscribed connection, found by its name.
func killSubscriberOf(t *testing.T, rdb *redis.Client) {
	t.Helper()
	killOwedSubscriber(t, &harness{t: t, rdb: rdb})
}

// asynq marks a task active before the middleware begins watching it (another
// middleware may run first). A follow-up made of it while the owed
// subscription was down is not heard; if the handler begins once the
// subscription is back, its success must still hand the key to that
// follow-up (call), not end quietly and leave the follow-up parked for its
// TTL.
func TestDeferFollowUpMadeWhileTheSubscriptionWasDownRunsAfterAHolderThatBeganOnceItWasBack(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	w, rw, gate := gatedWorker(t, h)
	gen := subscribed(t, w)
	tr := newSeqTracker()
	mw := w.Middleware()(tr.handler())
	entered, release := make(chan string, 4), make(chan struct{})
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 4, Queues: map[string]int{h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure})
	var once sync.Once
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		first := false
		once.Do(func() { first = true })
		if first { // an earlier middleware (a limiter, say) holds the first task a moment
			id, _ := asynq.GetTaskID(ctx)
			entered <- id
			<-release
		}
		return mw.ProcessTask(ctx, task)
	})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	a := h.enqueue(counterTask("k", 1, 1))
	if id := waitFor(t, entered, "the holder is active"); id != a.ID {
		t.Fatalf("entered %s", id)
	}
	gate.close() // (the subscriber's reconnect waits: the kill's message loss is not yet known)
	killSubscriberOf(t, rw)
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the holder is active: %+v %v, want a follow-up", f, err)
	}
	gate.open()
	eventually(t, "the subscription is back", func() bool { up, g := w.owed.state(); return up && g > gen+1 })
	close(release)
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil || r.id != a.ID {
		t.Fatalf("the holder did not run: %+v", r)
	}
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder's end (holder %s, lock %q, follow-up state %s): %+v",
			f.TaskID, a.ID, h.lockOwner(h.keyOf(counterTask("k", 1, 1), h.queue)), taskStateName(h, f.TaskID), r)
	}
}

// Close stops the owed subscriber. A handler that began before Close and
// ends after it may not end quietly (the code's own promise: no attempt
// ends quietly after Close): a follow-up made of it meanwhile, unheard,
// must still run after it, not wait for its parking time (TTL).
func TestDeferFollowUpOfAHolderThatEndsAfterCloseRunsAfterIt(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	tr := newSeqTracker(1)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	p := newHarnessOn(t, newRDB(t), func() Config {
		c := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
		c.Prefix = h.prefix
		return c
	}())
	producer := p.d.NewClient()
	a := h.enqueue(counterTask("k", 1, 1))
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil {
		t.Fatal("the holder did not run")
	}
	if err := h.d.Close(); err != nil {
		t.Fatal(err)
	}
	f, err := producer.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the holder runs: %+v %v, want a follow-up", f, err)
	}
	tr.open(1)
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder %s's end (follow-up state %s): %+v",
			f.TaskID, a.ID, taskStateName(h, f.TaskID), r)
	}
}

// The same, through the sweep: when the owed subscription drops, the quiet
// ends of the last moments are settled again. One of a caller-chosen ID that
// a new task of the same key now holds (and runs under) may not release
// that task's key: an update while it runs is deferred behind it, never
// created beside it.
func TestDeferSweepAfterASubscriptionDropLeavesTheKeyOfATaskReusingAQuietlyEndedID(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	gen := subscribed(t, h.d)
	tr := newSeqTracker(2)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	if r, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID("job-k")); err != nil || r.Outcome != Created {
		t.Fatalf("first enqueue: %+v %v", r, err)
	}
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil {
		t.Fatal("the first task did not run")
	}
	eventually(t, "the first task's record and lock are gone", func() bool {
		return h.taskState("job-k") == 0 && h.lockOwner(key) == ""
	})
	if r, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID("job-k")); err != nil || r.Outcome != Created {
		t.Fatalf("the ID used again: %+v %v, want created", r, err)
	}
	if r := waitSeqStart(tr, 2, 10*time.Second); r == nil {
		t.Fatal("the second task under the ID did not run")
	}
	killOwedSubscriber(t, h)
	eventually(t, "the subscription is back", func() bool { up, g := h.d.owed.state(); return up && g > gen+1 })
	h.d.owed.wg.Wait() // the sweep is done
	if o := h.lockOwner(key); o != "job-k" {
		t.Errorf("the key's lock is %q while job-k (seq 2) runs, want job-k's", o)
	}
	r, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || r.Outcome != Deferred {
		t.Fatalf("update while job-k runs: %+v %v, want a follow-up deferred behind it", r, err)
	}
}

// The message for a task that asynq runs but whose handler has not begun
// (another middleware runs first) is kept for it; it may not be dropped
// before the handler begins, else its success ends quietly and the follow-up
// waits its TTL. Here the gap is quietLife and a bit, and another key's
// follow-up message comes meanwhile.
func TestDeferFollowUpMadeLongBeforeItsHoldersHandlerBeganRunsAfterIt(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	tr := newSeqTracker(10)
	t.Cleanup(tr.openAll)
	mw := h.d.Middleware()(tr.handler())
	entered, release := make(chan string, 1), make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 4, Queues: map[string]int{h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure})
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		if decodeCounter(task).Key == "a" && decodeCounter(task).Seq == 1 { // an earlier middleware holds it a while
			id, _ := asynq.GetTaskID(ctx)
			entered <- id
			<-release
		}
		return mw.ProcessTask(ctx, task)
	})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	t.Cleanup(tr.openAll) // (first: the shutdown would wait out b's held handler)
	a := h.enqueue(counterTask("a", 1, 1))
	waitFor(t, entered, "a is active")
	f, err := h.client.Submit(ctx, counterTask("a", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update of a: %+v %v, want a follow-up", f, err)
	}
	b := h.enqueue(counterTask("b", 1, 10))
	if waitSeqStart(tr, 10, 10*time.Second) == nil {
		t.Fatal("b did not run")
	}
	eventually(t, "a's owed message is kept", func() bool {
		h.d.owed.mu.Lock()
		defer h.d.owed.mu.Unlock()
		_, ok := h.d.owed.recent[a.ID]
		return ok
	})
	h.d.owed.age(quietLife + 500*time.Millisecond) // (what is under test is this length of time)
	if g, err := h.client.Submit(ctx, counterTask("b", 1, 11), asynq.Queue(h.queue)); err != nil || g.Outcome != Deferred {
		t.Fatalf("update of b: %+v %v, want a follow-up", g, err)
	}
	eventually(t, "b's owed message is heard", func() bool {
		h.d.owed.mu.Lock()
		defer h.d.owed.mu.Unlock()
		e := h.d.owed.running[b.ID]
		return e != nil && e.owed
	})
	close(release)
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil || r.id != a.ID {
		t.Fatalf("a did not run: %+v", r)
	}
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("a's follow-up %s did not run within 5 s of a's end (state %s): %+v", f.TaskID, taskStateName(h, f.TaskID), r)
	}
}

// A handler that succeeded (a quiet end) may still be retried by asynq: an
// outer middleware failed after it (a commit, say). A follow-up made while
// that retry runs must wait for the retry, not be handed the key by the
// first attempt's remembered quiet end.
func TestDeferFollowUpOfARetryAfterAQuietSuccessWaitsForTheRetry(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	type run struct {
		id         string
		seq, retry int
	}
	starts, ends := make(chan run, 8), make(chan run, 8)
	release := make(chan struct{})
	mw := h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		r := run{id, decodeCounter(task).Seq, n}
		starts <- r
		if n > 0 {
			<-release
		}
		ends <- r
		return nil
	}))
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		if n, _ := asynq.GetRetryCount(ctx); n == 0 && decodeCounter(task).Seq == 1 && err == nil {
			return errors.New("outer middleware: commit failed")
		}
		return err
	})
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 4, Queues: map[string]int{h.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond }})
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	a := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, ends, "the first attempt's handler succeeds")
	if r := waitFor(t, starts, "start"); r.retry != 0 {
		t.Fatalf("%+v", r)
	}
	if r := waitFor(t, starts, "the retry starts"); r.id != a.ID || r.retry != 1 {
		t.Fatalf("%+v", r)
	}
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update while the retry runs: %+v %v, want a follow-up", f, err)
	}
	select {
	case r := <-starts:
		t.Fatalf("%s (seq %d) started while the holder's retry still ran (lock %q)", r.id, r.seq, h.lockOwner(h.keyOf(counterTask("k", 1, 1), h.queue)))
	case <-time.After(3 * time.Second): // (an absence: bounded)
	}
	close(release)
	if r := waitFor(t, starts, "the follow-up runs"); r.id != f.TaskID {
		t.Fatalf("%+v", r)
	}
}

// replyHold is a go-redis hook that, for the first settle script call naming
// one task ID, signals once Redis has replied and holds the reply from its
// caller until released.
type replyHold struct {
	mu       sync.Mutex
	id       string
	done     bool
	replied  chan any
	released chan struct{}
}

func newReplyHold() *replyHold {
	return &replyHold{replied: make(chan any, 1), released: make(chan struct{})}
}

func (g *replyHold) arm(id string) { g.mu.Lock(); g.id = id; g.mu.Unlock() }
func (g *replyHold) release() {
	select {
	case <-g.released:
	default:
		close(g.released)
	}
}

func (g *replyHold) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *replyHold) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		a := cmd.Args()
		if cmd.Name() != "evalsha" || len(a) < 2 || a[1] != store.ScriptHash("settle") {
			return err
		}
		g.mu.Lock()
		id, hold := g.id, false
		for _, v := range a[2:] {
			if s, ok := v.(string); ok && id != "" && s == id && !g.done {
				hold, g.done = true, true
			}
		}
		g.mu.Unlock()
		if hold {
			var v any
			if c, ok := cmd.(*redis.Cmd); ok {
				v = c.Val()
			}
			g.replied <- v
			<-g.released
		}
		return err
	}
}
func (g *replyHold) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// hookedWorker is a worker Dedup on its own client (with hooks), sharing h's
// prefix; h's Dedup only enqueues (and may serve as a second worker).
func hookedWorker(t *testing.T, h *harness, hooks ...redis.Hook) (*Dedup, *redis.Client) {
	t.Helper()
	base := newRDB(t).(*redis.Client).Options()
	rw := redis.NewClient(&redis.Options{Addr: base.Addr, Password: base.Password, PoolSize: 16, ContextTimeoutEnabled: true, ClientName: "owedh-" + uniq(t)})
	t.Cleanup(func() { _ = rw.Close() })
	for _, hk := range hooks {
		rw.AddHook(hk)
	}
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.Prefix, cfg.Logger = h.prefix, quietLogger()
	w, err := New(context.Background(), rw, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w, rw
}

// A worker's graceful stop: asynq's Shutdown (which waits for the running
// task, and records its success: asynq's done), then the Dedup's Close. A
// holder that ended quietly, of which a follow-up was made after its
// handler returned and before asynq's done, has its end settled late by the
// owed subscriber once asynq's done released the lock. Close, coming just
// after Shutdown, may not drop that settle: the follow-up must still run
// (on another worker) within seconds, not wait its parking time (TTL).
func TestDeferFollowUpOfAQuietEndRunsWhenTheWorkerClosesRightAfterAsynqsDone(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	hold := newReplyHold()
	w, _ := hookedWorker(t, h, hold)
	subscribed(t, w)
	t.Cleanup(hold.release)
	mw := w.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	o := serveOuterHold(t, h, mw, nil) // (an outer middleware's work after the handler (a commit): asynq's done waits)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	a := h.enqueue(counterTask("k", 1, 1))
	if id := waitFor(t, o.ended, "the holder's handler returns"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	// Another worker (h's Dedup), which runs the follow-up once it is queued.
	tr := newSeqTracker()
	h.serve(tr.handler(), nil)
	hold.arm(a.ID)
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update after the handler returned, before asynq's done: %+v %v, want a follow-up", f, err)
	}
	if v := waitFor(t, hold.replied, "the owed subscriber's late settle is answered"); fmt.Sprint(v) != "[12]" {
		t.Fatalf("the late settle's first reply %v, want [12] (the lock still names the holder)", v)
	}
	// The worker stops: asynq's done runs as Shutdown waits for the task, then Close.
	o.resume()
	o.shutdown()
	if !h.finished(a.ID) || h.lockOwner(key) != "" {
		t.Fatalf("after Shutdown: holder %s finished %v, lock %q", a.ID, h.finished(a.ID), h.lockOwner(key))
	}
	closed := make(chan error, 1)
	go func() { closed <- w.Close() }()
	<-w.owed.quit  // Close has begun
	hold.release() // the late settle's answer ({12}, from before asynq's done) reaches it now
	if err := waitFor(t, closed, "Close returns"); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder %s's end (follow-up state %s, lock %q, due in %v): %+v",
			f.TaskID, a.ID, taskStateName(h, f.TaskID), h.lockOwner(key), dueIn(h, f.TaskID), r)
	}
}

// A holder that ended quietly may be put back by asynq before its done (a
// shutdown's timeout passes while an outer middleware still works): asynq
// runs it again, holding its key, and it is the attempt that must settle
// the key's follow-up at its end. A follow-up made after the first run's
// handler returned, before the put-back, was heard by the worker as owed by
// the quiet end; when the put-back runs on the same worker and ends more
// than quietLife after the first run (the late settle's reach), it must
// still hand the key to the follow-up, not end quietly and leave the
// follow-up parked for its TTL.
func TestDeferFollowUpOfAQuietHolderPutBackByAShutdownRunsAfterItsRunAgainOnTheSameWorker(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	subscribed(t, h.d)
	tr1 := newSeqTracker()
	mw := h.d.Middleware()(tr1.handler())
	o := serveOuterHold(t, h, mw, func(c *asynq.Config) { c.ShutdownTimeout = 100 * time.Millisecond }) // (an outer middleware still works as the shutdown's timeout passes)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	a := h.enqueue(counterTask("k", 1, 1))
	if id := waitFor(t, o.ended, "the holder's handler returns"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update after the handler returned, before asynq's done: %+v %v, want a follow-up", f, err)
	}
	eventually(t, "the owed message is heard for the quiet end", func() bool {
		h.d.owed.mu.Lock()
		defer h.d.owed.mu.Unlock()
		_, q := h.d.owed.quiet[a.ID]
		return !q
	})
	o.shutdown() // its timeout passes: asynq puts the holder back
	if st := h.taskState(a.ID); st != asynq.TaskStatePending || h.lockOwner(key) != a.ID {
		t.Fatalf("after the shutdown: holder state %v, lock %q; want it put back, holding the key", st, h.lockOwner(key))
	}
	// The same worker's new server runs it again.
	tr2 := newSeqTracker(1)
	t.Cleanup(tr2.openAll)
	h.serve(tr2.handler(), nil)
	if r := waitSeqStart(tr2, 1, 10*time.Second); r == nil || r.id != a.ID {
		t.Fatalf("the holder did not run again: %+v", r)
	}
	h.d.owed.wg.Wait() // the late settle of the first run's end gives up (quietLife)
	tr2.open(1)
	eventually(t, "asynq records the holder's success", func() bool { return h.finished(a.ID) })
	if r := waitSeqStart(tr2, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder %s's end (follow-up state %s, lock %q, due in %v): %+v",
			f.TaskID, a.ID, taskStateName(h, f.TaskID), h.lockOwner(key), dueIn(h, f.TaskID), r)
	}
}

// The same put-back across a rolling deploy: the worker that ran the holder
// (which ended quietly, and heard the follow-up's message after) stops, its
// asynq server putting the holder back, and closes; a new worker, whose
// subscription came up after the message, runs the holder again. That run
// must hand the key to the follow-up at its end, not end quietly and leave
// the follow-up parked for its TTL.
func TestDeferFollowUpOfAQuietHolderPutBackByAShutdownRunsAfterItsRunAgainOnANewWorker(t *testing.T) {
	h, _ := deferHarness(t)
	ctx := context.Background()
	w1, _ := hookedWorker(t, h)
	subscribed(t, w1)
	mw := w1.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	o := serveOuterHold(t, h, mw, func(c *asynq.Config) { c.ShutdownTimeout = 100 * time.Millisecond }) // (an outer middleware still works as the shutdown's timeout passes)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	a := h.enqueue(counterTask("k", 1, 1))
	if id := waitFor(t, o.ended, "the holder's handler returns"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update after the handler returned, before asynq's done: %+v %v, want a follow-up", f, err)
	}
	eventually(t, "the owed message is heard for the quiet end", func() bool {
		w1.owed.mu.Lock()
		defer w1.owed.mu.Unlock()
		_, q := w1.owed.quiet[a.ID]
		return !q
	})
	o.shutdown() // its timeout passes: asynq puts the holder back
	if st := h.taskState(a.ID); st != asynq.TaskStatePending || h.lockOwner(key) != a.ID {
		t.Fatalf("after the shutdown: holder state %v, lock %q; want it put back, holding the key", st, h.lockOwner(key))
	}
	if err := w1.Close(); err != nil {
		t.Fatal(err)
	}
	// The new worker.
	w2, _ := hookedWorker(t, h)
	subscribed(t, w2)
	tr := newSeqTracker()
	serveWith(t, h.rdb, w2, h.queue, tr.handler(), nil)
	if r := waitSeqStart(tr, 1, 10*time.Second); r == nil || r.id != a.ID {
		t.Fatalf("the holder did not run again: %+v", r)
	}
	eventually(t, "asynq records the holder's success", func() bool { return h.finished(a.ID) })
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder %s's end (follow-up state %s, lock %q, due in %v): %+v",
			f.TaskID, a.ID, taskStateName(h, f.TaskID), h.lockOwner(key), dueIn(h, f.TaskID), r)
	}
}

// A caller-chosen ID is free again once asynq's done deleted its task (no
// Retention). A holder under such an ID that ended quietly, of which a
// follow-up was made before asynq's done, is settled late by the owed
// subscriber once the lock is released; a new task that took the ID
// meanwhile, for another key, may not keep that settle from handing the
// first key to its follow-up: it runs within seconds of its holder's end,
// not after its parking time (TTL).
func TestDeferFollowUpOfAQuietEndRunsWhenItsCallerIDIsReusedForAnotherKeyBeforeTheLateSettle(t *testing.T) {
	hold := newReplyHold()
	h, _ := deferHarness(t, hold)
	ctx := context.Background()
	subscribed(t, h.d)
	t.Cleanup(hold.release)
	tr := newSeqTracker()
	mw := h.d.Middleware()(tr.handler())
	o := serveOuterHold(t, h, mw, func(c *asynq.Config) { c.Concurrency = 2; c.DelayedTaskCheckInterval = 100 * time.Millisecond }) // (the middleware returned; asynq's done has not run)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	if r, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID("job-x")); err != nil || r.Outcome != Created {
		t.Fatalf("first enqueue: %+v %v", r, err)
	}
	if id := waitFor(t, o.ended, "the holder's handler returns"); id != "job-x" {
		t.Fatalf("ran %s", id)
	}
	hold.arm("job-x")
	f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("update after the handler returned, before asynq's done: %+v %v, want a follow-up", f, err)
	}
	if v := waitFor(t, hold.replied, "the late settle is answered"); fmt.Sprint(v) != "[12]" {
		t.Fatalf("the late settle's first reply %v, want [12]", v)
	}
	o.resume()
	eventually(t, "asynq's done deletes the holder and its lock", func() bool { return h.taskState("job-x") == 0 && h.lockOwner(key) == "" })
	if r, err := h.client.Submit(ctx, counterTask("k2", 1, 10), asynq.Queue(h.queue), asynq.TaskID("job-x")); err != nil || r.Outcome != Created {
		t.Fatalf("the ID used again for another key: %+v %v, want created", r, err)
	}
	hold.release() // the late settle tries again
	if r := waitSeqStart(tr, 2, 5*time.Second); r == nil || r.id != f.TaskID {
		t.Fatalf("the follow-up %s did not run within 5 s of its holder job-x's end (follow-up state %s, lock %q, due in %v): %+v",
			f.TaskID, taskStateName(h, f.TaskID), h.lockOwner(key), dueIn(h, f.TaskID), r)
	}
}

// An operator who archives (or deletes) a holder that asynq put back after
// its quiet end (a shutdown's timeout) ends it: the follow-up made between
// the handler's return and the put-back, which the worker heard as owed by
// that end, runs within seconds, not after its parking time (TTL).
func TestDeferFollowUpOfAQuietHolderPutBackThenArchivedOrDeletedByAnOperatorRuns(t *testing.T) {
	for _, op := range []string{"archive", "delete"} {
		t.Run(op, func(t *testing.T) {
			h, _ := deferHarness(t)
			ctx := context.Background()
			subscribed(t, h.d)
			tr := newSeqTracker()
			mw := h.d.Middleware()(tr.handler())
			o := serveOuterHold(t, h, mw, func(c *asynq.Config) { c.ShutdownTimeout = 100 * time.Millisecond }) // (an outer middleware still works as the shutdown's timeout passes)
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			a := h.enqueue(counterTask("k", 1, 1))
			if id := waitFor(t, o.ended, "the holder's handler returns"); id != a.ID {
				t.Fatalf("ran %s", id)
			}
			f, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || f.Outcome != Deferred {
				t.Fatalf("update after the handler returned: %+v %v, want a follow-up", f, err)
			}
			o.shutdown() // asynq puts the holder back
			if st := h.taskState(a.ID); st != asynq.TaskStatePending {
				t.Fatalf("after the shutdown: holder state %v, want pending", st)
			}
			if op == "archive" {
				err = h.insp.ArchiveTask(h.queue, a.ID)
			} else {
				err = h.insp.DeleteTask(h.queue, a.ID)
			}
			if err != nil {
				t.Fatal(err)
			}
			w := newSeqTracker()
			h.serve(w.handler(), nil) // a worker to run the follow-up
			if r := waitSeqStart(w, 2, 5*time.Second); r == nil || r.id != f.TaskID {
				t.Fatalf("the follow-up %s did not run within 5 s of its holder %s being %sd (follow-up state %s, lock %q, due in %v): %+v",
					f.TaskID, a.ID, op, taskStateName(h, f.TaskID), h.lockOwner(key), dueIn(h, f.TaskID), r)
			}
		})
	}
}

// The owed subscriber keeps a message for a task not running here for
// recentLife (5 minutes): on a fleet, nearly every follow-up's message. It
// drops them oldest first as new ones come, so handling one more message,
// under the mutex every handler's begin and end take, does not scan those
// kept (BenchmarkOwedMessageWithManyKept measures it): a message older than
// recentLife goes, one younger stays for an attempt about to begin.
func TestOwedSubscriberDropsTheMessagesItKeptOldestFirst(t *testing.T) {
	o := &owedSignal{running: map[string]*owedEntry{}, recent: map[string]time.Time{}, quiet: map[string]quietEnd{}}
	now := time.Now()
	for i, age := range []time.Duration{recentLife + 2*time.Second, recentLife + time.Second, recentLife - time.Second} {
		id := fmt.Sprint("dd-", i)
		o.recent[id] = now.Add(-age)
		o.recentAt = append(o.recentAt, quietOrder{id: id, at: now.Add(-age)})
	}
	o.arrived(context.Background(), "df-new")
	if _, ok := o.recent["dd-2"]; len(o.recent) != 2 || !ok || len(o.recentAt) != 2 {
		t.Fatalf("kept %v (%d in order), want dd-2 and df-new", o.recent, len(o.recentAt))
	}
	e := &owedEntry{}
	o.running["dd-2"] = e
	o.begin(&lease{ref: store.Ref{ID: "dd-2"}})
	if !o.running["dd-2"].owed {
		t.Fatal("an attempt beginning after its message was kept is not told it owes a follow-up")
	}
}

// BenchmarkOwedMessageWithManyKept is the subscriber's cost per message
// with 300,000 kept (a steady 1000 follow-ups a second for recentLife).
func BenchmarkOwedMessageWithManyKept(b *testing.B) {
	o := &owedSignal{running: map[string]*owedEntry{}, recent: map[string]time.Time{}, quiet: map[string]quietEnd{}}
	now := time.Now()
	for i := range 300000 {
		at := now.Add(-time.Duration(300000-i) * time.Millisecond)
		id := fmt.Sprint("dd-", i)
		o.recent[id] = at
		o.recentAt = append(o.recentAt, quietOrder{id: id, at: at})
	}
	b.ResetTimer()
	for i := range b.N {
		o.arrived(context.Background(), fmt.Sprint("df-", i))
	}
}

// outerHold is an asynq server (one worker, unless tweaked) running mw under
// an outer middleware that, once mw returns for the first task, sends the
// task's ID on ended and waits for resume: its own work after the handler
// (a commit), during which asynq's done waits. shutdown stops the server
// once; both run at cleanup.
type outerHold struct {
	ended    <-chan string
	resume   func()
	shutdown func()
}

func serveOuterHold(t *testing.T, h *harness, mw asynq.Handler, tweak func(*asynq.Config)) *outerHold {
	t.Helper()
	ended, resume := make(chan string, 1), make(chan struct{})
	var resumeOnce, once, shutOnce sync.Once
	o := &outerHold{ended: ended, resume: func() { resumeOnce.Do(func() { close(resume) }) }}
	t.Cleanup(o.resume)
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := mw.ProcessTask(ctx, task)
		once.Do(func() {
			id, _ := asynq.GetTaskID(ctx)
			ended <- id
			<-resume
		})
		return err
	})
	cfg := asynq.Config{Concurrency: 1, Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.FatalLevel, IsFailure: IsFailure}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(h.rdb, cfg)
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	o.shutdown = func() { shutOnce.Do(srv.Shutdown) }
	t.Cleanup(o.shutdown)
	return o
}
