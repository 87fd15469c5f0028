package dedup

import (
	"time"

	"github.com/hibiken/asynq"
)

// Lock lifetimes, all sent to Redis as integer milliseconds:
//
//	waiting  TTL (+ the delay of a ProcessIn/ProcessAt task)
//	running  as waiting; a handler running past one heartbeat (10 s)
//	         extends it to TTL from then, again each half TTL
//	retrying RetryDelayFunc(n) + TTL after a failed, non-final attempt
//
// Every duration this package is given (Config, Rule, per-call options,
// RetryDelayFunc's result) is clamped to maxLifetime, and lifetimes are
// added with saturation, so "forever" (math.MaxInt64) means maxLifetime and
// no sum wraps around to a short or negative lifetime.

// maxLifetime is the longest duration this package uses: longer TTLs,
// cooldowns, debounces, holds and grace periods are taken as maxLifetime.
// 100 years: "forever" for a lock, and small enough that Redis's
// millisecond expiries and the scripts' arithmetic (exact integers below
// 2⁵³ ms) never overflow.
const maxLifetime = 100 * 365 * 24 * time.Hour

// maxDefaultRetryDelay is the upper bound of asynq.DefaultRetryDelayFunc,
// n⁴ + 15 + 29·(n+1) seconds for the n-th retry. It is Config.RetryDelayFunc's
// default: the middleware cannot see the delay asynq picks, so it holds the
// lock for the longest one asynq's default can pick.
func maxDefaultRetryDelay(n int, _ error, _ *asynq.Task) time.Duration {
	n = min(max(n, 0), 10000) // (10,000⁴ s is far beyond maxLifetime; no int64 overflow)
	s := int64(n)*int64(n)*int64(n)*int64(n) + 15 + 29*int64(n+1)
	return lifetime(time.Duration(min(s, int64(maxLifetime/time.Second))) * time.Second)
}

// lifetime clamps d to [0, maxLifetime].
func lifetime(d time.Duration) time.Duration { return min(max(d, 0), maxLifetime) }

// addLifetimes adds lifetimes, saturating at maxLifetime.
func addLifetimes(ds ...time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		sum = min(sum+lifetime(d), maxLifetime) // both ≤ maxLifetime: the sum cannot overflow
	}
	return sum
}

// waitTTL is the lock lifetime for a task that is due at processAt (zero:
// now) and may then wait ttl in its queue.
func waitTTL(ttl time.Duration, processAt time.Time) time.Duration {
	if !processAt.IsZero() {
		return addLifetimes(ttl, time.Until(processAt))
	}
	return lifetime(ttl)
}
