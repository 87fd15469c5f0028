package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// start.lua: a task that asynq runs again and that finds its key cooling
// under its own ID (it succeeded, and settle cooled the key, but the worker
// died before asynq's done script ran, so asynq's recoverer made it a
// retry) must be told the key cools (the middleware then does not run it
// again: "It succeeded already … the task is not run again"), not that it
// holds the key.
func TestStartOfATaskWhoseOwnKeyCoolsSaysCooling(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := held(t, rdb, s, q, "0000000000000403", FieldCoolEnd, msAt(10*time.Minute))
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndSuccess, TTL: time.Hour}); !res.Cooling {
		t.Fatalf("settle: %+v; want cooling", res)
	}
	putTask(rdb, q, r.ID, StateActive) // the recovered retry runs
	res, err := s.Start(ctx, &Start{Ref: r, TTL: time.Hour})
	if err != nil || res.Status != StatusCooling || res.Holder != r.ID || !near(res.Cooling, 10*time.Minute, 2*time.Second) {
		t.Errorf("start: %+v, %v; want cooling for 10m, held by its own %s", res, err, r.ID)
	}
	if v, pttl := rdb.Get(ctx, r.Lock).Val(), rdb.PTTL(ctx, r.Lock).Val(); v != "~c:"+r.ID || !near(pttl, 10*time.Minute, 2*time.Second) {
		t.Errorf("after start the lock is %q for %v; want the cooling hold kept, 10m", v, pttl)
	}
}

// An attempt that must check its key (start.lua) takes a free key with the
// mode record of its rule, meets a key another live task holds (saying
// whether it runs), drops its key under RunningAllow, and is told when its
// task has no record in this Redis.
func TestStartMeetsItsKey(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	start := func(st *Start) StartResult {
		t.Helper()
		res, err := s.Start(ctx, st)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	free := s.ref(q, "0000000000000501", NewPlainID())
	putTask(rdb, q, free.ID, StateActive)
	res := start(&Start{Ref: free, TTL: time.Minute, Mode: []any{FieldHolder, free.ID, FieldType, "t", FieldCoolEnd, msAt(time.Hour)}})
	// (Its record names no lock, so the lock is the '~a' form its end releases.)
	if res.Status != StatusTaken || !res.New || rdb.Get(ctx, free.Lock).Val() != "~a:"+free.ID || rdb.HGet(ctx, free.Mode(), FieldHolder).Val() != free.ID {
		t.Fatalf("a free key: %+v, lock %q; want taken now as ~a:%s, with its mode record", res, rdb.Get(ctx, free.Lock).Val(), free.ID)
	}
	other := held(t, rdb, s, q, "0000000000000502")
	late := s.ref(q, other.FP, NewPlainID())
	putTask(rdb, q, late.ID, StateActive)
	if res := start(&Start{Ref: late, TTL: time.Minute}); res.Status != StatusHeld || res.Holder != other.ID || !res.HolderRuns {
		t.Fatalf("a key a running task holds: %+v; want held by %s, running", res, other.ID)
	}
	allow := held(t, rdb, s, q, "0000000000000503")
	if res := start(&Start{Ref: allow, TTL: time.Minute, Allow: true}); res.Status != StatusAllowed || res.New || rdb.Exists(ctx, allow.Lock).Val() != 0 {
		t.Fatalf("RunningAllow: %+v; want allowed, its lock dropped", res)
	}
	elsewhere := s.ref(q, "0000000000000504", NewPlainID())
	if res := start(&Start{Ref: elsewhere, TTL: time.Minute}); res.Status != StatusElsewhere || rdb.Exists(ctx, elsewhere.Lock).Val() != 0 {
		t.Fatalf("a task with no record here: %+v; want elsewhere, nothing taken", res)
	}
}

// The heartbeat (extend.lua) makes a running task's key live at least TTL
// more, never less, and reports a key that is no longer the task's.
func TestExtendKeepsARunningTasksKeyAndReportsALostOne(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	short := held(t, rdb, s, q, "0000000000000511", FieldRunning, "d")
	long, lost := held(t, rdb, s, q, "0000000000000512"), held(t, rdb, s, q, "0000000000000513")
	rdb.PExpire(ctx, short.Lock, time.Second)
	rdb.PExpire(ctx, short.Mode(), time.Second)
	rdb.Set(ctx, lost.Lock, Value(NewPlainID()), time.Hour)
	ttl := 10 * time.Minute
	out := s.ExtendAll(ctx, []*Extend{{Ref: short, TTL: ttl}, {Ref: long, TTL: ttl}, {Ref: lost, TTL: ttl}})
	for i, want := range []bool{true, true, false} {
		if out[i].Err != nil || out[i].Owned != want {
			t.Fatalf("extend %d: %+v; want owned %v", i, out[i], want)
		}
	}
	for key, want := range map[string]time.Duration{short.Lock: 10 * time.Minute, short.Mode(): 10 * time.Minute, long.Lock: time.Hour} {
		if pttl := rdb.PTTL(ctx, key).Val(); !near(pttl, want, 2*time.Second) {
			t.Fatalf("%s lives %v more, want %v", key, pttl, want)
		}
	}
}

// An arrival of a MaxPending type that takes a free key as it starts (its
// rule's mode record written then) leaves the key waiting no more: its
// entry leaves the waiting set and the mode record keeps no 'b' (which
// Lookup and `dedupctl show` read as "counted in a waiting set"), the same
// whether a mode record of a gone holder lay beside the free key (start's
// general path) or none did (its fast path).
func TestStartOfAMaxPendingArrivalOnAFreeKeyLeavesItWaitingNoMore(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	for name, stale := range map[string]bool{"no mode record": false, "a gone holder's mode record": true} {
		t.Run(name, func(t *testing.T) {
			fp := "0000000000000601"
			if stale {
				fp = "0000000000000602"
			}
			r := s.ref(q, fp, NewPlainID())
			putTask(rdb, q, r.ID, StateActive)
			rdb.ZAdd(ctx, WaitOf(r.Lock, r.Type), redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: fp})
			if stale {
				rdb.HSet(ctx, r.Mode(), FieldHolder, NewPlainID(), FieldType, "t")
			}
			res, err := s.Start(ctx, &Start{Ref: r, TTL: time.Minute, Mode: []any{FieldHolder, r.ID, FieldType, "t", FieldBounded, "t"}})
			if err != nil || res.Status != StatusTaken || !res.New {
				t.Fatalf("start: %+v, %v; want the free key taken", res, err)
			}
			if rdb.ZScore(ctx, WaitOf(r.Lock, r.Type), fp).Err() != redis.Nil {
				t.Errorf("the key's entry is still in the waiting set")
			}
			if m := rdb.HGetAll(ctx, r.Mode()).Val(); m[FieldHolder] != r.ID || m[FieldBounded] != "" {
				t.Errorf("mode record %v; want its holder %s, and no %q (the key waits no more)", m, r.ID, FieldBounded)
			}
		})
	}
}
