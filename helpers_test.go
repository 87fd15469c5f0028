package dedup

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"strconv"
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
	if os.Getenv(schedWorkerEnv) == "1" { // a replica process of TestSchedulerReplicaKilledMidRunMissesNoFiring
		if err := runSchedWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "scheduler replica:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(leftoverAddrEnv) != "" { // a worker process of TestKilledWorkersLeftoverHandler…
		if err := runLeftoverWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "leftover worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if spec := os.Getenv(faultProxyEnv); spec != "" { // a proxy process of a fault test
		fmt.Fprintln(os.Stderr, "fault proxy:", runFaultProxy(spec))
		os.Exit(1)
	}
	os.Setenv(store.CheckKeysEnv, "1") // every script refuses a key it was not given
	waitingTestsInParallel(6)
	os.Exit(redistest.Main(m, "dedup"))
}

// waitingTestsInParallel runs n parallel tests at once unless -parallel
// says otherwise: the tests marked parallel spend their time waiting on
// asynq's clocks and child processes, not on the CPU (go test's default is
// GOMAXPROCS).
func waitingTestsInParallel(n int) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		_ = flag.Set("test.parallel", strconv.Itoa(n))
	}
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
func ownRedis(t *testing.T, tweak func(*redis.Options), extra ...string) (*redisProc, *redis.Client) {
	return redistest.Own(t, tweak, extra...)
}

// proxiedLockStore gives h a Dedup whose lock calls reach the shared Redis
// through a proxy the test can close (a dead lock store), while h's asynq
// client and server talk to Redis directly: locks and tasks stay in one
// Redis, as the library requires.
func proxiedLockStore(t *testing.T, h *harness, cfg Config) (*stallProxy, *Dedup) {
	t.Helper()
	needRealRedis(t)
	proxy := newStallProxy(t, redistest.Addr())
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = 200 * time.Millisecond
	}
	cfg.Prefix = h.prefix
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	d, err := New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return proxy, d
}

// isScript reports whether cmd runs one of the library's scripts ops (by
// store.ScriptHash's names): an EVALSHA of its hash, or, after a NOSCRIPT,
// an EVAL of its source.
func isScript(cmd redis.Cmder, ops ...string) bool {
	a := cmd.Args()
	if len(a) < 2 || cmd.Name() != "evalsha" && cmd.Name() != "eval" {
		return false
	}
	s, _ := a[1].(string)
	if cmd.Name() == "eval" {
		sum := sha1.Sum([]byte(s))
		s = hex.EncodeToString(sum[:])
	}
	for _, op := range ops {
		if s == store.ScriptHash(op) {
			return true
		}
	}
	return false
}

// benchClient returns NewClient of a Dedup on rdb under a prefix of its
// own (prefix and the benchmark's name), closed when b ends.
func benchClient(b *testing.B, rdb redis.UniversalClient, prefix string) *Client {
	d, err := New(context.Background(), rdb, Config{Prefix: prefix + uniq(b), Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	return d.NewClient()
}
