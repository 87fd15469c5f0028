package store

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The direct path takes a free key and stores its task in one call, as
// asynq's client stores one: the task's record and message name the lock as
// their unique key (so that asynq's own scripts delete it with the task),
// it waits where its due time says, and the lock lives TTL.
func TestTakeStoresTheTaskWithItsLockInOneStep(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &scriptCalls{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	if err := s.LoadScripts(ctx); err != nil { // (the count below is of calls, not of NOSCRIPT retries)
		t.Fatal(err)
	}
	q := redistest.Uniq(t)
	for i, due := range []time.Time{{}, time.Now().Add(time.Hour)} {
		a := directAcquire(s, q, "00000000000000a"+strconv.Itoa(i), FoldReject, `{"n":1}`)
		if !due.IsZero() {
			a.DueAt = due.Unix()
		}
		n := hook.n.Load()
		if res := mustAcquire(t, s, a); res.Status != StatusTaken || !res.Stored || hook.n.Load()-n != 1 {
			t.Fatalf("due %v: %+v in %d calls; want taken and stored in one", due, res, hook.n.Load()-n)
		}
		id := a.Ref.ID
		if v, pttl := rdb.Get(ctx, a.Ref.Lock).Val(), rdb.PTTL(ctx, a.Ref.Lock).Val(); v != id || !near(pttl, time.Hour, 5*time.Second) {
			t.Fatalf("due %v: lock %q for %v, want %q for an hour", due, v, pttl, id)
		}
		rec := rdb.HGetAll(ctx, TaskKey(q, id)).Val()
		if rec["msg"] != string(a.Message.Encode()) || rec["unique_key"] != a.Ref.Lock {
			t.Fatalf("due %v: record %v; want the message, and the lock as its unique key", due, rec)
		}
		if due.IsZero() {
			since, _ := strconv.ParseInt(rec["pending_since"], 10, 64)
			if rec["state"] != StatePending || rdb.LPos(ctx, PendingKey(q), id, redis.LPosArgs{}).Err() != nil ||
				!near(time.Duration(since-a.Now.UnixNano()), 0, time.Second) {
				t.Fatalf("record %v: want pending since now, in the pending list", rec)
			}
		} else if rec["state"] != StateScheduled || rdb.ZScore(ctx, ScheduledKey(q), id).Val() != float64(due.Unix()) {
			t.Fatalf("record %v: want scheduled, due %d", rec, due.Unix())
		}
	}
}

// A Scheduler firing's key is held by its value ('~x:'), which asynq's
// scripts never compare equal to the task: its task's record names no
// unique key, and the key stays held until the window ends.
func TestTakeForAFiringNamesNoUniqueKey(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	a := directAcquire(s, q, "00000000000000b1", FoldReject, "")
	a.Value, a.Unique, a.Message.UniqueKey, a.TTL = FiringValue(a.Ref.ID), false, "", 10*time.Minute
	if res := mustAcquire(t, s, a); res.Status != StatusTaken || !res.Stored {
		t.Fatalf("firing: %+v", res)
	}
	if v := rdb.Get(ctx, a.Ref.Lock).Val(); v != "~x:"+a.Ref.ID {
		t.Fatalf("lock %q, want ~x:%s", v, a.Ref.ID)
	}
	if n := rdb.HExists(ctx, TaskKey(q, a.Ref.ID), "unique_key").Val(); n {
		t.Fatal("a firing's task names its lock as its unique key")
	}
	if h := MessageHeaders([]byte(rdb.HGet(ctx, TaskKey(q, a.Ref.ID), "msg").Val())); h != nil {
		t.Fatalf("headers %v", h)
	}
	// Its own task's state does not free it: held, whatever it does.
	putTask(rdb, q, a.Ref.ID, StateCompleted)
	if res := mustAcquire(t, s, directAcquire(s, q, "00000000000000b1", FoldReplace, "x")); res.Status != StatusHeld || res.Task != a.Ref.ID {
		t.Fatalf("a call meeting a firing's key: %+v; want held by %s", res, a.Ref.ID)
	}
}

// A direct call that expects the key held leaves its task out ("-"): a
// free key is then answered statusFree with nothing written, and the call
// is made again with the task, which takes the key.
func TestTakeWithoutTheTaskAnswersFreeAndWritesNothing(t *testing.T) {
	rdb := redistest.Client(t)
	hook := &scriptCalls{}
	rdb.AddHook(hook)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	if err := s.LoadScripts(ctx); err != nil {
		t.Fatal(err)
	}
	q := redistest.Uniq(t)
	a := directAcquire(s, q, "00000000000000c1", FoldReject, "p")
	a.MaxPending, a.Mode = 1, []any{FieldHolder, a.Ref.ID, FieldType, "t", FieldBounded, "t"}
	keys, args := a.take(s, &hint{holder: NewPlainID()}, false)
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	v, err := s.sc.take.Run(ctx, rdb, keys, args...).Result()
	if rep, perr := parseReply(v); err != nil || perr != nil || rep.status != statusFree {
		t.Fatalf("take without the task, key free: %v, %v; want statusFree", v, err)
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Fatalf("statusFree changed %v", d)
	}
	s.hints.put(a.Ref.Lock, hint{holder: NewPlainID()}) // a key last seen held
	n := hook.n.Load()
	if res := mustAcquire(t, s, a); res.Status != StatusTaken || !res.Stored || hook.n.Load()-n != 2 {
		t.Fatalf("%+v in %d calls; want taken and stored in 2", res, hook.n.Load()-n)
	}
	if rdb.HGet(ctx, TaskKey(q, a.Ref.ID), "unique_key").Val() != a.Ref.Lock || rdb.HGet(ctx, ModeOf(a.Ref.Lock), FieldHolder).Val() != a.Ref.ID {
		t.Fatal("the second call did not store the task and its mode record")
	}
}
