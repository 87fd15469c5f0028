package dedup

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Circuit breaker: while Redis stays down, lock calls must not each wait out
// LockTimeout. After BreakerThreshold consecutive failures the breaker opens
// and calls fail at once with ErrCircuitOpen (handled like any Redis error:
// fail-closed or fail-open); after a backoff one call goes through as a
// probe; its success closes the breaker, its failure reopens it for longer.

// BreakerState is the circuit breaker's state.
type BreakerState int

const (
	// BreakerClosed: lock calls go to Redis.
	BreakerClosed BreakerState = iota
	// BreakerOpen: lock calls fail at once with ErrCircuitOpen.
	BreakerOpen
	// BreakerProbing: one call is testing whether Redis is back.
	BreakerProbing
)

func (s BreakerState) String() string {
	switch s {
	case BreakerClosed:
		return "closed"
	case BreakerOpen:
		return "open"
	case BreakerProbing:
		return "probing"
	}
	return "unknown"
}

type breaker struct {
	threshold int // consecutive failures that open it; < 0 disables
	backoff   Backoff
	log       *slog.Logger
	onOpen    func()
	now       func() time.Time // time.Now; tests substitute a clock

	// healthy mirrors "closed with no failures counted", the state of almost
	// every call, so allow and record skip the mutex then.
	healthy atomic.Bool

	mu        sync.Mutex
	state     BreakerState
	failures  int
	opens     int // consecutive openings, for the backoff
	openUntil time.Time
}

// allow reports whether a call may go to Redis now.
func (b *breaker) allow() bool {
	if b.threshold < 0 || b.healthy.Load() {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state {
	case BreakerOpen:
		if b.clock().Before(b.openUntil) {
			return false
		}
		b.state = BreakerProbing
		return true // this call is the probe
	case BreakerProbing:
		return false
	}
	return true
}

// record notes a call's outcome. Only failures of Redis itself count: a
// reply (even an error reply) proves Redis is up, and a caller's own
// cancelled context says nothing about Redis.
func (b *breaker) record(parent context.Context, err error) {
	if b.threshold < 0 {
		return
	}
	if err == nil && b.healthy.Load() {
		return
	}
	fault := err != nil && !errors.Is(err, redis.Nil) && !isReply(err) && parent.Err() == nil
	b.mu.Lock()
	defer b.mu.Unlock()
	defer func() { b.healthy.Store(b.state == BreakerClosed && b.failures == 0) }()
	if !fault {
		if err == nil || isReply(err) || errors.Is(err, redis.Nil) {
			if b.state != BreakerClosed {
				b.log.Info("dedup: Redis answers again; circuit closed")
			}
			b.state, b.failures, b.opens = BreakerClosed, 0, 0
		} else if b.state == BreakerProbing {
			b.state = BreakerOpen // the probe was cancelled by its caller: probe again soon
		}
		return
	}
	b.failures++
	// Calls let through before the breaker opened fail after it did: they
	// must not open it again (and push the probe further out).
	if b.state == BreakerProbing || (b.state == BreakerClosed && b.failures >= b.threshold) {
		wait := b.backoff.Min
		if b.opens > 0 {
			wait = b.backoff.Delay(b.opens)
			if wait < b.backoff.Min {
				wait = b.backoff.Min
			}
		}
		b.opens++
		b.state, b.openUntil = BreakerOpen, b.clock().Add(wait)
		b.log.Warn("dedup: Redis failing; circuit open, lock calls fail fast", slog.Int("consecutive_failures", b.failures), slog.Duration("retry_in", wait), slog.Any("error", err))
		if b.onOpen != nil {
			b.onOpen()
		}
	}
}

func (b *breaker) clock() time.Time {
	if b.now != nil {
		return b.now()
	}
	return time.Now()
}

func (b *breaker) current() BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state == BreakerOpen && !b.clock().Before(b.openUntil) {
		return BreakerProbing // the next call probes
	}
	return b.state
}

// isReply reports whether err is an error reply from Redis (the server is up).
func isReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && !errors.Is(err, context.DeadlineExceeded)
}

// BreakerState reports the circuit breaker's state.
func (d *Dedup) BreakerState() BreakerState { return d.br.current() }

// call makes one Redis call through the breaker, bounded by LockTimeout.
func (d *Dedup) call(ctx context.Context, fn func(context.Context) (any, error)) (any, error) {
	return d.guard(ctx, func() (any, error) { return d.direct(ctx, fn) })
}

// run executes a lock script like call, batched with concurrent calls when
// batching is on (and straight to Redis once the batcher is stopped).
func (d *Dedup) run(ctx context.Context, s *redis.Script, keys []string, args ...any) (any, error) {
	return d.guard(ctx, func() (any, error) {
		if d.batch != nil {
			if v, err, ok := d.batch.do(ctx, s, keys, args); ok {
				return v, err
			}
		}
		return d.direct(ctx, func(c context.Context) (any, error) {
			return s.Run(c, d.rdb, keys, args...).Result()
		})
	})
}

// guard runs send through the circuit breaker and records its outcome.
func (d *Dedup) guard(ctx context.Context, send func() (any, error)) (any, error) {
	if !d.br.allow() {
		return nil, ErrCircuitOpen
	}
	v, err := send()
	d.br.record(ctx, err)
	return v, err
}

// direct makes one Redis call from this goroutine's side, bounded by
// LockTimeout.
func (d *Dedup) direct(ctx context.Context, fn func(context.Context) (any, error)) (any, error) {
	lctx, cancel := d.lockCtx(ctx)
	defer cancel()
	return bounded(lctx, d.ctxTimeouts, fn)
}

// get reads a string key through call.
func (d *Dedup) get(ctx context.Context, key string) (string, error) {
	v, err := d.call(ctx, func(c context.Context) (any, error) {
		return d.rdb.Get(c, key).Result()
	})
	s, _ := v.(string)
	return s, err
}

// bounded returns when call does or ctx ends, whichever comes first. A
// go-redis client applies a context's deadline to its socket reads only with
// Options.ContextTimeoutEnabled; without it a hung Redis would hold the call
// for ReadTimeout (3 s by default) and its retries. Then the call runs in a
// goroutine that is abandoned at the deadline (it ends with go-redis's own
// timeout).
func bounded(ctx context.Context, ctxTimeouts bool, call func(context.Context) (any, error)) (any, error) {
	if ctxTimeouts {
		return call(ctx)
	}
	type result struct {
		v   any
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := call(ctx)
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// contextTimeouts reports whether the client honours context deadlines on
// its socket reads (go-redis's Options.ContextTimeoutEnabled).
func contextTimeouts(rdb redis.UniversalClient) bool {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}
