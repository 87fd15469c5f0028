package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// newTestStore returns a Store with its own key prefix on rdb, closed when
// the test ends.
func newTestStore(t testing.TB, rdb redis.UniversalClient) *Store {
	t.Helper()
	s := New(rdb, Config{
		Prefix: "st-" + redistest.Uniq(t), LockTimeout: 5 * time.Second, HealGrace: time.Minute, Lease: 30 * time.Second,
		MaxBatch: 64, BreakerThreshold: -1, BreakerWait: func(int) time.Duration { return time.Second },
		ErrCircuitOpen: context.DeadlineExceeded, Logger: redistest.QuietLogger(),
	})
	t.Cleanup(s.Close)
	return s
}
