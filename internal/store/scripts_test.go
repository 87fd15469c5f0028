package store

import (
	"context"
	"strings"
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
