// Package redistest starts the redis-server the tests of this module run
// against: one per test binary, on a free loopback port, with persistence
// off. Where redis-server is not installed the tests fall back to an
// in-process miniredis and those that need the real thing skip, unless
// DEDUP_REQUIRE_REDIS is set (as in CI): then the test binary fails.
package redistest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Environment variables.
const (
	// RequireEnv makes a missing redis-server fail the tests instead of
	// falling back to miniredis.
	RequireEnv = "DEDUP_REQUIRE_REDIS"
	// MiniredisEnv forces the miniredis fallback (to try it where
	// redis-server is installed).
	MiniredisEnv = "DEDUP_TEST_MINIREDIS"
	// LogEnv lets go-redis's own log lines through to stderr. Without it
	// Main keeps them out of the test output: the fault tests kill Redis on
	// purpose, and go-redis's "connection refused" lines by the hundred
	// hid real failures.
	LogEnv = "DEDUP_REDIS_LOG"
)

var addr string // the shared server's address, "" when there is none

// Main runs m with a shared redis-server and returns the exit code; call it
// from TestMain: os.Exit(redistest.Main(m, "dedup")). name labels its
// messages.
func Main(m *testing.M, name string) int {
	if os.Getenv(LogEnv) == "" {
		redis.SetLogger(&Quiet)
	}
	var (
		p   *Proc
		err = fmt.Errorf("%s is set", MiniredisEnv)
	)
	if os.Getenv(MiniredisEnv) == "" {
		p, err = Spawn("")
	}
	if err != nil && os.Getenv(RequireEnv) != "" {
		fmt.Fprintf(os.Stderr, "%s tests: %s is set but: %v\n", name, RequireEnv, err)
		return 1
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s tests: %v; using miniredis, tests that need a real redis-server skip\n", name, err)
	} else {
		addr = p.Addr
		defer p.Kill()
	}
	return m.Run()
}

// Quiet is the go-redis logger Main installs (unless LogEnv is set): it
// counts go-redis's log lines and drops them.
var Quiet quietLog

type quietLog struct{ n atomic.Int64 }

// Printf implements go-redis's internal logging interface.
func (q *quietLog) Printf(context.Context, string, ...any) { q.n.Add(1) }

// Lines returns how many lines go-redis logged into q.
func (q *quietLog) Lines() int64 { return q.n.Load() }

// Addr is the shared redis-server's address, or "" when the tests run on
// miniredis.
func Addr() string { return addr }

// Client returns a client of the shared redis-server, or of a fresh
// miniredis when there is none, with ContextTimeoutEnabled (as the README
// advises: the library then makes no client of its own). It is closed when
// the test ends.
func Client(t testing.TB) *redis.Client {
	t.Helper()
	var c *redis.Client
	if addr != "" {
		c = redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64, ContextTimeoutEnabled: true})
	} else {
		mr := miniredis.RunT(t)
		c = redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// NeedReal skips a test that needs a real redis-server.
func NeedReal(t testing.TB) {
	t.Helper()
	if addr == "" {
		t.Skip("needs a real redis-server (not installed here: apt-get install redis-server); CI has one")
	}
}

// Uniq returns a name unique to this test run, safe in key names and hash
// tags: each test gets its own queues and key prefix on the shared server,
// so nothing is flushed.
func Uniq(t testing.TB) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := strings.NewReplacer("/", "_", " ", "_", ":", "_", "{", "_", "}", "_").Replace(t.Name())
	return name + "-" + hex.EncodeToString(b[:])
}

// Proc is a redis-server child process on 127.0.0.1.
type Proc struct {
	Addr string
	Bus  string // a cluster node's bus port (CLUSTER MEET's third argument); "" for others
	Cmd  *exec.Cmd
	dir  string
}

// Log returns the server's log so far ("" once it is killed: its directory
// goes with it).
func (p *Proc) Log() string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "redis.log"))
	return string(b)
}

// Spawn starts redis-server on a free loopback port (or on addr, to restart
// one there), with persistence off and extra arguments after the defaults,
// and waits until it answers PING.
func Spawn(addr string, extra ...string) (*Proc, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not installed")
	}
	if addr != "" {
		return spawnOn(bin, addr, extra)
	}
	for range 3 { // (another process may take the port first)
		if addr, err = FreeAddr(); err != nil {
			return nil, err
		}
		p, err := spawnOn(bin, addr, extra)
		if !errors.Is(err, errPortTaken) {
			return p, err
		}
	}
	return nil, fmt.Errorf("redis-server: %w, three times", errPortTaken)
}

// spawnOn starts redis-server bin on addr, as Spawn says.
func spawnOn(bin, addr string, extra []string) (*Proc, error) {
	_, port, _ := net.SplitHostPort(addr)
	extra, bus, err := withClusterPort(extra)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "dedup-redis-")
	if err != nil {
		return nil, err
	}
	args := append([]string{"--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no", "--loglevel", "warning",
		"--logfile", filepath.Join(dir, "redis.log")}, extra...)
	cmd := exec.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	p := &Proc{Addr: addr, Bus: bus, Cmd: cmd, dir: dir}
	if err := p.awaitPing(passwordOf(extra)); err != nil {
		p.Kill()
		return nil, err
	}
	return p, nil
}

// withClusterPort gives a cluster node a bus port of its own: by default
// it is the port + 10000, which nobody checked was free, and which does
// not exist for a port above 55535 (the node then refuses to start).
func withClusterPort(extra []string) ([]string, string, error) {
	if !slices.Contains(extra, "--cluster-enabled") || slices.Contains(extra, "--cluster-port") {
		return extra, "", nil
	}
	bus, err := FreeAddr()
	if err != nil {
		return nil, "", err
	}
	_, port, _ := net.SplitHostPort(bus)
	return append(slices.Clip(extra), "--cluster-port", port), port, nil
}

// awaitPing polls the new server until it answers: a child process start
// has no signal to wait on.
func (p *Proc) awaitPing(password string) error {
	c := redis.NewClient(&redis.Options{Addr: p.Addr, Password: password, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return p.answersItself(c)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on %s did not answer: %w", p.Addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// answersItself checks that the server answering on p.Addr is p's own
// process, not another one that took the port between FreeAddr's check
// and p's start (p then failed to listen, and exits).
func (p *Proc) answersItself(c *redis.Client) error {
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		return fmt.Errorf("redis-server on %s: INFO: %w", p.Addr, err)
	}
	want := "process_id:" + strconv.Itoa(p.Cmd.Process.Pid) + "\r\n"
	if !strings.Contains(info, want) {
		return fmt.Errorf("%w: %s", errPortTaken, p.Addr)
	}
	return nil
}

// errPortTaken: another process's server answers on the port a new one
// was to listen on.
var errPortTaken = errors.New("another process's redis-server answers on the port")

func passwordOf(args []string) string {
	for i, a := range args {
		if a == "--requirepass" && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

// Kill stops the server with SIGKILL, waits for it and removes its
// directory. Killing twice is harmless.
func (p *Proc) Kill() {
	_ = p.Cmd.Process.Kill()
	_ = p.Cmd.Wait()
	_ = os.RemoveAll(p.dir)
}

// Own starts a redis-server of the test's own (for what must not touch the
// shared one: SCRIPT FLUSH, a kill), with extra arguments after the
// defaults (such as "--requirepass", "pw"), and returns it with a client
// (with ContextTimeoutEnabled, and the password of a --requirepass); tweak
// may adjust the client's options. It skips without a real redis-server.
func Own(t *testing.T, tweak func(*redis.Options), extra ...string) (*Proc, *redis.Client) {
	t.Helper()
	NeedReal(t)
	p, err := Spawn("", extra...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	o := &redis.Options{Addr: p.Addr, Password: passwordOf(extra), ContextTimeoutEnabled: true}
	if tweak != nil {
		tweak(o)
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	return p, rdb
}

// FreeAddr returns a loopback address nothing listens on (at the moment).
// A server a test kills frees its port, and a server started there later
// would answer the first test's clients (a cluster client would even learn
// the other cluster's slots from it). So the ports come from below the
// kernel's ephemeral range (32768 and up on Linux), which no process's
// connect or listen on port 0 takes, each process walks them from a random
// start, and hands each out once.
func FreeAddr() (string, error) {
	handed.Lock()
	defer handed.Unlock()
	if handed.next == 0 {
		handed.next = portsFrom + mrand.IntN(portsTo-portsFrom)
	}
	for range portsTo - portsFrom {
		port := handed.next
		handed.next++
		if handed.next == portsTo {
			handed.next = portsFrom
		}
		if handed.ports[port] {
			continue
		}
		handed.ports[port] = true
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		if l, err := net.Listen("tcp", addr); err == nil {
			_ = l.Close()
			return addr, nil
		}
	}
	return "", fmt.Errorf("no free loopback port left in %d-%d", portsFrom, portsTo-1)
}

// The ports FreeAddr hands out: [portsFrom, portsTo).
const (
	portsFrom = 20000
	portsTo   = 32768
)

// handed holds the ports FreeAddr has handed out, and the next to try.
var handed = struct {
	sync.Mutex
	ports map[int]bool
	next  int
}{ports: map[int]bool{}}

// QuietLogger discards everything: the tests' default logger.
func QuietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// WaitFor receives from ch, failing the test after 30 s.
func WaitFor[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		var zero T
		return zero
	}
}

// Eventually polls cond until it holds, failing the test after 30 s. For
// state that another process or Redis changes, which sends no signal.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// CmdHook is a go-redis hook that calls itself with every command sent,
// alone or in a pipeline, before it is sent.
type CmdHook func(redis.Cmder)

// DialHook implements redis.Hook.
func (h CmdHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (h CmdHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h(cmd); return next(ctx, cmd) }
}

// ProcessPipelineHook implements redis.Hook.
func (h CmdHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h(c)
		}
		return next(ctx, cmds)
	}
}

// LogBuffer is a bytes.Buffer that a logger and a test may share: the
// logger writes from other goroutines while the test reads.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns what was written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
