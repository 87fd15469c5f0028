package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// errNoRedisServer is returned when no -redis was given and redis-server is
// not on PATH.
var errNoRedisServer = errors.New("redis-server not found in PATH: install it (apt-get install redis-server) or pass -redis host:port of a running Redis")

// ownRedis is a redis-server child process on a free loopback port, with
// persistence off. stop kills it and removes its directory.
type ownRedis struct {
	addr string
	cmd  *exec.Cmd
	dir  string
	done chan struct{}
}

func startRedis(ctx context.Context) (*ownRedis, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, errNoRedisServer
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "dedupbench-redis-")
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cmd := exec.Command(bin,
		"--bind", "127.0.0.1", "--port", strconv.Itoa(port),
		"--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no",
		"--loglevel", "warning", "--logfile", filepath.Join(dir, "redis.log"))
	setChildAttrs(cmd)
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	r := &ownRedis{addr: addr, cmd: cmd, dir: dir, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(r.done) }()

	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := c.Ping(pctx).Err()
		cancel()
		if err == nil {
			return r, nil
		}
		select {
		case <-r.done:
			log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
			r.stop()
			return nil, fmt.Errorf("redis-server on %s exited at start: %s", addr, strings.TrimSpace(string(log)))
		default:
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			r.stop()
			return nil, fmt.Errorf("redis-server on %s did not answer PING: %w", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *ownRedis) stop() {
	if r == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	select {
	case <-r.done:
	case <-time.After(5 * time.Second):
	}
	os.RemoveAll(r.dir)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// redisOptions turns -redis (host:port or a redis:// URL) into options.
func redisOptions(addr string) (*redis.Options, error) {
	if strings.Contains(addr, "://") {
		return redis.ParseURL(addr)
	}
	return &redis.Options{Addr: addr}, nil
}

// redisVersion reads redis_version from INFO server.
func redisVersion(ctx context.Context, rdb *redis.Client) string {
	s, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return "(unknown)"
	}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "redis_version:"); ok {
			return v
		}
	}
	return "(unknown)"
}

// counter is a go-redis hook counting what goes through the shared client:
// commands, round trips (a pipeline is one) and commands by name.
type counter struct {
	cmds  atomic.Int64
	rtts  atomic.Int64
	names sync.Map // string → *atomic.Int64
}

type counts struct {
	cmds, rtts int64
	byName     map[string]int64
}

func (c *counter) name(n string) {
	v, ok := c.names.Load(n)
	if !ok {
		v, _ = c.names.LoadOrStore(n, new(atomic.Int64))
	}
	v.(*atomic.Int64).Add(1)
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.cmds.Add(1)
		c.rtts.Add(1)
		c.name(cmd.Name())
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.cmds.Add(int64(len(cmds)))
		c.rtts.Add(1)
		for _, cmd := range cmds {
			c.name(cmd.Name())
		}
		return next(ctx, cmds)
	}
}

func (c *counter) snapshot() counts {
	s := counts{cmds: c.cmds.Load(), rtts: c.rtts.Load(), byName: map[string]int64{}}
	c.names.Range(func(k, v any) bool {
		s.byName[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	return s
}

// sub returns what was counted between o and c.
func (c counts) sub(o counts) counts {
	d := counts{cmds: c.cmds - o.cmds, rtts: c.rtts - o.rtts, byName: map[string]int64{}}
	for k, v := range c.byName {
		if n := v - o.byName[k]; n != 0 {
			d.byName[k] = n
		}
	}
	return d
}

func (c *counts) add(o counts) {
	c.cmds += o.cmds
	c.rtts += o.rtts
	if c.byName == nil {
		c.byName = map[string]int64{}
	}
	for k, v := range o.byName {
		c.byName[k] += v
	}
}

// scanMatching calls fn with each page of keys matching pattern.
func scanMatching(ctx context.Context, rdb redis.Cmdable, pattern string, fn func(keys []string) error) error {
	var cursor uint64
	for {
		keys, next, err := rdb.Scan(ctx, cursor, pattern, 1000).Result()
		if err != nil {
			return err
		}
		if err := fn(keys); err != nil {
			return err
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// unlinkMatching deletes the keys matching pattern with SCAN and batched
// UNLINK. It never touches other keys, so it is safe on a shared Redis.
func unlinkMatching(ctx context.Context, rdb redis.Cmdable, pattern string) (int, error) {
	n := 0
	err := scanMatching(ctx, rdb, pattern, func(keys []string) error {
		for len(keys) > 0 {
			batch := keys[:min(len(keys), 500)]
			keys = keys[len(batch):]
			if err := rdb.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			n += len(batch)
		}
		return nil
	})
	return n, err
}

// countMatching counts the keys matching pattern.
func countMatching(ctx context.Context, rdb redis.Cmdable, pattern string) (int, error) {
	n := 0
	err := scanMatching(ctx, rdb, pattern, func(keys []string) error {
		n += len(keys)
		return nil
	})
	return n, err
}

// redisCPU is the CPU time Redis's main thread has used (INFO cpu), the
// thread that runs every command and script. It falls back to the whole
// process's time on versions without the per-thread fields.
// redisCommands is the number of commands Redis has run (INFO
// commandstats, summed), every client's.
func redisCommands(ctx context.Context, rdb *redis.Client) (int64, error) {
	s, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		_, rest, ok := strings.Cut(sc.Text(), ":calls=")
		if !ok {
			continue
		}
		num, _, _ := strings.Cut(rest, ",")
		if c, err := strconv.ParseInt(num, 10, 64); err == nil {
			n += c
		}
	}
	return n, nil
}

func redisCPU(ctx context.Context, rdb *redis.Client) (time.Duration, error) {
	s, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	return parseCPU(s)
}

// parseCPU reads the main thread's CPU time out of INFO cpu's text, or the
// whole process's when the per-thread fields are missing.
func parseCPU(s string) (time.Duration, error) {
	f := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if !ok {
			continue
		}
		if x, err := strconv.ParseFloat(v, 64); err == nil {
			f[k] = x
		}
	}
	for _, pre := range []string{"used_cpu_%s_main_thread", "used_cpu_%s"} {
		sys, ok1 := f[fmt.Sprintf(pre, "sys")]
		user, ok2 := f[fmt.Sprintf(pre, "user")]
		if ok1 && ok2 {
			return time.Duration((sys + user) * float64(time.Second)), nil
		}
	}
	// A reading of 0 would pass for a case that cost Redis nothing.
	return 0, errors.New("INFO cpu: no used_cpu_sys/used_cpu_user fields")
}
