package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// A release whose value no longer matches the lock does nothing: a refused
// enqueue's Unlock of a value the key no longer has (taken again since,
// even by a task of the same ID), an operator's release of a holder that no
// longer holds it. The exact value is released, with its waiting-set entry.
func TestReleaseOfAValueThatNoLongerMatchesDoesNothing(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	fp := "0000000000000201"
	r := s.ref(q, fp, NewPlainID())
	then, now := WrapValue(r.ID, time.Now().Add(-time.Minute)), WrapValue(r.ID, time.Now())
	rdb.Set(ctx, r.Lock, now, time.Hour)
	rdb.HSet(ctx, r.Mode(), FieldHolder, r.ID, FieldBounded, "t")
	rdb.ZAdd(ctx, s.keys.Wait(q, "t"), redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: fp})
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	if ok, err := s.Unlock(ctx, &r, then, true); err != nil || ok {
		t.Fatalf("unlock of a value the key no longer has: %v, %v", ok, err)
	}
	gone := NewPlainID()
	res, err := ReleaseKey(ctx, rdb, &Release{Lock: r.Lock, Queue: q, Type: "t", How: ReleaseHolder, Holder: gone, Grace: time.Minute})
	if err != nil || res.Released || res.Holder != r.ID {
		t.Fatalf("release of a holder that no longer holds the key: %+v, %v; want kept, held by %s", res, err, r.ID)
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Fatalf("changed %v", d)
	}
	if ok, err := s.Unlock(ctx, &r, now, true); err != nil || !ok {
		t.Fatalf("unlock of its own value: %v, %v", ok, err)
	}
	if rdb.Exists(ctx, r.Lock).Val() != 0 || rdb.ZScore(ctx, s.keys.Wait(q, "t"), fp).Err() == nil {
		t.Fatal("unlocked, but the lock or its waiting-set entry stayed")
	}
}

// doctor's release ("stuck") keeps a key its holder can still run or a
// policy keeps; it releases one whose holder cannot run, and a follow-up
// the key owes is queued then.
func TestReleaseStuckKeepsWhatCanRun(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	stuck := func(r Ref) ReleaseResult {
		t.Helper()
		res, err := ReleaseKey(ctx, rdb, &Release{Lock: r.Lock, Queue: q, Type: "t", How: ReleaseStuck, Holder: r.ID, Grace: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	running := held(t, rdb, s, q, "0000000000000211")
	if res := stuck(running); res.Released || res.Kept != StateActive {
		t.Fatalf("a running holder: %+v; want kept (active)", res)
	}
	failed := held(t, rdb, s, q, "0000000000000212", FieldError, "boom")
	putTask(rdb, q, failed.ID, StateArchived)
	if res := stuck(failed); res.Released || res.Kept != "failed" {
		t.Fatalf("a fail hold: %+v; want kept (failed)", res)
	}
	f := NewFollowID()
	putTask(rdb, q, f, StateScheduled)
	lost := held(t, rdb, s, q, "0000000000000213", FieldRunning, "d", FieldFollow, f)
	rdb.LRem(ctx, ActiveKey(q), 0, lost.ID) // active, but not in the active list: asynq never runs it again
	if res := stuck(lost); !res.Released || res.Queued != f {
		t.Fatalf("a holder asynq lost: %+v; want released, %s queued", res, f)
	}
	// The holder cannot run: its follow-up takes the key, queued now.
	if st, v := rdb.HGet(ctx, TaskKey(q, f), "state").Val(), rdb.Get(ctx, lost.Lock).Val(); st != StatePending || v != f {
		t.Fatalf("follow-up %q, lock %q; want pending, held by the follow-up %s", st, v, f)
	}
}

// A refused enqueue of a key no waiting set counts gives its lock back
// naming the lock alone: one key, so that the call runs on whichever side
// of a slot migration the lock is.
func TestUnlockOfAnUncountedKeyNamesTheLockAlone(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &lastRoles{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	r := s.ref(redistest.Uniq(t), "0000000000000202", NewPlainID())
	v := WrapValue(r.ID, time.Now())
	rdb.Set(ctx, r.Lock, v, time.Hour)
	if ok, err := s.Unlock(ctx, &r, v, false); err != nil || !ok {
		t.Fatalf("unlock: %v, %v", ok, err)
	}
	if roles := hook.all(); roles != "L" {
		t.Fatalf("unlock declared the roles %q, want the lock alone (L)", roles)
	}
	if rdb.Exists(ctx, r.Lock).Val() != 0 {
		t.Fatal("the lock stayed")
	}
}
