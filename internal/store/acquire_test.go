package store

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// acquire.lua: "A call that lacks a key it needs changes nothing". A call
// meeting an archived holder whose key a waiting set counts (MaxPending),
// made without the waiting set (a type with no bound sharing the key, or
// whose bound was lifted), must ask for it before writing anything; it must
// not first mark the archived task healed.
func TestAcquireNeedAfterAnArchivedHolderChangesNothing(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := held(t, rdb, s, q, "0000000000000401", FieldBounded, "t")
	putTask(rdb, q, r.ID, StateArchived)
	a := directAcquire(s, q, r.FP, FoldReject, "")
	keys, args := a.general(s, &hint{holder: r.ID}, false)
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	v, err := s.sc.acquire.Run(ctx, rdb, keys, args...).Result()
	rep, perr := parseReply(v)
	if err != nil || perr != nil || rep.status != statusNeed || !strings.Contains(rep.str(0), "W") {
		t.Fatalf("reply %v, %v; want need W", v, err)
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Errorf("the need reply changed %v (the archived holder was marked %s before the script asked for the waiting set)", d, LostHealed)
	}
	if res := mustAcquire(t, s, a); res.Status != StatusTaken {
		t.Fatalf("the whole call: %+v; want taken", res)
	}
}

// A RunningDefer key whose follow-up is gone (an operator deleted or
// archived it while its holder ran) and whose holder then failed for good
// keeps a mode record naming that follow-up. The key's next deferring
// enqueue must take the key, not go round take.lua ("a follow-up is owed:
// run acquire") and acquire.lua ("free: take it") until ErrMoving, for as
// long as the mode record lives.
func TestDeferringEnqueueTakesAKeyWhoseFollowUpIsGone(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	f := NewFollowID() // deleted: no record
	r := held(t, rdb, s, q, "0000000000000402", FieldRunning, "d", FieldFollow, f)
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndFail, Err: "boom"}); !res.Owned || res.Follow != "" {
		t.Fatalf("the holder's final failure: %+v", res)
	}
	putTask(rdb, q, r.ID, StateArchived)
	a := directAcquire(s, q, r.FP, FoldReplace, "new")
	a.Defers, a.FollowID, a.Mode = true, NewFollowID(), []any{FieldHolder, a.Ref.ID, FieldType, "t", FieldRunning, "d"}
	res, err := s.Acquire(ctx, a)
	if err != nil || res.Status != StatusTaken {
		t.Fatalf("the key's next enqueue: %+v, %v; want taken (mode record %v, lock there %d)", res, err,
			rdb.HGetAll(ctx, r.Mode()).Val(), rdb.Exists(ctx, r.Lock).Val())
	}
}

// Merge is a compare-and-set on the key's fold count: acquire returns the
// waiting holder's payload and version, a Merge with that version writes,
// and a Merge whose version another fold overtook writes nothing.
func TestMergeWritesOnlyOverTheVersionItRead(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	first := directAcquire(s, q, "0000000000000411", FoldMerge, "a")
	if res := mustAcquire(t, s, first); res.Status != StatusTaken {
		t.Fatalf("first: %+v", res)
	}
	read := func() AcquireResult {
		res := mustAcquire(t, s, directAcquire(s, q, first.Ref.FP, FoldMerge, "b"))
		if res.Status != StatusMerge || res.Task != first.Ref.ID {
			t.Fatalf("a merge: %+v; want the holder's payload to merge into", res)
		}
		return res
	}
	merge := func(res AcquireResult, payload string) MergeResult {
		m, err := s.Merge(ctx, &Merge{Ref: first.Ref, Target: res.Task, Follow: res.FollowUp, Version: res.Version, Payload: []byte(payload)})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	one, two := read(), read()
	if string(one.Payload) != "a" || one.Version != two.Version {
		t.Fatalf("reads %+v, %+v; want payload a, one version", one, two)
	}
	if m := merge(one, "ab"); !m.Written || m.State != StatePending {
		t.Fatalf("merge over the version read: %+v; want written", m)
	}
	if m := merge(two, "ab2"); m.Written {
		t.Fatalf("merge over an overtaken version: %+v; want nothing written", m)
	}
	if _, p, _, _, _ := s.StoredTask(ctx, q, first.Ref.ID); string(p) != "ab" {
		t.Fatalf("payload %q, want ab", p)
	}
	if again := read(); string(again.Payload) != "ab" || again.Version == one.Version {
		t.Fatalf("a read after the merge: %+v; want payload ab under a new version", again)
	}
}

// A shared key's holder is archived while it owes a follow-up that waits
// (parked). An enqueue of another type sharing the key, whose own rule does
// not defer (here Reject), meets the follow-up, not a free key: the
// follow-up takes the key and is queued, and the call is a duplicate of it.
// (It dropped the follow-up from the mode record, healed the key and took
// it: two live tasks, option-space seed 915241551.)
func TestNonDeferringEnqueueMeetsTheFollowUpAnArchivedHolderOwes(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	f := NewFollowID()
	putTask(rdb, q, f, StateScheduled)
	rdb.ZAdd(ctx, ScheduledKey(q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: f})
	r := held(t, rdb, s, q, "0000000000000403", FieldRunning, "d", FieldFollow, f)
	putTask(rdb, q, r.ID, StateArchived)
	a := directAcquire(s, q, r.FP, FoldReject, "other")
	res, err := s.Acquire(ctx, a)
	if err != nil || res.Status != StatusHeld || res.Task != f {
		t.Fatalf("an enqueue that does not defer: %+v, %v; want a duplicate of the follow-up %s (lock %q, mode record %v)", res, err, f,
			rdb.Get(ctx, r.Lock).Val(), rdb.HGetAll(ctx, r.Mode()).Val())
	}
	if v, st := rdb.Get(ctx, r.Lock).Val(), rdb.HGet(ctx, TaskKey(q, f), "state").Val(); v != f || st != StatePending {
		t.Fatalf("lock %q, follow-up %s; want the follow-up's, queued", v, st)
	}
}
