package dedup

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

func TestBreakerStates(t *testing.T) {
	now := time.Unix(1000, 0)
	b := &breaker{threshold: 3, backoff: Backoff{Min: time.Second, Max: 8 * time.Second}, log: quietLogger(), now: func() time.Time { return now }}
	ctx := context.Background()
	down := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	for i := range 3 {
		if !b.allow() {
			t.Fatalf("call %d refused while closed", i)
		}
		b.record(ctx, down)
	}
	if b.current() != BreakerOpen || b.allow() {
		t.Fatal("not open after 3 consecutive failures")
	}
	// Replies, even error replies, and a caller's own cancellation say Redis is up.
	b2 := &breaker{threshold: 1, backoff: Backoff{Min: time.Second, Max: time.Second}, log: quietLogger()}
	b2.record(ctx, redis.Nil)
	b2.record(ctx, errors.Join(errors.New("x"), redisReplyErr("ERR wrong")))
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	b2.record(cctx, context.Canceled)
	if b2.current() != BreakerClosed {
		t.Fatal("opened on non-faults")
	}
	now = now.Add(time.Second)
	if !b.allow() || b.current() != BreakerProbing {
		t.Fatal("no probe after the backoff")
	}
	if b.allow() {
		t.Fatal("two probes at once")
	}
	b.record(ctx, down) // the probe fails: open again, for longer or equal
	if b.current() != BreakerOpen {
		t.Fatal("failed probe did not reopen")
	}
	now = now.Add(8 * time.Second)
	if !b.allow() {
		t.Fatal("no probe after the capped backoff")
	}
	b.record(ctx, nil)
	if b.current() != BreakerClosed || !b.allow() {
		t.Fatal("successful probe did not close")
	}
	off := &breaker{threshold: -1}
	for range 10 {
		off.record(ctx, down)
	}
	if !off.allow() {
		t.Fatal("disabled breaker refused a call")
	}
}

type redisReplyErr string

func (e redisReplyErr) Error() string { return string(e) }
func (e redisReplyErr) RedisError()   {}

// stallProxy forwards TCP between a client and Redis on loopback; while
// stalled it forwards nothing (a hung Redis), until resumed.
type stallProxy struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	gate   chan struct{} // closed while forwarding
	conns  []net.Conn
}

func newStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{l: l, target: target, gate: make(chan struct{})}
	close(p.gate)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *stallProxy) addr() string { return p.l.Addr().String() }

func (p *stallProxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

func (p *stallProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			gate := p.gate
			p.mu.Unlock()
			<-gate
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				dst.Close()
			}
			return
		}
	}
}

func (p *stallProxy) stall() {
	p.mu.Lock()
	p.gate = make(chan struct{})
	p.mu.Unlock()
}

func (p *stallProxy) resume() {
	p.mu.Lock()
	select {
	case <-p.gate:
	default:
		close(p.gate)
	}
	p.mu.Unlock()
}

func (p *stallProxy) close() {
	p.resume()
	p.l.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// A hung Redis: each lock call gives up after LockTimeout, then the breaker
// opens and calls fail at once, until a probe finds Redis answering again.
func TestBreakerWithHungRedis(t *testing.T) {
	needRealRedis(t)
	proxy := newStallProxy(t, redistest.Addr())
	lrdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), MaxRetries: -1, PoolSize: 4})
	defer lrdb.Close()
	d, err := New(context.Background(), lrdb, Config{
		LockTimeout: 100 * time.Millisecond, BreakerThreshold: 3,
		BreakerBackoff: Backoff{Min: 50 * time.Millisecond, Max: 100 * time.Millisecond}, Logger: quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	h := newHarness(t, Config{})
	c := d.WrapClient(h.asynq) // locks through the proxy, tasks direct
	if _, err := c.Enqueue(userTask(0, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	proxy.stall()
	for i := 1; i <= 3; i++ {
		_, err := c.Enqueue(userTask(i, ""), asynq.Queue(h.queue))
		if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("call %d while hung: err = %v, want ErrUnavailable after the lock timeout", i, err)
		}
	}
	_, err = c.Enqueue(userTask(4, ""), asynq.Queue(h.queue))
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, ErrCircuitOpen) {
		t.Fatalf("after 3 failures: err = %v, want ErrCircuitOpen", err)
	}
	if s := d.Stats(); s.BreakerOpen != 1 {
		t.Fatalf("BreakerOpen = %d", s.BreakerOpen)
	}
	proxy.resume()
	eventually(t, "a probe closes the breaker", func() bool {
		_, err := c.Enqueue(userTask(5, ""), asynq.Queue(h.queue))
		return err == nil
	})
	if st := d.BreakerState(); st != BreakerClosed {
		t.Fatalf("state %v", st)
	}
	if n := h.queueSize(h.queue); n != 2 {
		t.Fatalf("queue holds %d tasks, want 2 (nothing enqueued while hung)", n)
	}
}

// Calls let through before the breaker opened, failing after it did, must not
// reopen it (and push the probe further out) or count more openings.
func TestBreakerOneOpeningPerOutage(t *testing.T) {
	now := time.Unix(1000, 0)
	opens := 0
	b := &breaker{threshold: 5, backoff: Backoff{Min: 500 * time.Millisecond, Max: 30 * time.Second}, log: quietLogger(),
		now: func() time.Time { return now }, onOpen: func() { opens++ }}
	down := &net.OpError{Op: "read", Err: errors.New("connection reset")}
	for range 10 { // ten calls in flight when Redis went away
		b.record(context.Background(), down)
	}
	if opens != 1 {
		t.Fatalf("%d openings for one outage, want 1", opens)
	}
	now = now.Add(500 * time.Millisecond)
	if !b.allow() {
		t.Fatal("no probe after the first backoff")
	}
}
