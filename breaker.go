package dedup

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

// BreakerState reports the circuit breaker's state. On Redis Cluster each
// master has a breaker of its own (a master that fails stops only the
// calls for its slots); this reports the worst: open if any is open, else
// probing if any probes, else closed.
func (d *Dedup) BreakerState() BreakerState { return BreakerState(d.store.BreakerState()) }
