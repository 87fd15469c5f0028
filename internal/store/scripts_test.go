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

// A held key makes an enqueue read its holder's asynq record, whose key the
// caller cannot know: without a hint take.lua names the holder (changing
// nothing) and acquire.lua, given the holder's record, decides; the answer
// is remembered, so the next call on the key passes the record at once and
// take.lua answers alone; a hint that went stale (another holder) costs one
// more call, never a wrong answer.
func TestAcquireAsksForTheHolderItCannotKnow(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &scriptCalls{}
	rdb.AddHook(hook)
	s := newTestStore(t, rdb)
	s.cfg.Recheck = -1 // every rejection reads the holder's record
	// (The counts below are of calls, not of NOSCRIPT retries.)
	if err := s.LoadScripts(context.Background()); err != nil {
		t.Fatal(err)
	}
	q := redistest.Uniq(t)
	fp := "00112233445566aa"
	first := directAcquire(s, q, fp, FoldReject, "")
	if res := mustAcquire(t, s, first); res.Status != StatusTaken || !res.Stored {
		t.Fatalf("first: %+v", res)
	}
	calls := func(by *Store, a *Acquire) (int64, AcquireResult) {
		n := hook.n.Load()
		res := mustAcquire(t, by, a)
		return hook.n.Load() - n, res
	}
	// The process that took the key knows its holder: one call.
	if n, res := calls(s, directAcquire(s, q, fp, FoldReject, "")); n != 1 || res.Status != StatusHeld || res.Task != first.Ref.ID {
		t.Fatalf("the taker's duplicate: %d calls, %+v; want 1 call, held by %s", n, res, first.Ref.ID)
	}
	// Another process cannot know it: take names it, acquire reads its record.
	other := New(rdb, s.cfg)
	t.Cleanup(func() { other.Close(rdb) })
	if n, res := calls(other, directAcquire(other, q, fp, FoldReject, "")); n != 2 || res.Status != StatusHeld || res.Task != first.Ref.ID {
		t.Fatalf("no hint: %d calls, %+v; want 2 calls, held by %s", n, res, first.Ref.ID)
	}
	if n, res := calls(other, directAcquire(other, q, fp, FoldReject, "")); n != 1 || res.Status != StatusHeld || res.Task != first.Ref.ID {
		t.Fatalf("hint: %d calls, %+v; want 1 call", n, res)
	}
	// The holder is deleted behind asynq's scripts' back: a third process's
	// enqueue heals the lock and takes the key, which the first process's
	// next call finds through its stale hint.
	rdb.Del(context.Background(), TaskKey(q, first.Ref.ID))
	third := New(rdb, s.cfg)
	t.Cleanup(func() { third.Close(rdb) })
	second := directAcquire(third, q, fp, FoldReject, "")
	if n, res := calls(third, second); n != 3 || res.Status != StatusTaken || !res.Stored {
		t.Fatalf("heal: %d calls, %+v; want taken in 3 calls (take names the holder, acquire heals, take takes)", n, res)
	}
	if n, res := calls(s, directAcquire(s, q, fp, FoldReject, "")); n != 2 || res.Status != StatusHeld || res.Task != second.Ref.ID {
		t.Fatalf("stale hint: %d calls, %+v; want 2 calls, held by %s", n, res, second.Ref.ID)
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
	holder := NewPlainID()
	lock := s.keys.Lock(q, fp)
	putTask(rdb, q, holder, StatePending)
	rdb.Set(ctx, lock, Value(holder), time.Hour)
	rdb.HSet(ctx, ModeOf(lock), FieldHolder, holder, FieldFolds, 3)
	rdb.Expire(ctx, ModeOf(lock), time.Hour)
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	a := directAcquire(s, q, fp, FoldReplace, "x")
	keys, args := a.general(s, &hint{}, false)
	v, err := s.sc.acquire.Run(ctx, rdb, keys, args...).Result()
	if err != nil {
		t.Fatal(err)
	}
	rep, err := parseReply(v)
	if err != nil || rep.status != statusNeed || !strings.Contains(rep.str(0), "H") || rep.str(1) != holder {
		t.Fatalf("reply %+v, %v; want need H for %s", rep, err, holder)
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Fatalf("the need reply changed %v", d)
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

// A plain rejection reads the holder's record, but a process that read it
// less than Config.Recheck ago answers from the lock alone; after that it
// reads the record again, and a holder gone meanwhile frees the key.
func TestRecheckTrustsARecentReadOfTheHolderBriefly(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &lastRoles{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "00112233445566bb"
	now := time.Now()
	at := func(d time.Duration) *Acquire {
		a := directAcquire(s, q, fp, FoldReject, "")
		a.Now = now.Add(d)
		return a
	}
	// reads runs a and reports whether any of its calls passed the holder's
	// record (role H) rather than trusting the lock.
	reads := func(a *Acquire) (AcquireResult, bool) {
		hook.reset()
		res := mustAcquire(t, s, a)
		return res, strings.Contains(hook.all(), "H")
	}
	first := at(0)
	if res := mustAcquire(t, s, first); res.Status != StatusTaken || !res.Stored {
		t.Fatalf("first: %+v", res)
	}
	if u := rdb.HGet(ctx, TaskKey(q, first.Ref.ID), "unique_key").Val(); u != first.Ref.Lock {
		t.Fatalf("the task stored with its lock names %q as its unique key, want %q", u, first.Ref.Lock)
	}
	// The take taught this process the holder: its first rejection reads
	// the holder's record in the same call.
	if res, read := reads(at(time.Millisecond)); res.Status != StatusHeld || res.Task != first.Ref.ID || !read {
		t.Fatalf("first rejection: %+v, holder's record read %v; want held by %s, read", res, read, first.Ref.ID)
	}
	if res, read := reads(at(50 * time.Millisecond)); res.Status != StatusHeld || read {
		t.Fatalf("rejection within Recheck: %+v, holder's record read %v; want held, answered from the lock alone", res, read)
	}
	rdb.Del(ctx, TaskKey(q, first.Ref.ID)) // deleted by hand
	if res := mustAcquire(t, s, at(60*time.Millisecond)); res.Status != StatusHeld {
		t.Fatalf("within Recheck of the last read: %+v; want held (trusted)", res)
	}
	if res, read := reads(at(DefaultRecheck + 10*time.Millisecond)); res.Status != StatusTaken || !read {
		t.Fatalf("after Recheck, the holder gone: %+v (read %v); want taken at once", res, read)
	}
}

// lastRoles remembers ARGV[1] (the policy head and role letters) of the
// script calls since its last reset.
type lastRoles struct {
	mu    sync.Mutex
	roles []string
}

func (h *lastRoles) all() string { h.mu.Lock(); defer h.mu.Unlock(); return strings.Join(h.roles, " ") }
func (h *lastRoles) reset()      { h.mu.Lock(); defer h.mu.Unlock(); h.roles = nil }
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
		h.roles = append(h.roles, r)
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
