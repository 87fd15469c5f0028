package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// Adversarial tests, round 10: begins shared between attempts (begin.go)
// and releases batched per queue (done.go), at the store level.

// a10Lock writes the lock NewClient writes with its task (owner, time, v)
// for a fresh ref of queue q, and returns the ref.
func a10Lock(t *testing.T, rdb redis.UniversalClient, s *Store, q string, n int) Ref {
	t.Helper()
	ctx := context.Background()
	fp := fmt.Sprintf("%016x", 0xa10000+n)
	r := Ref{Queue: q, FP: fp, ID: NewLockedID(fp), Type: "t"}
	lock := s.keys.LockOf(&r)
	if err := rdb.HSet(ctx, lock, FieldOwner, r.stored(), "c", time.Now().Unix(), "v", "1").Err(); err != nil {
		t.Fatal(err)
	}
	rdb.PExpire(ctx, lock, time.Hour)
	t.Cleanup(func() { rdb.Del(context.Background(), lock) })
	return r
}

// a10SeenHook signals when a script call carrying a key with `mark` is
// processed (sent) by the client.
type a10SeenHook struct {
	mark string
	once sync.Once
	seen chan struct{}
}

func (h *a10SeenHook) check(cmd redis.Cmder) {
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && strings.Contains(s, h.mark) {
			h.once.Do(func() { close(h.seen) })
			return
		}
	}
}

// a10QueuesOnTwoMasters returns two queue names whose hash tags are served
// by different masters of c.
func a10QueuesOnTwoMasters(t *testing.T, c *redis.ClusterClient, base string) (string, string) {
	t.Helper()
	ctx := context.Background()
	var first, firstAddr string
	for i := 0; i < 1000; i++ {
		q := fmt.Sprintf("%s-%d", base, i)
		node, err := c.MasterForKey(ctx, "{"+q+"}")
		if err != nil {
			t.Fatal(err)
		}
		addr := node.Options().Addr
		switch {
		case first == "":
			first, firstAddr = q, addr
		case addr != firstAddr:
			return first, q
		}
	}
	t.Fatal("no two queues on different masters")
	return "", ""
}

// 1. internal/store/shard.go: "On Redis Cluster every master has a breaker
// and a batcher of its own: a master that fails opens only its own breaker
// and stalls only its own pipelines, while calls for the other masters'
// slots go on"; README (Failure modes): "a Cluster master dies | its
// queue's calls fail …; the other masters' queues go on | errors on that
// queue only".
//
// One master hangs (CLIENT PAUSE: a partitioned or stalled node) while an
// attempt of its queue begins. An attempt of a queue on a healthy master
// then begins, with a deadline shorter than LockTimeout (asynq's Timeout,
// say): the beginner sends one call at a time, so the healthy queue's begin
// is not even sent until the hung master's call gives up at LockTimeout.
func TestAdversary10BeginOnHealthyMasterWaitsForHungMaster(t *testing.T) {
	_, c := redistest.OwnCluster(t, 3, false)
	ctx := context.Background()
	s := New(c, Config{
		Prefix: "st-" + redistest.Uniq(t), LockTimeout: 3 * time.Second, HealGrace: time.Minute, Lease: 30 * time.Second,
		MaxBatch: 64, BreakerThreshold: -1, BreakerWait: func(int) time.Duration { return time.Second },
		ErrCircuitOpen: context.DeadlineExceeded, Logger: redistest.QuietLogger(),
	})
	t.Cleanup(s.Close)
	hungQ, okQ := a10QueuesOnTwoMasters(t, c, "a10")
	// Warm up both queues (scripts loaded, connections made).
	for i, q := range []string{hungQ, okQ} {
		r := a10Lock(t, c, s, q, 100+i)
		if res, err := s.Start(ctx, &Start{Ref: r, Token: "warm", Lease: 30 * time.Second}); err != nil || !res.Begun {
			t.Fatalf("warm-up begin on %s: %+v, %v", q, res, err)
		}
	}
	hungRef, okRef := a10Lock(t, c, s, hungQ, 1), a10Lock(t, c, s, okQ, 2)
	seen := &a10SeenHook{mark: "{" + hungQ + "}", seen: make(chan struct{})}
	c.AddHook(redistest.CmdHook(seen.check))

	node, err := c.MasterForKey(ctx, "{"+hungQ+"}")
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Do(ctx, "CLIENT", "PAUSE", 4000, "ALL").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE: %v", err)
	}
	hungDone := make(chan error, 1)
	go func() {
		_, err := s.Start(ctx, &Start{Ref: hungRef, Token: "hung", Lease: 30 * time.Second})
		hungDone <- err
	}()
	redistest.WaitFor(t, seen.seen, "the hung master's begin sent")

	okCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	began := time.Now()
	res, err := s.Start(okCtx, &Start{Ref: okRef, Token: "ok", Lease: 30 * time.Second})
	took := time.Since(began)
	if err != nil || !res.Begun {
		t.Errorf("begin on a healthy master while another master hangs: %+v, %v after %v; want it begun at once (the hung master is its own problem)", res, err, took.Round(time.Millisecond))
	}
	if err := <-hungDone; err == nil {
		t.Logf("the hung master's begin succeeded (its pause ended first)")
	}
}

// 2. README (Lock lifecycle): "leftover handler of an old attempt finishes
// | nothing: its token no longer matches"; "lock found gone or taken over
// … | … counts LockLost". A batched done over locks of two queues, where
// each lock stands in another state, settles each by its own state only:
// released (its attempt's), untouched (another owner; a newer attempt's
// token; an attempt that ran tokless against a lock a newer attempt holds),
// left to finish (a follow-up owed), and reports them in order.
func TestAdversary10DoneAllSettlesEachLockByItsOwnState(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	q1, q2 := redistest.Uniq(t)+"-1", redistest.Uniq(t)+"-2"
	type cse struct {
		ref     Ref
		tok     string // the attempt's
		fields  []any  // besides owner, c, v
		want    DoneResult
		present bool // the lock must still be there
	}
	var cases []cse
	for qi, q := range []string{q1, q2} {
		n := 10 * qi
		own := a10Lock(t, rdb, s, q, n+1)
		other := a10Lock(t, rdb, s, q, n+2)
		newer := a10Lock(t, rdb, s, q, n+3)
		owes := a10Lock(t, rdb, s, q, n+4)
		tokless := a10Lock(t, rdb, s, q, n+5)
		otherID := NewLockedID(other.FP)
		cases = append(cases,
			cse{own, "t1", []any{FieldToken, "t1"}, DoneResult{Released: true}, false},
			cse{other, "t1", []any{FieldOwner, PackOwner(otherID, other.FP), FieldToken, "t1"}, DoneResult{}, true},
			cse{newer, "t1", []any{FieldToken, "t2"}, DoneResult{}, true},
			cse{owes, "t1", []any{FieldToken, "t1", "f", NewLockedID(owes.FP)}, DoneResult{Finish: true}, true},
			cse{tokless, "", []any{FieldToken, "t9"}, DoneResult{}, true},
		)
	}
	ds := make([]Done, len(cases))
	for i, c := range cases {
		if err := rdb.HSet(ctx, s.keys.LockOf(&c.ref), c.fields...).Err(); err != nil {
			t.Fatal(err)
		}
		ds[i] = Done{Ref: c.ref, Token: c.tok}
	}
	got := s.DoneAll(ctx, ds)
	for i, c := range cases {
		if got[i] != c.want {
			t.Errorf("lock %d (%s): %+v, want %+v", i, c.ref.Queue, got[i], c.want)
		}
		if ex := rdb.Exists(ctx, s.keys.LockOf(&c.ref)).Val() == 1; ex != c.present {
			t.Errorf("lock %d (%s): present %v, want %v", i, c.ref.Queue, ex, c.present)
		}
	}
}

// 3. begin.go's invariants: "each request handed over is answered exactly
// once …; after stop, begins go straight to Redis"; README (Failure modes):
// "graceful shutdown | handlers finish, heartbeat stops, nothing leaks".
//
// Close while one shared begin call is held in Redis and many attempts
// wait behind it: every begin is answered (and takes its lock), Close
// returns, and no goroutine is left.
func TestAdversary10CloseWhileBeginsWaitAnswersEveryOneAndLeaksNothing(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr()})
	defer rdb.Close()
	g := newGate(1)
	rdb.AddHook(g)
	s := New(rdb, Config{
		Prefix: "st-" + redistest.Uniq(t), LockTimeout: 5 * time.Second, HealGrace: time.Minute, Lease: 30 * time.Second,
		MaxBatch: 64, BreakerThreshold: -1, BreakerWait: func(int) time.Duration { return time.Second },
		ErrCircuitOpen: context.DeadlineExceeded, Logger: redistest.QuietLogger(),
	})
	defer g.open()
	q := redistest.Uniq(t)
	const n = 40
	refs := make([]Ref, n)
	for i := range refs {
		refs[i] = a10Lock(t, rdb, s, q, i)
	}
	errs := make([]error, n)
	oks := make([]bool, n)
	var wg sync.WaitGroup
	wg.Go(func() {
		res, err := s.Start(context.Background(), &Start{Ref: refs[0], Token: "tok-0", Lease: 30 * time.Second})
		oks[0], errs[0] = res.Begun, err
	})
	redistest.WaitFor(t, g.held, "the first begin call held")
	for i := 1; i < n; i++ {
		wg.Go(func() {
			res, err := s.Start(context.Background(), &Start{Ref: refs[i], Token: fmt.Sprint("tok-", i), Lease: 30 * time.Second})
			oks[i], errs[i] = res.Begun, err
		})
	}
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
		t.Log("Close returned while a begin call was held")
	case <-time.After(200 * time.Millisecond): // bounded negative wait: Close waits for the call out
	}
	g.open()
	redistest.WaitFor(t, closed, "Close returns")
	wg.Wait()
	ctx := context.Background()
	for i := range refs {
		if errs[i] != nil || !oks[i] {
			t.Errorf("begin %d around Close: begun %v, %v", i, oks[i], errs[i])
			continue
		}
		if tok := rdb.HGet(ctx, s.keys.LockOf(&refs[i]), FieldToken).Val(); tok != fmt.Sprint("tok-", i) {
			t.Errorf("begin %d: lock token %q", i, tok)
		}
	}
}

// 4. begin.go: "callers wait on a channel or their context"; the begin of
// an attempt whose context ends while its call is out "may still land: the
// attempt's retry replaces its token". An abandoned begin that lands must
// not keep a later attempt from its lock, and a late reply must not be
// read by anyone.
func TestAdversary10AbandonedBeginIsReplacedByTheRetry(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr()})
	defer rdb.Close()
	g := newGate(1)
	rdb.AddHook(g)
	s := newTestStore(t, rdb)
	defer g.open()
	q := redistest.Uniq(t)
	r := a10Lock(t, rdb, s, q, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := s.Start(ctx, &Start{Ref: r, Token: "first", Lease: 30 * time.Second})
		done <- err
	}()
	redistest.WaitFor(t, g.held, "the first begin held")
	cancel()
	if err := redistest.WaitFor(t, done, "the abandoned begin returns"); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned begin: %v, want context.Canceled", err)
	}
	retryDone := make(chan StartResult, 1)
	go func() {
		res, err := s.Start(context.Background(), &Start{Ref: r, Token: "retry", Lease: 30 * time.Second})
		if err != nil {
			t.Errorf("retry's begin: %v", err)
		}
		retryDone <- res
	}()
	g.open()
	res := redistest.WaitFor(t, retryDone, "the retry begins")
	if !res.Begun {
		t.Errorf("retry's begin: %+v, want begun", res)
	}
	if tok := rdb.HGet(context.Background(), s.keys.LockOf(&r), FieldToken).Val(); tok != "retry" {
		t.Errorf("after the abandoned begin landed and the retry began: lock token %q, want the retry's", tok)
	}
}
