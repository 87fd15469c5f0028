package dedup

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// Tests run against a real redis-server started on a free loopback port by
// TestMain (internal/redistest). Where redis-server is not installed they
// fall back to miniredis, and tests that need the real thing skip with a
// message saying so.

func TestMain(m *testing.M) {
	if os.Getenv(faultWorkerEnv) == "1" { // a worker process of TestFaultWorkerKilled
		if err := runFaultWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "fault worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Setenv(store.CheckKeysEnv, "1") // every script refuses a key it was not given
	os.Exit(redistest.Main(m, "dedup"))
}

// Shorthands for the shared test helpers.
type redisProc = redistest.Proc

func spawnRedis(addr string, extra ...string) (*redisProc, error) {
	return redistest.Spawn(addr, extra...)
}
func newRDB(t testing.TB) redis.UniversalClient { return redistest.Client(t) }
func needRealRedis(t testing.TB)                { redistest.NeedReal(t) }
func uniq(t testing.TB) string                  { return redistest.Uniq(t) }
func freeAddr() (string, error)                 { return redistest.FreeAddr() }
func ownRedis(t *testing.T, tweak func(*redis.Options)) (*redisProc, *redis.Client) {
	return redistest.Own(t, tweak)
}

// separateLockStore starts a redis-server of the test's own for a Dedup's
// locks (tasks stay on the shared server), so the test can kill it.
func separateLockStore(t *testing.T, cfg Config) (*redisProc, *Dedup) {
	t.Helper()
	p, rdb := ownRedis(t, func(o *redis.Options) { o.MaxRetries = -1 })
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = 200 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	d, err := New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return p, d
}
