package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Circuit breaker: while Redis stays down, calls must not each wait out
// LockTimeout. After Config.BreakerThreshold consecutive failures the
// breaker opens and calls fail at once with Config.ErrCircuitOpen; after a
// wait (Config.BreakerWait) one call goes through as a probe; its success
// closes the breaker, its failure reopens it for longer.

// BreakerState is the circuit breaker's state; the root package's
// BreakerState has the same values.
type BreakerState int

// Breaker states.
const (
	BreakerClosed  BreakerState = iota // calls go to Redis
	BreakerOpen                        // calls fail at once with ErrCircuitOpen
	BreakerProbing                     // one call is testing whether Redis is back
)

type breaker struct {
	threshold int                           // consecutive failures that open it; < 0 disables
	wait      func(opens int) time.Duration // how long it stays open after opens earlier openings
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
	last      error // the failure that opened it last
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

// record notes a call's outcome, and reports whether it was a failure of
// Redis itself: only those count, as a reply (even an error reply) proves
// Redis is up, and a caller's own cancelled context says nothing about
// Redis.
func (b *breaker) record(parent context.Context, err error) (fault bool) {
	if err == nil && (b.threshold < 0 || b.healthy.Load()) {
		return false
	}
	fault = err != nil && !errors.Is(err, redis.Nil) && !isReply(err) && parent.Err() == nil
	if b.threshold < 0 {
		return fault
	}
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
		return false
	}
	b.failures++
	// Calls let through before the breaker opened fail after it did: they
	// must not open it again (and push the probe further out).
	if b.state == BreakerProbing || (b.state == BreakerClosed && b.failures >= b.threshold) {
		wait := b.wait(b.opens)
		b.opens++
		b.state, b.openUntil, b.last = BreakerOpen, b.clock().Add(wait), err
		b.log.Warn("dedup: Redis failing; circuit open, lock calls fail fast", slog.Int("consecutive_failures", b.failures), slog.Duration("retry_in", wait), slog.Any("error", err))
		if b.onOpen != nil {
			b.onOpen()
		}
	}
	return true
}

// refusal is the error of a call the breaker refused: open, which it
// wraps with the failure that opened the breaker, so that the refusal
// says why (and errors.Is and errors.As find that failure too).
func (b *breaker) refusal(open error) error {
	b.mu.Lock()
	last := b.last
	b.mu.Unlock()
	if last == nil {
		return open
	}
	return fmt.Errorf("%w (last failure: %w)", open, last)
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

// refusals are the error replies Redis gives a call before running any of
// it, for a reason that holds for a late copy of the call as much (go-redis
// may have sent the call twice, after a reply was lost): a missing
// permission (ACL), a missing or wrong login, no memory left for writes
// (maxmemory with noeviction), writes refused after a failed save. A
// refusal of a migrating slot or a loading or read-only node (TRYAGAIN,
// MOVED, LOADING, READONLY, ...) is no such proof: an earlier copy may
// have run on the node the call was meant for.
var refusals = []string{"NOPERM", "NOAUTH", "WRONGPASS", "OOM", "MISCONF"}

// Refused reports whether err is an error reply with which Redis refused a
// call before running it, and would refuse any copy of it.
func Refused(err error) bool {
	if !isReply(err) {
		return false
	}
	for _, p := range refusals {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}
