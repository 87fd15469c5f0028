package dedup

import (
	"github.com/asynq-dedup/dedup/internal/hook"
	"github.com/hibiken/asynq"
)

// init fills internal/hook, through which dedupotel reads what the API
// does not offer.
func init() {
	hook.BreakerState = func(d any) string { return d.(*Dedup).breakerState().String() }
	hook.QueueOf = func(d any, task *asynq.Task, opts ...asynq.Option) string { return d.(*Dedup).queueOf(task, opts...) }
}

// breakerState is the circuit breaker's state.
type breakerState int

const (
	// breakerClosed: lock calls go to Redis.
	breakerClosed breakerState = iota
	// breakerOpen: lock calls fail at once with ErrCircuitOpen.
	breakerOpen
	// breakerProbing: one call is testing whether Redis is back.
	breakerProbing
)

func (s breakerState) String() string {
	switch s {
	case breakerClosed:
		return "closed"
	case breakerOpen:
		return "open"
	case breakerProbing:
		return "probing"
	}
	return "unknown"
}

// breakerState reports the circuit breaker's state. On Redis Cluster each
// master has a breaker of its own (a master that fails stops only the
// calls for its slots); this reports the worst: open if any is open, else
// probing if any probes, else closed.
func (d *Dedup) breakerState() breakerState { return breakerState(d.store.BreakerState()) }
