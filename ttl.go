package dedup

import (
	"time"

	"github.com/hibiken/asynq"
)

// Lock lifetimes, all sent to Redis as integer milliseconds:
//
//	waiting  TTL (+ the delay of a ProcessIn/ProcessAt task)
//	running  Lease, renewed every Lease/3 by the heartbeat
//	retrying RetryDelayFunc(n) + TTL after a failed, non-final attempt

// MaxDefaultRetryDelay is the upper bound of asynq.DefaultRetryDelayFunc,
// n⁴ + 15 + 29·(n+1) seconds for the n-th retry. It is Config.RetryDelayFunc's
// default: the middleware cannot see the delay asynq picks, so it holds the
// lock for the longest one asynq's default can pick.
func MaxDefaultRetryDelay(n int, _ error, _ *asynq.Task) time.Duration {
	if n < 0 {
		n = 0
	}
	s := int64(n)*int64(n)*int64(n)*int64(n) + 15 + 29*int64(n+1)
	return time.Duration(s) * time.Second
}

// waitTTL is the lock lifetime for a task that is due at processAt (zero:
// now) and may then wait ttl in its queue.
func waitTTL(ttl time.Duration, processAt time.Time) time.Duration {
	if !processAt.IsZero() {
		if d := time.Until(processAt); d > 0 {
			ttl += d
		}
	}
	return ttl
}

// ms converts to whole milliseconds, at least 1 (PX 0 is an error in Redis).
func ms(d time.Duration) int64 {
	m := d.Milliseconds()
	if m < 1 {
		m = 1
	}
	return m
}
