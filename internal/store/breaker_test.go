package store

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// backoff is the root package's Backoff as the breaker sees it: the first
// wait min, then min·2ⁿ capped at max with full jitter, never below min.
func backoff(lo, hi time.Duration) func(int) time.Duration {
	return func(opens int) time.Duration {
		if opens == 0 {
			return lo
		}
		ceil := min(lo<<opens, hi)
		return max(rand.N(ceil+1), lo)
	}
}

func TestBreakerStates(t *testing.T) {
	now := time.Unix(1000, 0)
	b := &breaker{threshold: 3, wait: backoff(time.Second, 8*time.Second), log: redistest.QuietLogger(), now: func() time.Time { return now }}
	ctx := context.Background()
	down := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	for i := range 3 {
		if !b.allow() {
			t.Fatalf("call %d refused while closed", i)
		}
		b.record(ctx, down)
	}
	if b.current() != BreakerOpen || b.allow() {
		t.Fatal("not open after 3 consecutive failures")
	}
	// Replies, even error replies, and a caller's own cancellation say Redis is up.
	b2 := &breaker{threshold: 1, wait: backoff(time.Second, time.Second), log: redistest.QuietLogger()}
	b2.record(ctx, redis.Nil)
	b2.record(ctx, errors.Join(errors.New("x"), redisReplyErr("ERR wrong")))
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	b2.record(cctx, context.Canceled)
	if b2.current() != BreakerClosed {
		t.Fatal("opened on non-faults")
	}
	now = now.Add(time.Second)
	if !b.allow() || b.current() != BreakerProbing {
		t.Fatal("no probe after the backoff")
	}
	if b.allow() {
		t.Fatal("two probes at once")
	}
	b.record(ctx, down) // the probe fails: open again, for longer or equal
	if b.current() != BreakerOpen {
		t.Fatal("failed probe did not reopen")
	}
	now = now.Add(8 * time.Second)
	if !b.allow() {
		t.Fatal("no probe after the capped backoff")
	}
	b.record(ctx, nil)
	if b.current() != BreakerClosed || !b.allow() {
		t.Fatal("successful probe did not close")
	}
	off := &breaker{threshold: -1}
	for range 10 {
		off.record(ctx, down)
	}
	if !off.allow() {
		t.Fatal("disabled breaker refused a call")
	}
}

type redisReplyErr string

func (e redisReplyErr) Error() string { return string(e) }
func (e redisReplyErr) RedisError()   {}

// Calls let through before the breaker opened, failing after it did, must not
// reopen it (and push the probe further out) or count more openings.
func TestBreakerOneOpeningPerOutage(t *testing.T) {
	now := time.Unix(1000, 0)
	opens := 0
	b := &breaker{threshold: 5, wait: backoff(500*time.Millisecond, 30*time.Second), log: redistest.QuietLogger(),
		now: func() time.Time { return now }, onOpen: func() { opens++ }}
	down := &net.OpError{Op: "read", Err: errors.New("connection reset")}
	for range 10 { // ten calls in flight when Redis went away
		b.record(context.Background(), down)
	}
	if opens != 1 {
		t.Fatalf("%d openings for one outage, want 1", opens)
	}
	now = now.Add(500 * time.Millisecond)
	if !b.allow() {
		t.Fatal("no probe after the first backoff")
	}
}

// On Redis Cluster, a call refused by its master's open breaker asks
// go-redis to reload the slot map (at most once per reloadEvery), as a
// failed call does: while the breaker waits (up to half a minute) the
// refused calls are the only traffic for the dead master's slots, and a
// replica promoted meanwhile must be found without waiting for the next
// probe or go-redis's own reload (a minute). Here the slot map (counted)
// names a master nothing listens on.
func TestRefusedCallsReloadTheSlotMap(t *testing.T) {
	dead, err := redistest.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(dead)
	var loads atomic.Int64
	c := redis.NewClusterClient(&redis.ClusterOptions{MaxRetries: -1, ContextTimeoutEnabled: true,
		ClusterSlots: func(context.Context) ([]redis.ClusterSlot, error) {
			loads.Add(1)
			return []redis.ClusterSlot{{Start: 0, End: 16383, Nodes: []redis.ClusterNode{{Addr: net.JoinHostPort(host, port)}}}}, nil
		}})
	t.Cleanup(func() { _ = c.Close() })
	cfg := testConfig(t)
	cfg.LockTimeout, cfg.BreakerThreshold = time.Second, 1
	cfg.BreakerWait = func(int) time.Duration { return time.Hour } // no probe during the test
	cfg.ErrCircuitOpen = errors.New("circuit open")
	s := New(c, cfg)
	t.Cleanup(func() { s.Close(c) })
	ctx := context.Background()
	get := func(ctx context.Context, c redis.Cmdable) (any, error) { return c.Get(ctx, "{q}k").Result() }
	if _, err := s.Do(ctx, "{q}k", get); err == nil || errors.Is(err, cfg.ErrCircuitOpen) {
		t.Fatalf("call to a dead master: %v, want its failure", err)
	}
	if s.BreakerState() != BreakerOpen {
		t.Fatal("the breaker did not open")
	}
	// (BreakerState reloads the map itself: from here on it is not asked.)
	deadline := time.Now().Add(5 * time.Second)
	for before := loads.Load(); loads.Load() == before; {
		if time.Now().After(deadline) {
			t.Fatalf("refused calls for 5 s and no slot map reload (%d loads in all)", loads.Load())
		}
		if _, err := s.Do(ctx, "{q}k", get); !errors.Is(err, cfg.ErrCircuitOpen) {
			t.Fatalf("call with the breaker open: %v, want it refused", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
