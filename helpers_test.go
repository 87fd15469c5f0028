package dedup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Tests run against a real redis-server started on a free loopback port by
// TestMain. Where redis-server is not installed they fall back to miniredis,
// and tests that need the real thing skip with a message saying so.

var realRedisAddr string // "" when no redis-server is running for the tests

func TestMain(m *testing.M) {
	if os.Getenv(faultWorkerEnv) == "1" { // a worker process of TestFaultWorkerKilled
		if err := runFaultWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "fault worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	var (
		stop func()
		addr string
		err  = fmt.Errorf("DEDUP_TEST_MINIREDIS is set")
	)
	if os.Getenv("DEDUP_TEST_MINIREDIS") == "" { // set it to try the embedded fallback
		stop, addr, err = startRedisServer()
	}
	if err != nil && os.Getenv("DEDUP_REQUIRE_REDIS") != "" {
		fmt.Fprintf(os.Stderr, "dedup tests: DEDUP_REQUIRE_REDIS is set but: %v\n", err)
		os.Exit(1)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "dedup tests: %v; using miniredis, tests that need a real redis-server skip\n", err)
	}
	realRedisAddr = addr
	code := m.Run()
	if stop != nil {
		stop()
	}
	os.Exit(code)
}

// redisProc is a redis-server child process on 127.0.0.1.
type redisProc struct {
	cmd  *exec.Cmd
	addr string
	dir  string
	args []string
}

// startRedisServer starts one redis-server for the whole package.
func startRedisServer() (func(), string, error) {
	p, err := spawnRedis("")
	if err != nil {
		return nil, "", err
	}
	return func() { p.kill() }, p.addr, nil
}

// spawnRedis starts redis-server on a free loopback port (or on addr, to
// restart one), with persistence off, and waits until it answers PING.
func spawnRedis(addr string, extra ...string) (*redisProc, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not installed")
	}
	if addr == "" {
		if addr, err = freeAddr(); err != nil {
			return nil, err
		}
	}
	_, port, _ := net.SplitHostPort(addr)
	dir, err := os.MkdirTemp("", "dedup-redis-")
	if err != nil {
		return nil, err
	}
	args := append([]string{"--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no", "--loglevel", "warning",
		"--logfile", filepath.Join(dir, "redis.log")}, extra...)
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &redisProc{cmd: cmd, addr: addr, dir: dir, args: extra}
	c := redis.NewClient(&redis.Options{Addr: addr, Password: passwordOf(extra), MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return p, nil
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, fmt.Errorf("redis-server on %s did not answer: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a child process start; no signal to wait on
	}
}

func passwordOf(args []string) string {
	for i, a := range args {
		if a == "--requirepass" && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

// kill stops the server with SIGKILL and waits for it.
func (p *redisProc) kill() {
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	_ = os.RemoveAll(p.dir)
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// newRDB returns a client of the shared redis-server, or of a fresh
// miniredis when there is none.
func newRDB(t testing.TB) redis.UniversalClient {
	t.Helper()
	var c *redis.Client
	if realRedisAddr != "" {
		c = redis.NewClient(&redis.Options{Addr: realRedisAddr, PoolSize: 64})
	} else {
		mr := miniredis.RunT(t)
		c = redis.NewClient(&redis.Options{Addr: mr.Addr()})
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// needRealRedis skips a test that needs a real redis-server.
func needRealRedis(t testing.TB) {
	t.Helper()
	if realRedisAddr == "" {
		t.Skip("needs a real redis-server (not installed here: apt-get install redis-server); CI has one")
	}
}

// uniq returns a name unique to this test run: each test gets its own
// queues and key prefix on the shared server, so nothing is flushed.
func uniq(t testing.TB) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := strings.NewReplacer("/", "_", " ", "_", ":", "_", "{", "_", "}", "_").Replace(t.Name())
	return name + "-" + hex.EncodeToString(b[:])
}

// ownRedis starts a redis-server of the test's own (for what must not touch
// the shared one: SCRIPT FLUSH, short key names, a kill) and returns it with
// a client; tweak may adjust the client's options.
func ownRedis(t *testing.T, tweak func(*redis.Options)) (*redisProc, *redis.Client) {
	t.Helper()
	needRealRedis(t)
	p, err := spawnRedis("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	o := &redis.Options{Addr: p.addr}
	if tweak != nil {
		tweak(o)
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	return p, rdb
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
