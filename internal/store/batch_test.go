package store

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// gate is a go-redis hook that holds the first `hold` sends (single calls or
// pipelines) until release is closed, and records what was sent.
type gate struct {
	hold    int
	held    chan struct{} // one value per send held
	release chan struct{}

	mu    sync.Mutex
	sends []int // commands per send, in order
	once  sync.Once
}

// open releases the held sends (idempotent): deferred after the batcher's
// stop, so a failing test ends instead of waiting on held senders.
func (g *gate) open() { g.once.Do(func() { close(g.release) }) }

func newGate(hold int) *gate {
	return &gate{hold: hold, held: make(chan struct{}, hold), release: make(chan struct{})}
}

func (g *gate) note(n int) {
	g.mu.Lock()
	g.sends = append(g.sends, n)
	wait := len(g.sends) <= g.hold
	g.mu.Unlock()
	if wait {
		g.held <- struct{}{}
		<-g.release
	}
}

func (g *gate) sent() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int(nil), g.sends...)
}

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			g.note(1)
		}
		return next(ctx, cmd)
	}
}
func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if name := c.Name(); name == "evalsha" || name == "eval" {
				n++
			}
		}
		if n > 0 { // not a connection's handshake
			g.note(n)
		}
		return next(ctx, cmds)
	}
}

// waitingIn counts goroutines blocked in a select inside batcher.do.
func waitingIn() int {
	buf := make([]byte, 16<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "[select") && strings.Contains(g, "(*batcher).do(") {
			n++
		}
	}
	return n
}

var echoScript = redis.NewScript(`return ARGV[1]`)

// Calls that arrive while every slot is busy are sent together, by the
// first caller that finds a slot free again, and each gets its own reply.
func TestBatcherBatchesWaitingCalls(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	rdb := redistest.Client(t)
	if err := echoScript.Load(context.Background(), rdb).Err(); err != nil {
		t.Fatal(err) // else a lone call's EVALSHA, NOSCRIPT, EVAL counts twice
	}
	g := newGate(slots)
	rdb.AddHook(g)
	b := newBatcher(rdb, nil, 64, 10*time.Second)
	defer b.stop()
	defer g.open()

	const waiting = 10
	var wg sync.WaitGroup
	errs := make(chan error, slots+waiting)
	call := func(i int) {
		defer wg.Done()
		want := fmt.Sprint("v", i)
		v, err, ok := b.do(context.Background(), echoScript, []string{"k"}, []any{want})
		if err != nil || !ok || v != want {
			errs <- fmt.Errorf("call %d: %v, %v, %v (want %q)", i, v, err, ok, want)
		}
	}
	wg.Add(slots + waiting)
	for i := range slots {
		// One at a time: a call started while the first is still being
		// collected could join its batch.
		go call(i)
		redistest.WaitFor(t, g.held, "a slot's send held")
	}
	for i := range waiting {
		go call(slots + i)
	}
	// The held calls' callers send their own batches (in the hook); the
	// others wait to hand theirs over.
	redistest.Eventually(t, "calls waiting for a free slot", func() bool { return waitingIn() >= waiting })
	g.open()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	sends := g.sent()
	total := 0
	for _, n := range sends {
		total += n
	}
	if total != slots+waiting {
		t.Fatalf("sent %d commands in %v, want %d", total, sends, slots+waiting)
	}
	// The held sends were alone; the waiting calls went out in at most one
	// batch per slot.
	if len(sends) > slots+slots {
		t.Fatalf("sends %v: the %d waiting calls were not batched", sends, waiting)
	}
}

// A call whose deadline passes while every slot is busy returns
// DeadlineExceeded and is never sent.
func TestBatcherAbandonedCallNotSent(t *testing.T) {
	rdb := redistest.Client(t)
	g := newGate(slots)
	rdb.AddHook(g)
	b := newBatcher(rdb, nil, 64, 10*time.Second)
	defer b.stop()
	defer g.open()
	key := redistest.Uniq(t)
	set := redis.NewScript(`redis.call('SET', KEYS[1], ARGV[1]) return 1`)

	var wg sync.WaitGroup
	wg.Add(slots)
	for range slots {
		go func() {
			defer wg.Done()
			_, _, _ = b.do(context.Background(), echoScript, []string{key}, []any{"x"})
		}()
		redistest.WaitFor(t, g.held, "a slot's send held") // one at a time, so each is its own batch
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err, ok := b.do(ctx, set, []string{key}, []any{"late"}); !ok || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, ok = %v; want DeadlineExceeded", err, ok)
	}
	g.open()
	wg.Wait()
	// The slots are free again: a later call runs, and the abandoned one never did.
	if v, err, _ := b.do(context.Background(), echoScript, []string{key}, []any{"after"}); err != nil || v != "after" {
		t.Fatalf("call after: %v, %v", v, err)
	}
	if n, _ := rdb.Exists(context.Background(), key).Result(); n != 0 {
		t.Fatal("the abandoned call's script ran")
	}
}

// A batch of scripts the server has not cached (a restarted Redis, SCRIPT
// FLUSH) is sent again with EVAL.
func TestBatcherNoScript(t *testing.T) {
	_, rdb := redistest.Own(t, nil) // a script cache without this script: a server of its own
	g := newGate(slots)
	rdb.AddHook(g)
	b := newBatcher(rdb, nil, 64, 10*time.Second)
	defer b.stop()
	defer g.open()
	fresh := redis.NewScript(`return 'fresh:' .. ARGV[1]`) // never loaded

	const n = 12
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			want := fmt.Sprint("fresh:", i)
			if v, err, _ := b.do(context.Background(), fresh, []string{"k"}, []any{i}); err != nil || v != want {
				errs <- fmt.Errorf("call %d: %v, %v (want %q)", i, v, err, want)
			}
		}()
		if i < slots {
			redistest.WaitFor(t, g.held, "a slot's send held")
		}
	}
	redistest.Eventually(t, "calls waiting for a free slot", func() bool { return waitingIn() >= n-slots })
	g.open()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	batched := false
	for _, s := range g.sent() {
		batched = batched || s > 1
	}
	if !batched {
		t.Fatalf("sends %v: no pipeline met NOSCRIPT", g.sent())
	}
}

// hashTag hashes what Redis Cluster hashes: the first non-empty {…}.
func TestHashTag(t *testing.T) {
	for key, want := range map[string]string{
		"dedup:{q}:u:ab": "q", "asynq:{q-1}:t:x": "q-1", "plain": "plain", "a{}b{c}": "a{}b{c}", "x{y": "x{y", "{a}{b}": "a",
	} {
		if got := hashTag(key); got != want {
			t.Errorf("hashTag(%q) = %q, want %q", key, got, want)
		}
	}
}
