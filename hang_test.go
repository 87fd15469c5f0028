package dedup

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// hungDedup is a Dedup whose Redis calls go through a stall proxy, with
// go-redis's default options (ReadTimeout 3 s, MaxRetries 3) unless tweak
// changes them.
func hungDedup(t *testing.T, cfg Config, tweak func(*redis.Options)) (*stallProxy, *Dedup, *harness) {
	t.Helper()
	needRealRedis(t)
	proxy := newStallProxy(t, redistest.Addr())
	o := &redis.Options{Addr: proxy.addr(), PoolSize: 8}
	if tweak != nil {
		tweak(o)
	}
	lrdb := redis.NewClient(o)
	t.Cleanup(func() { _ = lrdb.Close() })
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = 100 * time.Millisecond
	}
	cfg.Logger = quietLogger()
	h := newHarness(t, Config{})
	cfg.Prefix = h.prefix
	d, err := New(context.Background(), lrdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return proxy, d, h
}

// Close after a hung Redis: lock calls each gave up at LockTimeout, but
// Close must not wait for go-redis's own timeouts (the batcher's senders
// are stuck in a read that ignores the context without
// ContextTimeoutEnabled).
func TestCloseReturnsWhileRedisHangs(t *testing.T) {
	proxy, d, h := hungDedup(t, Config{BreakerThreshold: -1}, nil)
	c := d.WrapClient(h.asynq)
	if _, err := c.Enqueue(userTask(0, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	proxy.stall()
	var wg sync.WaitGroup
	for i := 1; i <= 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			_, err := c.Enqueue(userTask(i, ""), asynq.Queue(h.queue))
			if !errors.Is(err, ErrUnavailable) {
				t.Errorf("call %d while hung: %v, want ErrUnavailable", i, err)
			}
			if el := time.Since(start); el > time.Second {
				t.Errorf("call %d took %v with LockTimeout 100ms", i, el)
			}
		}()
	}
	wg.Wait()
	start := time.Now()
	_ = d.Close()
	if el := time.Since(start); el > time.Second {
		t.Errorf("Close took %v while Redis hung (LockTimeout 100ms): it waits for the batcher's senders stuck in go-redis reads", el)
	}
	proxy.resume()
}

// Heartbeat and settle through a hung Redis: no race, no leak; after the
// hang the running lock is renewed again and released at the end.
func TestHeartbeatRecoversAfterHang(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { // after every other cleanup (the harness's Dedup, the proxy)
		goleak.VerifyNone(t, ignore, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
	})
	proxy, d, h := hungDedup(t, Config{heartbeat: (600 * time.Millisecond) / 3, BreakerThreshold: 2,
		breakerBackoff: backoff{Min: 50 * time.Millisecond, Max: 100 * time.Millisecond}}, func(o *redis.Options) { o.MaxRetries = -1 })
	release := make(chan struct{})
	running := make(chan string, 1)
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 2, Queues: map[string]int{h.queue: 1},
		LogLevel: asynq.FatalLevel, TaskCheckInterval: 20 * time.Millisecond, IsFailure: IsFailure})
	if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		running <- id
		<-release
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	c := d.WrapClient(h.asynq)
	task := userTask(1, "")
	info, err := c.Enqueue(task, asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, running, "handler")
	key := h.keyOf(task, h.queue)
	proxy.stall()
	time.Sleep(400 * time.Millisecond) // beats fail; lease (600ms) not yet lapsed in Redis
	proxy.resume()
	time.Sleep(500 * time.Millisecond) // beats succeed again
	if owner := h.lockOwner(key); owner != info.ID {
		t.Errorf("after the hang the running lock is owned by %q, want %s (heartbeat did not resume)", owner, info.ID)
	}
	close(release)
	eventually(t, "released", func() bool { return h.lockOwner(key) == "" })
	srv.Shutdown()
	_ = d.Close()
	if s := d.Stats(); s.Released != 1 || s.LockLost != 0 {
		t.Errorf("stats %+v", s)
	}
}

// Everything at once through a Redis that keeps hanging and answering:
// enqueues (batched), WaitHolder (Foreign), FlushStats (Pipelined), the
// heartbeat. Under -race: no data race; every error matches ErrUnavailable
// (or is a duplicate / the caller's deadline); no goroutine survives Close
// once Redis answers again.
func TestFlappingRedisNoRaceNoLeak(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		goleak.VerifyNone(t, ignore, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
	})
	for _, ctxTimeouts := range []bool{false, true} {
		proxy, d, h := hungDedup(t, Config{LockTimeout: 80 * time.Millisecond, heartbeat: (300 * time.Millisecond) / 3, BreakerThreshold: 3,
			breakerBackoff: backoff{Min: 20 * time.Millisecond, Max: 80 * time.Millisecond}}, func(o *redis.Options) {
			o.ContextTimeoutEnabled = ctxTimeouts
			o.MaxRetries = -1
			o.ReadTimeout = 300 * time.Millisecond
		})
		c := d.WrapClient(h.asynq)
		dc := d.NewClient()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var bad []error
		report := func(err error) {
			if err == nil || errors.Is(err, ErrUnavailable) || errors.Is(err, ErrDuplicateTask) || errors.Is(err, ErrResultUnavailable) ||
				errors.Is(err, context.DeadlineExceeded) || errors.Is(err, asynq.ErrTaskIDConflict) {
				return
			}
			mu.Lock()
			bad = append(bad, err)
			mu.Unlock()
		}
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					cl := c
					if g%2 == 0 {
						cl = dc
					}
					_, err := cl.Submit(context.Background(), userTask(i%20, ""), asynq.Queue(h.queue), OnConflict(Replace))
					report(err)
					var dup *DuplicateTaskError
					if errors.As(err, &dup) && i%5 == 0 {
						ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
						_, werr := d.WaitHolder(ctx, dup)
						cancel()
						report(werr)
					}
					if i%10 == 0 {
						report(d.FlushStats(context.Background()))
					}
				}
			}()
		}
		for range 10 {
			proxy.stall()
			time.Sleep(60 * time.Millisecond)
			proxy.resume()
			time.Sleep(60 * time.Millisecond)
		}
		close(stop)
		wg.Wait()
		_ = d.Close()
		for _, err := range bad {
			t.Errorf("ctxTimeouts=%v: unexpected error %v", ctxTimeouts, err)
		}
	}
}

// replyDelayProxy forwards requests at once and holds replies back for
// delay: Redis runs every command, the client sees the answer late.
type replyDelayProxy struct {
	l      net.Listener
	target string
	delay  atomic.Int64
}

func newReplyDelayProxy(t *testing.T, target string) *replyDelayProxy {
	t.Helper()
	p := &replyDelayProxy{target: target}
	p.l = serveProxy(t, target, func(c, up net.Conn) {
		go func() { _, _ = io.Copy(up, c); up.Close() }()
		copyChunks(c, up, func([]byte) { time.Sleep(time.Duration(p.delay.Load())) }, nil)
	})
	return p
}

// serveProxy listens on a free loopback port and, for each connection,
// dials target and hands both ends to pipe (on its own goroutine), until the
// test ends.
func serveProxy(t *testing.T, target string, pipe func(client, upstream net.Conn)) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			go pipe(c, up)
		}
	}()
	t.Cleanup(func() { l.Close() })
	return l
}

// copyChunks copies src to dst chunk by chunk, calling before ahead of each
// write and after (if set) once it is written, and closes dst when src ends.
func copyChunks(dst, src net.Conn, before func([]byte), after func()) {
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			before(buf[:n])
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
			if after != nil {
				after()
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

// Every call the library makes is bounded by LockTimeout, with the go-redis
// client's default options (no ContextTimeoutEnabled, ReadTimeout 3 s):
// Lookup, Release and Ping of both kinds of Client return ErrUnavailable
// within LockTimeout while Redis hangs. (An enqueue whose call carried its
// task asks once more whether it was stored: two calls.)
func TestLookupReleaseAndPingAreBoundedByLockTimeoutWhileRedisHangs(t *testing.T) {
	t.Parallel()
	const lockTimeout = 400 * time.Millisecond
	proxy, d, h := hungDedup(t, Config{LockTimeout: lockTimeout, BreakerThreshold: -1}, nil)
	t.Cleanup(func() { _ = d.Close() })
	task := userTask(1, "")
	if _, err := d.NewClient().Enqueue(task, asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	wrapped := asynq.NewClientFromRedisClient(d.rdb) // its Redis hangs too
	proxy.stall()
	t.Cleanup(proxy.resume)
	ctx := context.Background()
	calls := map[string]int{"Enqueue (NewClient)": 2}
	for name, call := range map[string]func() error{
		"Lookup": func() error { _, _, err := d.Lookup(ctx, task, asynq.Queue(h.queue)); return err },
		"Release": func() error {
			_, err := d.Release(ctx, task, "", asynq.Queue(h.queue))
			return err
		},
		"NewClient().Ping":    func() error { return d.NewClient().Ping() },
		"WrapClient().Ping":   func() error { return d.WrapClient(wrapped).Ping() },
		"Enqueue (NewClient)": func() error { _, err := d.NewClient().Enqueue(userTask(2, ""), asynq.Queue(h.queue)); return err },
	} {
		start := time.Now()
		err := call()
		took := time.Since(start)
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s while Redis hangs: %v, want ErrUnavailable", name, err)
		}
		if took > time.Duration(max(calls[name], 1))*lockTimeout+300*time.Millisecond {
			t.Errorf("%s took %v while Redis hangs, LockTimeout %v", name, took.Round(time.Millisecond), lockTimeout)
		}
	}
}

// README (Failure modes): a hung lock store never fails a task, and a plain
// task's key needs no call of the library's to be freed: asynq's own done
// script, which marks the task done, deletes the lock its record names.
func TestHungLockStoreStillFreesAPlainTasksKeyAtSuccess(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	proxy, sd := proxiedLockStore(t, h, Config{Rules: counterRules(Rule{}).Rules})
	started, gate := make(chan string, 1), make(chan struct{})
	serveRaw(t, h.rdb, h.queue, sd.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-gate
		return nil
	})), nil)
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	waitFor(t, started, "A runs")
	proxy.stall() // the worker's lock store hangs
	t.Cleanup(proxy.resume)
	close(gate)
	eventually(t, "A completed in asynq", func() bool { return h.taskState(a.ID) == 0 })
	eventually(t, "A's key freed by asynq", func() bool { return h.rdb.Exists(ctx, key).Val() == 0 })
	if st := sd.Stats(); st.RedisErrors != 0 {
		t.Errorf("stats %+v: a plain task's end made a call to the hung lock store", st)
	}
}

// A task whose key's policy acts only at enqueue costs the worker no
// Redis call of the library's: with the library's own Redis connection
// stalled, its attempt still runs, succeeds, and asynq's own done script
// releases its key.
func TestPlainTaskRunsWhileTheLibrarysRedisStalls(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{})
	proxy, sd := proxiedLockStore(t, h, Config{Rules: counterRules(Rule{}).Rules, LockTimeout: 3 * time.Second})
	ran := make(chan string, 4)
	serveRaw(t, h.rdb, h.queue, sd.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		return nil
	})), nil)
	task := counterTask("k", 1, 1)
	a := h.enqueue(task)
	requirePlainID(t, a.ID)
	proxy.stall()
	t.Cleanup(proxy.resume)
	if id := waitFor(t, ran, "A runs while the library's Redis stalls"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	key := h.keyOf(task, h.queue)
	eventually(t, "asynq completes A and releases its key", func() bool { return h.rdb.Exists(context.Background(), key).Val() == 0 })
	if st := sd.Stats(); st.RedisErrors != 0 || st.Released != 1 {
		t.Errorf("stats %+v: want one release, no Redis error (the middleware made no call)", st)
	}
}
