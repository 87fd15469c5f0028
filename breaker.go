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

// BreakerState reports the circuit breaker's state.
func (d *Dedup) BreakerState() BreakerState { return BreakerState(d.store.BreakerState()) }
