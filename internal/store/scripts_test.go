package store

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// In the checked build (the tests' build) a script that reads or writes a
// key it was not given fails, instead of working on one node and splitting
// a queue's keys during a Redis Cluster slot migration.
func TestCheckedScriptsRefuseUndeclaredKeys(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	k := redistest.Uniq(t)
	for _, body := range []string{
		`return call('GET', ARGV[1])`,
		`return call('DEL', KEYS[1], ARGV[1])`,
		`return call('HSET', ARGV[1], 'f', 'v')`,
	} {
		err := LibScript(body).Run(ctx, rdb, []string{k + ":given"}, k+":other").Err()
		if err == nil || !strings.Contains(err.Error(), "not given in KEYS") {
			t.Errorf("%s: err = %v, want the undeclared key refused", body, err)
		}
	}
	if err := LibScript(`return call('DEL', KEYS[1])`).Run(ctx, rdb, []string{k + ":given"}).Err(); err != nil {
		t.Errorf("a declared key: %v", err)
	}
	if _, err := LibScript(`return now_parts()`).Run(ctx, rdb, nil).Result(); err != nil {
		t.Errorf("TIME touches no key: %v", err)
	}
}

// scriptCalls counts EVALSHA/EVAL commands a client sends, alone or in
// pipelines.
type scriptCalls struct{ n atomic.Int64 }

func (h *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n == "evalsha" || n == "eval" {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			if n := c.Name(); n == "evalsha" || n == "eval" {
				h.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// A lock older than the heal grace makes acquire read its holder's asynq
// record, whose key the caller could not know: without a hint the script
// asks for it (changing nothing) and the second call decides; the answer
// is remembered, so the next call on the key passes the key at once; a
// hint that went stale (another holder) costs one more call, never a wrong
// answer.
func TestAcquireAsksForTheHolderItCannotKnow(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &scriptCalls{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "00112233445566aa"
	old := time.Now().Add(-2 * time.Hour)
	take := func(id string, at time.Time) AcquireResult {
		t.Helper()
		res, err := s.Acquire(ctx, &Acquire{Ref: Ref{Queue: q, FP: fp, ID: id, Type: "t"}, OnWaiting: FoldReject,
			OnRunning: RunReject, TTL: time.Hour, Now: at})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	first := NewLockedID(fp)
	rdb.HSet(ctx, TaskKey(q, first), "state", StatePending)
	if res := take(first, old.Add(-2*time.Hour)); res.Status != StatusTaken {
		t.Fatalf("first: %+v", res)
	}
	s.hints = hintCache{} // another process: no hint
	calls := func(f func()) int64 {
		n := hook.n.Load()
		f()
		return hook.n.Load() - n
	}
	var res AcquireResult
	if n := calls(func() { res = take(NewLockedID(fp), time.Now()) }); n != 2 || res.Status != StatusHeld || res.Task != first {
		t.Fatalf("old lock, no hint: %d calls, %+v; want 2 calls, held by %s", n, res, first)
	}
	if n := calls(func() { res = take(NewLockedID(fp), time.Now()) }); n != 1 || res.Status != StatusHeld || res.Task != first {
		t.Fatalf("old lock, hint: %d calls, %+v; want 1 call", n, res)
	}
	// The holder is gone: the lock heals to a new task, which another
	// process's next call finds through its stale hint.
	rdb.Del(ctx, TaskKey(q, first))
	second := NewLockedID(fp)
	other := newTestStore(t, rdb)
	other.cfg.Prefix, other.keys = s.cfg.Prefix, s.keys
	rdb.HSet(ctx, TaskKey(q, second), "state", StatePending)
	if res, err := other.Acquire(ctx, &Acquire{Ref: Ref{Queue: q, FP: fp, ID: second, Type: "t"}, OnWaiting: FoldReject,
		OnRunning: RunReject, TTL: time.Hour, Now: old}); err != nil || res.Status != StatusTaken {
		t.Fatalf("heal: %+v, %v", res, err)
	}
	if n := calls(func() { res = take(NewLockedID(fp), time.Now()) }); n != 2 || res.Status != StatusHeld || res.Task != second {
		t.Fatalf("stale hint: %d calls, %+v; want 2 calls, held by %s", n, res, second)
	}
}

// A script that lacks a key writes nothing: its reply only names what it
// needs.
func TestNeedChangesNothing(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "00112233445566bb"
	holder := NewLockedID(fp)
	lock := s.keys.Lock(q, fp)
	rdb.HSet(ctx, lock, FieldOwner, PackOwner(holder, fp), FieldCreated, 1) // ancient: must be checked
	rdb.Expire(ctx, lock, time.Hour)
	before := rdb.HGetAll(ctx, lock).Val()
	id := NewLockedID(fp)
	a := &Acquire{Ref: Ref{Queue: q, FP: fp, ID: id, Type: "t"}, OnWaiting: FoldReplace, OnRunning: RunReject,
		TTL: time.Hour, Now: time.Now(), Payload: []byte("x")}
	keys, args := a.build(s, lock, &hint{}, false)
	v, err := s.sc.acquire.Run(ctx, rdb, keys, args...).Result()
	if err != nil {
		t.Fatal(err)
	}
	rep, err := parseReply(v)
	if err != nil || rep.status != statusNeed || !strings.Contains(rep.str(0), "H") || UnpackOwner(rep.str(1), fp) != holder {
		t.Fatalf("reply %+v, %v; want need H for %s", rep, err, holder)
	}
	if after := rdb.HGetAll(ctx, lock).Val(); len(after) != len(before) || after[FieldOwner] != before[FieldOwner] {
		t.Fatalf("lock changed: %v → %v", before, after)
	}
}

// The hint cache stays within its bound, however many locks pass through.
func TestHintCacheBounded(t *testing.T) {
	var c hintCache
	for i := range 10 * hintShards * hintsPerShard {
		c.put(string(rune(i))+"-lock", hint{holder: "h"})
	}
	total := 0
	for i := range c.shards {
		total += len(c.shards[i].m)
	}
	if total > hintShards*hintsPerShard {
		t.Fatalf("%d hints kept, bound %d", total, hintShards*hintsPerShard)
	}
	c.put("k", hint{holder: "a"})
	if h, ok := c.get("k"); !ok || h.holder != "a" {
		t.Fatalf("get after put: %+v %v", h, ok)
	}
	c.forget("k")
	if _, ok := c.get("k"); ok {
		t.Fatal("forgotten hint still there")
	}
}

// A lock written with its task (v) is judged by the task's record, but a
// process that read that record less than Config.Recheck ago answers a
// plain rejection from the lock alone; after that it reads the record
// again, and a task gone meanwhile frees the key.
func TestRecheckTrustsAVerifiedLockBriefly(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &lastRoles{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "00112233445566bb"
	now := time.Now()
	acquire := func(id string, at time.Time, direct bool) AcquireResult {
		t.Helper()
		a := &Acquire{Ref: Ref{Queue: q, FP: fp, ID: id, Type: "t"}, OnWaiting: FoldReject, OnRunning: RunReject,
			TTL: time.Hour, Now: at, Direct: direct, Message: Message{Type: "t", ID: id, Queue: q, Retry: 25, Timeout: time.Minute}}
		res, err := s.Acquire(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	// reads reports whether the call sent the owner's record (role H) rather
	// than trusting the lock (the 'X' head).
	reads := func(f func()) bool { f(); r := hook.get(); return r[0] != 'X' && strings.Contains(r[2:], "H") }
	first := NewLockedID(fp)
	if res := acquire(first, now, true); res.Status != StatusTaken || !res.Stored {
		t.Fatalf("first: %+v", res)
	}
	if v := rdb.HGet(ctx, s.keys.Lock(q, fp), FieldStored).Val(); v != "1" {
		t.Fatalf("lock stored with its task has v=%q", v)
	}
	var res AcquireResult
	if read := reads(func() { res = acquire(NewLockedID(fp), now.Add(time.Millisecond), true) }); res.Status != StatusHeld || res.Task != first || !read {
		t.Fatalf("rejection: %+v, owner's record read %v; want held by %s, read", res, read, first)
	}
	if read := reads(func() { res = acquire(NewLockedID(fp), now.Add(50*time.Millisecond), true) }); res.Status != StatusHeld || read {
		t.Fatalf("rejection within Recheck: %+v, owner's record read %v; want held, answered from the lock alone", res, read)
	}
	rdb.Del(ctx, TaskKey(q, first)) // deleted by hand
	if res := acquire(NewLockedID(fp), now.Add(60*time.Millisecond), true); res.Status != StatusHeld {
		t.Fatalf("within Recheck of the last read: %+v; want held (trusted)", res)
	}
	second := NewLockedID(fp)
	if res := acquire(second, now.Add(DefaultRecheck+10*time.Millisecond), true); res.Status != StatusTaken {
		t.Fatalf("after Recheck, the owner gone: %+v; want taken at once (HealGrace notwithstanding)", res)
	}
}

// lastRoles remembers ARGV[1] (the policy head and role letters) of the
// last script call.
type lastRoles struct {
	mu    sync.Mutex
	roles string
}

func (h *lastRoles) get() string { h.mu.Lock(); defer h.mu.Unlock(); return h.roles }
func (h *lastRoles) note(cmd redis.Cmder) {
	args := cmd.Args()
	if n := cmd.Name(); (n != "evalsha" && n != "eval") || len(args) < 4 {
		return
	}
	nk, _ := args[2].(int)
	if 3+nk >= len(args) {
		return
	}
	if r, ok := args[3+nk].(string); ok {
		h.mu.Lock()
		h.roles = r
		h.mu.Unlock()
	}
}
func (h *lastRoles) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *lastRoles) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.note(cmd); return next(ctx, cmd) }
}
func (h *lastRoles) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.note(c)
		}
		return next(ctx, cmds)
	}
}
