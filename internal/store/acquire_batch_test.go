package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// sends records the script calls a client sends: the size of every
// pipeline, and the calls sent alone.
type sends struct {
	mu    sync.Mutex
	pipes []int
	alone int
}

func isScript(c redis.Cmder) bool { n := c.Name(); return n == "evalsha" || n == "eval" }

func (h *sends) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *sends) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) {
			h.mu.Lock()
			h.alone++
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (h *sends) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if isScript(c) {
				n++
			}
		}
		if n > 0 {
			h.mu.Lock()
			h.pipes = append(h.pipes, n)
			h.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}

// take returns what has been sent since the last take, and forgets it.
func (h *sends) take() (pipes []int, alone int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	pipes, alone = h.pipes, h.alone
	h.pipes, h.alone = nil, 0
	return pipes, alone
}

// A batch of acquires is answered as one Acquire each would be, in one
// pipeline: new keys taken, the second call of one key meets the first as
// its holder; a call whose holder this process has not met (an old lock's,
// or the first call's of the same batch) is answered by take.lua with the
// holder's name, and makes its second call (acquire.lua, with the holder's
// record) in a second pipeline.
func TestAcquireAllPipelinesAndAnswersAsAcquire(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &sends{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	if err := s.LoadScripts(ctx); err != nil { // (the count below is of calls, not of NOSCRIPT retries)
		t.Fatal(err)
	}
	q := redistest.Uniq(t)
	oldFP := "00000000000000ff"
	old := wrapAcquire(s, q, oldFP, time.Now().Add(-3*time.Hour))
	putTask(rdb, q, old.Ref.ID, StatePending)
	if res, err := s.Acquire(ctx, old); err != nil || res.Status != StatusTaken {
		t.Fatalf("old lock: %+v, %v", res, err)
	}
	s.hints = hintCache{} // another process: it has not met the old lock's holder
	var as []*Acquire
	for i := range 10 {
		as = append(as, wrapAcquire(s, q, fmt.Sprintf("%016x", i+1), time.Now()))
	}
	twice := "00000000000000aa"
	as = append(as, wrapAcquire(s, q, twice, time.Now()), wrapAcquire(s, q, oldFP, time.Now()), wrapAcquire(s, q, twice, time.Now()))
	hook.take()
	out := s.AcquireAll(ctx, as)
	pipes, alone := hook.take()
	if !slices.Equal(pipes, []int{len(as), 2}) || alone != 0 {
		t.Fatalf("pipelines %v and %d calls alone; want [%d 2] and none", pipes, alone, len(as))
	}
	for i, o := range out[:11] {
		if o.Err != nil || o.Status != StatusTaken {
			t.Fatalf("new key %d: %+v", i, o)
		}
	}
	if o := out[11]; o.Err != nil || o.Status != StatusHeld || o.Task != old.Ref.ID {
		t.Fatalf("old lock: %+v; want held by %s", o, old.Ref.ID)
	}
	if o := out[12]; o.Err != nil || o.Status != StatusHeld || o.Task != as[10].Ref.ID {
		t.Fatalf("the key's second call: %+v; want held by the first, %s (its task not stored yet)", o, as[10].Ref.ID)
	}
	for i, a := range as[:11] {
		if v := rdb.Get(ctx, a.Ref.Lock).Val(); v != a.Value {
			t.Fatalf("key %d: lock value %q, want %q", i, v, a.Value)
		}
	}
}

// A Replace into a holder this process knows goes to the acquire script at
// once, pipelined with the batch's other calls.
func TestAcquireAllReplacesIntoAKnownHolder(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &sends{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	if err := s.LoadScripts(ctx); err != nil { // (the count below is of calls, not of NOSCRIPT retries)
		t.Fatal(err)
	}
	q := redistest.Uniq(t)
	fp := "00000000000000bb"
	first := directAcquire(s, q, fp, FoldReplace, "one")
	if res, err := s.Acquire(ctx, first); err != nil || res.Status != StatusTaken || !res.Stored {
		t.Fatalf("first: %+v, %v", res, err)
	}
	hook.take()
	out := s.AcquireAll(ctx, []*Acquire{directAcquire(s, q, fp, FoldReplace, "two"), wrapAcquire(s, q, "00000000000000bc", time.Now())})
	if pipes, alone := hook.take(); !slices.Equal(pipes, []int{2}) || alone != 0 {
		t.Fatalf("pipelines %v and %d calls alone; want [2]", pipes, alone)
	}
	if o := out[0]; o.Err != nil || o.Status != StatusReplaced || o.Task != first.Ref.ID {
		t.Fatalf("replace: %+v; want replaced into %s", o, first.Ref.ID)
	}
	if o := out[1]; o.Err != nil || o.Status != StatusTaken {
		t.Fatalf("new key: %+v", o)
	}
	if _, payload, _, found, err := s.StoredTask(ctx, q, first.Ref.ID); err != nil || !found || string(payload) != "two" {
		t.Fatalf("holder's payload %q (found %v, %v), want two", payload, found, err)
	}
}

// Scripts the server has not cached (a fresh server, SCRIPT FLUSH) are sent
// again whole, and answered.
func TestAcquireAllNoScript(t *testing.T) {
	_, rdb := redistest.Own(t, nil)
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	as := []*Acquire{wrapAcquire(s, q, "0000000000000001", time.Now()), directAcquire(s, q, "0000000000000002", FoldReject, "")}
	for i, o := range s.AcquireAll(context.Background(), as) {
		if o.Err != nil || o.Status != StatusTaken {
			t.Fatalf("call %d: %+v", i, o)
		}
	}
}

// A context that ended before the batch sends nothing: every call fails
// with its error, unsent (a direct call's task was not stored).
func TestAcquireAllEndedContextSendsNothing(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &sends{}
	rdb.AddHook(hook)
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "00000000000000cc"
	a := directAcquire(s, q, fp, FoldReject, "")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	hook.take()
	for i, o := range s.AcquireAll(ctx, []*Acquire{a, wrapAcquire(s, q, "00000000000000cd", time.Now())}) {
		if !errors.Is(o.Err, context.Canceled) || o.Sent {
			t.Fatalf("call %d: %+v; want canceled, not sent", i, o)
		}
	}
	if pipes, alone := hook.take(); len(pipes) != 0 || alone != 0 {
		t.Fatalf("sent %v and %d alone", pipes, alone)
	}
	if n := rdb.Exists(context.Background(), a.Ref.Lock, TaskKey(q, a.Ref.ID)).Val(); n != 0 {
		t.Fatal("a lock was taken, or the task stored")
	}
}

// A node whose breaker is open is not asked: its calls fail at once with
// the breaker's error, unsent.
func TestAcquireAllOpenBreaker(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	s.cfg.ErrCircuitOpen = errors.New("circuit open")
	br := s.sh.one.br
	br.threshold, br.wait = 1, func(int) time.Duration { return time.Hour }
	br.record(context.Background(), errors.New("down")) // one failure opens it
	q := redistest.Uniq(t)
	a := directAcquire(s, q, "00000000000000dd", FoldReject, "")
	for i, o := range s.AcquireAll(context.Background(), []*Acquire{a, wrapAcquire(s, q, "00000000000000de", time.Now())}) {
		if !errors.Is(o.Err, s.cfg.ErrCircuitOpen) || o.Sent {
			t.Fatalf("call %d: %+v; want the breaker's error, not sent", i, o)
		}
	}
}
