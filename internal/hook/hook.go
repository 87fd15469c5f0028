// Package hook gives this module's own packages (dedupotel) what package
// dedup keeps out of its API. Package dedup sets the hooks as it is
// initialised; they are not for the users of package dedup.
package hook

// BreakerState returns the state of a *dedup.Dedup's circuit breaker:
// "closed", "open" or "probing"; on Redis Cluster, the worst master's.
var BreakerState func(d any) string
