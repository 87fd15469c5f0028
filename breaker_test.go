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
	"github.com/asynq-dedup/dedup/internal/store"
	"go.uber.org/goleak"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

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
	t.Parallel()
	needRealRedis(t)
	proxy := newStallProxy(t, redistest.Addr())
	lrdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), MaxRetries: -1, PoolSize: 4})
	defer lrdb.Close()
	d, err := New(context.Background(), lrdb, Config{
		LockTimeout: 100 * time.Millisecond, BreakerThreshold: 3,
		breakerBackoff: backoff{Min: 50 * time.Millisecond, Max: 100 * time.Millisecond}, Logger: quietLogger(),
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
	if st := d.breakerState(); st != breakerClosed {
		t.Fatalf("state %v", st)
	}
	if n := h.queueSize(h.queue); n != 2 {
		t.Fatalf("queue holds %d tasks, want 2 (nothing enqueued while hung)", n)
	}
}

// After Close the batcher's goroutines are gone and lock calls still work,
// each on its own round trip; MaxBatch < 0 never batches.
func TestBatcherClosedAndOff(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for _, maxBatch := range []int{0, -1} {
		rdb := newRDB(t)
		q := uniq(t)
		d, err := New(context.Background(), rdb, Config{Prefix: uniq(t), Logger: quietLogger(), MaxBatch: maxBatch})
		if err != nil {
			t.Fatal(err)
		}
		if d.store.Batching() != (maxBatch >= 0) {
			t.Fatalf("MaxBatch %d: batcher %v", maxBatch, d.store.Batching())
		}
		c := d.WrapClient(asynq.NewClientFromRedisClient(rdb))
		if _, err := c.Enqueue(asynq.NewTask("t", []byte(`{"a":1}`)), asynq.Queue(q)); err != nil {
			t.Fatal(err)
		}
		_ = d.Close()
		if _, err := c.Enqueue(asynq.NewTask("t", []byte(`{"a":1}`)), asynq.Queue(q)); !errors.Is(err, ErrDuplicateTask) {
			t.Fatalf("MaxBatch %d, after Close: err = %v, want a duplicate", maxBatch, err)
		}
		if _, err := c.Enqueue(asynq.NewTask("t", []byte(`{"a":2}`)), asynq.Queue(q)); err != nil {
			t.Fatalf("MaxBatch %d, after Close: %v", maxBatch, err)
		}
	}
}

// The root package's breaker states are the store's.
func TestBreakerStateValues(t *testing.T) {
	for st, want := range map[store.BreakerState]breakerState{
		store.BreakerClosed: breakerClosed, store.BreakerOpen: breakerOpen, store.BreakerProbing: breakerProbing,
	} {
		if breakerState(st) != want {
			t.Errorf("store state %d is %v here, want %v", st, breakerState(st), want)
		}
	}
}
