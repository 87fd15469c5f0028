package dedup

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// backoff is an exponential backoff with full jitter: the n-th wait (from 0)
// is a random duration in [0, min(Max, Min·2ⁿ)]. Min and Max above
// maxLifetime are taken as maxLifetime, so no doubling wraps.
type backoff struct {
	Min time.Duration // first ceiling; must be positive
	Max time.Duration // cap; at least Min
}

// delay returns the wait before retry n (n ≥ 0).
func (b backoff) delay(n int) time.Duration {
	ceil, top := lifetime(b.Min), lifetime(b.Max)
	for i := 0; i < n && ceil < top; i++ {
		ceil *= 2 // (both ≤ maxLifetime, far below half of int64's range: no overflow)
	}
	ceil = min(ceil, top)
	if ceil <= 0 {
		return 0
	}
	return rand.N(ceil + 1)
}

// connect PINGs Redis until it answers, the context ends or attempts run out.
// Failed attempts leave nothing behind: go-redis returns each connection to
// its pool or closes it. A refused login or permission (WRONGPASS, NOAUTH,
// NOPERM) ends it at once: Redis answered, and answers the same to every
// retry. A PING that waits for a connection go-redis cannot make ends as
// soon as a dial fails (store.WatchDials), so a refused connection reads as
// such, not as a deadline.
func connect(ctx context.Context, rdb redis.UniversalClient, attempts int, b backoff, timeout time.Duration) error {
	watch := store.WatchDials(rdb)
	var err error
	for n := 0; n < attempts; n++ {
		if n > 0 {
			t := time.NewTimer(b.delay(n - 1))
			select {
			case <-ctx.Done():
				t.Stop()
				return errorf("%w: connect: %w (last error: %w)", ErrUnavailable, ctx.Err(), err)
			case <-t.C:
			}
		}
		pctx, cancel := context.WithTimeout(ctx, timeout)
		w := watch.Enter(ctx, cancel)
		err = w.Leave(rdb.Ping(pctx).Err())
		cancel()
		switch {
		case err == nil:
			return nil
		case refusalOf(err) != nil:
			return unavailable("connect", err)
		case ctx.Err() != nil:
			return errorf("%w: connect: %w (last error: %w)", ErrUnavailable, ctx.Err(), err)
		}
	}
	return errorf("%w: connect: no answer after %d attempts: %w", ErrUnavailable, attempts, err)
}
