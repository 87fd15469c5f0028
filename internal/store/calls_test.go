package store

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// How the Store's calls share pipelines and nodes (batch.go, shard.go),
// seen through the scripts a worker calls most: Start, of a task whose key
// is its own.

// ownKey writes the lock of a fresh key n of queue q held by its running
// task, and returns the task's Ref.
func ownKey(t *testing.T, rdb redis.UniversalClient, s *Store, q string, n int) Ref {
	t.Helper()
	ctx := context.Background()
	fp := fmt.Sprintf("%016x", 0xa10000+n)
	r := s.ref(q, fp, NewPlainID())
	if err := rdb.Set(ctx, r.Lock, Value(r.ID), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	putTask(rdb, q, r.ID, StateActive)
	t.Cleanup(func() { rdb.Del(context.Background(), r.Lock, TaskKey(q, r.ID)) })
	return r
}

func startOwn(ctx context.Context, s *Store, r Ref) (StartResult, error) {
	return s.Start(ctx, &Start{Ref: r, TTL: time.Minute})
}

// seenHook signals each script call carrying a key with mark, as it is sent.
type seenHook struct {
	mark string
	seen chan struct{} // buffered; signals beyond its room are dropped
}

func (h *seenHook) check(cmd redis.Cmder) {
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && strings.Contains(s, h.mark) {
			select {
			case h.seen <- struct{}{}:
			default:
			}
			return
		}
	}
}

// queuesOnTwoMasters returns two queue names whose hash tags are served by
// different masters of c.
func queuesOnTwoMasters(t *testing.T, c *redis.ClusterClient, base string) (string, string) {
	t.Helper()
	ctx := context.Background()
	var first, firstAddr string
	for i := 0; i < 1000; i++ {
		q := fmt.Sprintf("%s-%d", base, i)
		node, err := c.MasterForKey(ctx, "{"+q+"}")
		if err != nil {
			t.Fatal(err)
		}
		switch addr := node.Options().Addr; {
		case first == "":
			first, firstAddr = q, addr
		case addr != firstAddr:
			return first, q
		}
	}
	t.Fatal("no two queues on different masters")
	return "", ""
}

// shard.go: "a master that fails opens only its own breaker and stalls only
// its own pipelines, while calls for the other masters' slots go on".
//
// One master hangs (CLIENT PAUSE: a partitioned or stalled node) while
// calls of its queue hold every slot a batcher has. A call of a queue on a
// healthy master, with a deadline shorter than LockTimeout (asynq's
// Timeout, say), is answered at once; and an AcquireAll spanning both
// masters answers the healthy one's call before its deadline, whatever the
// hung one does.
func TestCallsOfAHealthyMasterDoNotWaitForAHungOne(t *testing.T) {
	procs, _ := redistest.OwnCluster(t, 3, false)
	var addrs []string
	for _, p := range procs {
		addrs = append(addrs, p.Addr)
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	cfg := testConfig(t)
	cfg.LockTimeout = 3 * time.Second
	s := New(c, cfg)
	t.Cleanup(func() { s.Close(c) })
	hungQ, okQ := queuesOnTwoMasters(t, c, "hang")
	for i, q := range []string{hungQ, okQ} { // warm up: scripts loaded, connections made
		if res, err := startOwn(ctx, s, ownKey(t, c, s, q, 100+i)); err != nil || res.Status != StatusTaken {
			t.Fatalf("warm-up start on %s: %+v, %v", q, res, err)
		}
	}
	if !s.Batching() {
		t.Fatal("the Store does not batch: the test would not reach the batchers")
	}
	okRef, hung := ownKey(t, c, s, okQ, 0), []Ref{ownKey(t, c, s, hungQ, 1), ownKey(t, c, s, hungQ, 2)}
	seen := &seenHook{mark: "{" + hungQ + "}", seen: make(chan struct{}, 16)}
	c.AddHook(redistest.CmdHook(seen.check))
	node, err := c.MasterForKey(ctx, "{"+hungQ+"}")
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Do(ctx, "CLIENT", "PAUSE", 4000, "ALL").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE: %v", err)
	}
	hungDone := make(chan error, slots)
	for _, r := range hung[:slots] {
		go func() { _, err := startOwn(ctx, s, r); hungDone <- err }()
		redistest.WaitFor(t, seen.seen, "a start on the hung master sent")
	}

	okCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if res, err := startOwn(okCtx, s, okRef); err != nil || res.Status != StatusTaken {
		t.Errorf("start on a healthy master while another master hangs: %+v, %v; want it answered at once", res, err)
	}
	as := []*Acquire{wrapAcquire(s, hungQ, "00000000000000a1", time.Now()), wrapAcquire(s, okQ, "00000000000000a2", time.Now())}
	out := s.AcquireAll(okCtx, as)
	if o := out[1]; o.Err != nil || o.Status != StatusTaken {
		t.Errorf("AcquireAll, the healthy master's call: %+v; want taken before the deadline", o)
	}
	for range slots {
		if err := <-hungDone; err == nil {
			t.Logf("a start on the hung master succeeded (its pause ended first)")
		}
	}
}

// batch.go: "every request handed over is answered exactly once …; after
// stop, calls go straight to Redis".
//
// Close while the batcher's slots are held in Redis and many calls wait
// for one: Close returns at once, every call is answered (and takes its
// key), and no goroutine is left.
func TestCloseWhileCallsWaitAnswersEveryOneAndLeaksNothing(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	g := newGate(slots)
	rdb.AddHook(g)
	s := New(rdb, testConfig(t))
	defer g.open()
	q := redistest.Uniq(t)
	const n = 40
	refs := make([]Ref, n)
	for i := range refs {
		refs[i] = ownKey(t, rdb, s, q, i)
	}
	errs := make([]error, n)
	got := make([]StartResult, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { got[i], errs[i] = startOwn(context.Background(), s, refs[i]) })
		if i < slots {
			redistest.WaitFor(t, g.held, "a slot's call held")
		}
	}
	redistest.Eventually(t, "calls waiting for a slot", func() bool { return waitingIn() >= n-slots })
	closed := make(chan struct{})
	go func() { s.Close(rdb); close(closed) }()
	redistest.WaitFor(t, closed, "Close returns while calls are held")
	g.open()
	wg.Wait()
	for i, r := range refs {
		if errs[i] != nil || got[i].Status != StatusTaken {
			t.Errorf("start %d around Close: %+v, %v", i, got[i], errs[i])
		} else if pttl := rdb.PTTL(context.Background(), r.Lock).Val(); pttl < 59*time.Minute {
			t.Errorf("start %d: lock lives %v more, want the hour it had", i, pttl)
		}
	}
}

// Close may be called whether or not the batcher ever ran, any number of
// times, and calls after it go straight to Redis.
func TestCloseTwiceThenCallsGoStraightToRedis(t *testing.T) {
	rdb := redistest.Client(t)
	idle := newTestStore(t, rdb)
	idle.Close(rdb)
	idle.Close(rdb)
	bounded := redis.NewClient(&redis.Options{Addr: redistest.Addr(), ContextTimeoutEnabled: true})
	defer bounded.Close()
	s := New(bounded, testConfig(t))
	if !s.Batching() {
		t.Fatal("the Store does not batch")
	}
	q := redistest.Uniq(t)
	for i := range 2 {
		if res, err := startOwn(context.Background(), s, ownKey(t, rdb, s, q, i)); err != nil || res.Status != StatusTaken {
			t.Fatalf("start %d: %+v, %v", i, res, err)
		}
		s.Close(bounded)
		s.Close(bounded)
	}
}

// exec.go: "Close makes later calls go straight to Redis, through fallback
// (the caller may then close the client the Store was made with)". The
// root package's Dedup.Close does so with the bounded copy of the caller's
// client it made: calls after it, the batcher's slots free, must go
// through the fallback, not the closed client.
func TestCallsAfterCloseGoThroughTheClientItWasGiven(t *testing.T) {
	rdb := redistest.Client(t)
	bounded := redis.NewClient(&redis.Options{Addr: redistest.Addr(), ContextTimeoutEnabled: true})
	s := New(bounded, testConfig(t))
	q := redistest.Uniq(t)
	if res, err := startOwn(context.Background(), s, ownKey(t, rdb, s, q, 0)); err != nil || res.Status != StatusTaken {
		t.Fatalf("start before Close: %+v, %v", res, err)
	}
	s.Close(rdb)
	if err := bounded.Close(); err != nil {
		t.Fatal(err)
	}
	after := &scriptCalls{}
	rdb.AddHook(after)
	if res, err := startOwn(context.Background(), s, ownKey(t, rdb, s, q, 1)); err != nil || res.Status != StatusTaken {
		t.Errorf("start after Close, its first client closed: %+v, %v; want it made through the fallback", res, err)
	}
	if after.n.Load() == 0 {
		t.Error("no call went through the client Close was given")
	}
}
