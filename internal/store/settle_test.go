package store

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// held writes a key of queue q held for an hour by its running task (whose
// record names the lock as its unique key), with a mode record about it of
// the fields given (none: no record); it returns the task's Ref.
func held(t *testing.T, rdb redis.Cmdable, s *Store, q, fp string, mode ...any) Ref {
	t.Helper()
	ctx := context.Background()
	r := s.ref(q, fp, NewPlainID())
	putTask(rdb, q, r.ID, StateActive)
	rdb.HSet(ctx, TaskKey(q, r.ID), "unique_key", r.Lock)
	if err := rdb.Set(ctx, r.Lock, Value(r.ID), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if mode != nil {
		rdb.HSet(ctx, r.Mode(), append([]any{FieldHolder, r.ID, FieldType, "t"}, mode...)...)
		rdb.PExpire(ctx, r.Mode(), time.Hour)
	}
	return r
}

func mustSettle(t *testing.T, s *Store, st *Settle) SettleResult {
	t.Helper()
	res, err := s.Settle(context.Background(), st)
	if err != nil {
		t.Fatalf("settle %s: %v", st.End, err)
	}
	return res
}

func msAt(d time.Duration) string { return strconv.FormatInt(time.Now().Add(d).UnixMilli(), 10) }

// A success before the cooldown's end cools the key: its value becomes
// '~c:<id>' (which asynq's compare-and-delete leaves alone), and it lives
// exactly until the cooldown ends, as does its mode record; a duplicate
// meets it cooling.
func TestSettleCoolingHoldsTheKeyUntilTheCooldownEnds(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := held(t, rdb, s, q, "00000000000000d1", FieldCoolEnd, msAt(10*time.Minute))
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndSuccess, TTL: time.Hour}); !res.Owned || !res.Cooling {
		t.Fatalf("%+v; want cooling", res)
	}
	if v := rdb.Get(ctx, r.Lock).Val(); v != "~c:"+r.ID {
		t.Fatalf("lock %q, want ~c:%s", v, r.ID)
	}
	for _, key := range []string{r.Lock, r.Mode()} {
		if pttl := rdb.PTTL(ctx, key).Val(); !near(pttl, 10*time.Minute, 2*time.Second) {
			t.Fatalf("%s lives %v more, want the cooldown's 10m", key, pttl)
		}
	}
	rdb.Del(ctx, TaskKey(q, r.ID)) // asynq's done script: the task goes, the lock (not its value) stays
	res := mustAcquire(t, s, directAcquire(s, q, r.FP, FoldReplace, "x"))
	if res.Status != StatusCooling || res.Task != r.ID || res.Failed || !near(res.Cooling, 10*time.Minute, 2*time.Second) {
		t.Fatalf("a duplicate: %+v; want cooling for 10m, held by %s", res, r.ID)
	}
}

// A final failure under a fail hold keeps the lock's value, records the
// error in the mode record, takes the lock out of the task's record (so
// that asynq's DeleteTask leaves it) and holds the key for the hold (no
// expiry for one until released), but no longer than a period key's window.
func TestSettleFinalFailureHoldsTheKey(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	for i, c := range []struct {
		hold   string
		window time.Duration // a period's window ends this far ahead (0: no period)
		want   time.Duration // -1: no expiry
	}{
		{"300000", 0, 5 * time.Minute},
		{"-1", 0, -1},
		{"-1", 3 * time.Minute, 3 * time.Minute},
		{"600000", 3 * time.Minute, 3 * time.Minute},
		{"60000", 10 * time.Minute, time.Minute},
	} {
		mode := []any{FieldFailHold, c.hold}
		if c.window != 0 {
			mode = append(mode, FieldWindow, msAt(-time.Hour)+":"+msAt(c.window))
		}
		r := held(t, rdb, s, q, "00000000000000e"+strconv.Itoa(i), mode...)
		if res := mustSettle(t, s, &Settle{Ref: r, End: EndFail, Err: "boom"}); !res.Owned || !res.Failed {
			t.Fatalf("case %d: %+v; want failed", i, res)
		}
		if v := rdb.Get(ctx, r.Lock).Val(); v != r.ID {
			t.Fatalf("case %d: lock %q, want its value kept, %q", i, v, r.ID)
		}
		if e := rdb.HGet(ctx, r.Mode(), FieldError).Val(); e != "boom" {
			t.Fatalf("case %d: mode record's error %q", i, e)
		}
		if rdb.HExists(ctx, TaskKey(q, r.ID), "unique_key").Val() {
			t.Fatalf("case %d: the failed task's record still names the lock", i)
		}
		for _, key := range []string{r.Lock, r.Mode()} {
			pttl := rdb.PTTL(ctx, key).Val()
			if (c.want < 0 && pttl != -1) || (c.want > 0 && !near(pttl, c.want, 2*time.Second)) {
				t.Fatalf("case %d: %s lives %v more, want %v", i, key, pttl, c.want)
			}
		}
		putTask(rdb, q, r.ID, StateArchived)
		res := mustAcquire(t, s, directAcquire(s, q, r.FP, FoldReject, ""))
		if res.Status != StatusCooling || !res.Failed || res.Task != r.ID {
			t.Fatalf("case %d: a duplicate: %+v; want held by the failed %s", i, res, r.ID)
		}
	}
}

// A failure with retries left holds the key for the retry: the lock (and
// its mode record) lives at least the retry's delay plus TTL, never less
// than it had; a follow-up the key owes stays parked until the retry is due.
func TestSettleRetryLengthensTheLock(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	f := NewFollowID()
	putTask(rdb, q, f, StateScheduled)
	r := held(t, rdb, s, q, "00000000000000f1", FieldRunning, "d", FieldFollow, f)
	rdb.PExpire(ctx, r.Lock, time.Second)
	rdb.PExpire(ctx, r.Mode(), time.Second)
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndRetry, TTL: time.Hour, Due: 30 * time.Second}); !res.Owned || !res.Held {
		t.Fatalf("%+v; want held", res)
	}
	for _, key := range []string{r.Lock, r.Mode()} {
		if pttl := rdb.PTTL(ctx, key).Val(); !near(pttl, time.Hour, 2*time.Second) {
			t.Fatalf("%s lives %v more, want an hour", key, pttl)
		}
	}
	if due := rdb.ZScore(ctx, ScheduledKey(q), f).Val(); !near(time.Duration(due)*time.Second, time.Duration(time.Now().Unix()+31)*time.Second, 2*time.Second) {
		t.Fatalf("follow-up due at %v, want when the retry is due, a second after", due)
	}
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndRetry, TTL: time.Minute, Due: time.Second}); !res.Held {
		t.Fatalf("second retry: %+v", res)
	}
	if pttl := rdb.PTTL(ctx, r.Lock).Val(); !near(pttl, time.Hour, 2*time.Second) {
		t.Fatalf("a shorter retry shortened the lock to %v", pttl)
	}
	if v := rdb.Get(ctx, r.Lock).Val(); v != r.ID {
		t.Fatalf("lock %q, want %q", v, r.ID)
	}
}

// Any end of a RunningDefer holder's run hands its key to the follow-up it
// owes, if that waits: the lock names the follow-up for the TTL given, the
// follow-up is queued now (from the scheduled or retry set), and the mode
// record is about it, with no follow-up owed and no folds.
func TestSettleHandsTheKeyToAWaitingFollowUp(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	for i, c := range []struct{ end, fstate string }{
		{EndSuccess, StateScheduled}, {EndFail, StateScheduled}, {EndRevoke, StateRetry}, {EndSuccess, StatePending},
	} {
		f := NewFollowID()
		putTask(rdb, q, f, c.fstate)
		r := held(t, rdb, s, q, "000000000000010"+strconv.Itoa(i), FieldRunning, "d", FieldFollow, f, FieldFolds, 2, FieldFailHold, "-1")
		res := mustSettle(t, s, &Settle{Ref: r, End: c.end, TTL: 30 * time.Minute, Err: "boom"})
		if !res.Owned || res.Follow != f || res.Failed || res.Cooling {
			t.Fatalf("%s, follow-up %s: %+v; want handed to %s", c.end, c.fstate, res, f)
		}
		if v, pttl := rdb.Get(ctx, r.Lock).Val(), rdb.PTTL(ctx, r.Lock).Val(); v != f || !near(pttl, 30*time.Minute, 2*time.Second) {
			t.Fatalf("%s: lock %q for %v, want %q for 30m", c.end, v, pttl, f)
		}
		rec := rdb.HGetAll(ctx, TaskKey(q, f)).Val()
		if rec["state"] != StatePending || rec["pending_since"] == "" || rdb.LPos(ctx, PendingKey(q), f, redis.LPosArgs{}).Err() != nil {
			t.Fatalf("%s: follow-up in state %q since %q; want pending, in the pending list", c.end, rec["state"], rec["pending_since"])
		}
		if rdb.ZScore(ctx, ScheduledKey(q), f).Err() == nil || rdb.ZScore(ctx, RetryKey(q), f).Err() == nil {
			t.Fatalf("%s: the follow-up is still in a waiting set", c.end)
		}
		m := rdb.HGetAll(ctx, r.Mode()).Val()
		if m[FieldHolder] != f || m[FieldFolds] != "0" || m[FieldFollow] != "" || m[FieldError] != "" {
			t.Fatalf("%s: mode record %v; want about %s, no folds, nothing owed", c.end, m, f)
		}
	}
}

// An attempt whose key is no longer its task's (released, taken over)
// settles nothing.
func TestSettleOfAKeyNoLongerTheTasksChangesNothing(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := held(t, rdb, s, q, "0000000000000111", FieldCoolEnd, msAt(time.Hour), FieldFailHold, "-1")
	other := NewPlainID()
	rdb.Set(ctx, r.Lock, Value(other), time.Hour)
	rdb.HSet(ctx, r.Mode(), FieldHolder, other)
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	for _, end := range []string{EndSuccess, EndFail, EndRetry, EndRevoke} {
		if res := mustSettle(t, s, &Settle{Ref: r, End: end, TTL: time.Minute, Release: true}); res.Owned {
			t.Fatalf("%s: %+v; want not owned", end, res)
		}
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Fatalf("changed %v", d)
	}
}

// A success settled after asynq's done deleted the lock (the middleware's
// end made no call, and the follow-up was made before asynq's done; the
// owed signal settles it then) still hands the key to the follow-up its
// mode record says the holder owes, whether asynq kept the holder's record
// (completed) or deleted it; a key another task took meanwhile is left to
// it, the follow-up owed still.
func TestSettleAfterAsynqsDoneDeletedTheLockHandsTheKeyToTheOwedFollowUp(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	for i, c := range []struct{ holder, other string }{{"completed", ""}, {"deleted", ""}, {"completed", "taken"}} {
		f := NewFollowID()
		putTask(rdb, q, f, StateScheduled)
		rdb.ZAdd(ctx, ScheduledKey(q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: f})
		r := held(t, rdb, s, q, "000000000000020"+strconv.Itoa(i), FieldRunning, "d", FieldFollow, f)
		rdb.Del(ctx, r.Lock) // asynq's done
		if c.holder == "completed" {
			rdb.HSet(ctx, TaskKey(q, r.ID), "state", StateCompleted)
		} else {
			rdb.Del(ctx, TaskKey(q, r.ID))
		}
		other := NewPlainID()
		if c.other != "" {
			rdb.Set(ctx, r.Lock, Value(other), time.Hour)
		}
		res := mustSettle(t, s, &Settle{Ref: r, End: EndSuccess, TTL: 30 * time.Minute})
		if c.other != "" {
			if res.Owned || rdb.Get(ctx, r.Lock).Val() != Value(other) || rdb.HGet(ctx, TaskKey(q, f), "state").Val() != StateScheduled {
				t.Fatalf("holder %s, key taken by %s: %+v, lock %q; want left to it, the follow-up parked", c.holder, other, res, rdb.Get(ctx, r.Lock).Val())
			}
			continue
		}
		if !res.Owned || res.Follow != f {
			t.Fatalf("holder %s: %+v; want handed to %s", c.holder, res, f)
		}
		if v, pttl := rdb.Get(ctx, r.Lock).Val(), rdb.PTTL(ctx, r.Lock).Val(); v != f || !near(pttl, 30*time.Minute, 2*time.Second) {
			t.Fatalf("holder %s: lock %q for %v, want %q for 30m", c.holder, v, pttl, f)
		}
		if st := rdb.HGet(ctx, TaskKey(q, f), "state").Val(); st != StatePending || rdb.ZScore(ctx, ScheduledKey(q), f).Err() == nil {
			t.Fatalf("holder %s: follow-up %s, want pending", c.holder, st)
		}
	}
}

// A late settle of a success that made no call (the owed signal) waits while
// the lock still names the task: asynq's done has not run yet, or the task
// runs again (a retry, a new task under a reused caller-chosen ID), and that
// attempt holds the key and settles its own end. Nothing changes until the
// lock is released.
func TestLateSettleWaitsWhileTheLockStillNamesTheTask(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	f := NewFollowID()
	putTask(rdb, q, f, StateScheduled)
	rdb.ZAdd(ctx, ScheduledKey(q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: f})
	r := held(t, rdb, s, q, "0000000000000300", FieldRunning, "d", FieldFollow, f)
	res := mustSettle(t, s, &Settle{Ref: r, End: EndSuccess, TTL: 30 * time.Minute, Late: true})
	if !res.Waits || res.Owned || rdb.Get(ctx, r.Lock).Val() != Value(r.ID) || rdb.HGet(ctx, TaskKey(q, f), "state").Val() != StateScheduled ||
		rdb.HGet(ctx, r.Mode(), FieldFollow).Val() != f {
		t.Fatalf("late settle of the lock's own task: %+v, lock %q; want it waiting, nothing changed", res, rdb.Get(ctx, r.Lock).Val())
	}
	rdb.Del(ctx, r.Lock) // asynq's done
	rdb.HSet(ctx, TaskKey(q, r.ID), "state", StateCompleted)
	if res := mustSettle(t, s, &Settle{Ref: r, End: EndSuccess, TTL: 30 * time.Minute, Late: true}); res.Waits || res.Follow != f {
		t.Fatalf("late settle once asynq's done released the lock: %+v; want handed to %s", res, f)
	}
}

// A settle sent with the value an attempt took its lock as (Settle.Value:
// a success released together whose lock had a mode record beside it)
// acts only while the lock holds exactly that value: once a later attempt
// of the task, or a later task under the same caller-chosen ID, took the
// key (its own token), the settle changes nothing, and its record (which
// may be that later task's, not yet run) is not marked ended. With the
// value still there, it releases the lock, and marks no record either.
func TestSettleWithItsAttemptsValueActsOnlyOnThatValueAndMarksNoRecord(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := s.ref(q, "0000000000000701", "job-1")
	putTask(rdb, q, r.ID, StatePending) // (the ID's next task, not yet run)
	rdb.Set(ctx, r.Lock, StartValue(r.ID, "t2"), time.Hour)
	rdb.HSet(ctx, r.Mode(), FieldHolder, "gone-holder")
	msg := rdb.HGet(ctx, TaskKey(q, r.ID), "msg").Val()
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()
	res, err := s.Settle(ctx, &Settle{Ref: r, End: EndSuccess, TTL: time.Minute, Release: true, Value: StartValue(r.ID, "t1")})
	if err != nil || res.Owned {
		t.Fatalf("settle of an earlier attempt's value: %+v, %v; want not the task's", res, err)
	}
	if d := diff(before, w.snapshot()); len(d) > 0 {
		t.Fatalf("changed %v", d)
	}
	res, err = s.Settle(ctx, &Settle{Ref: r, End: EndSuccess, TTL: time.Minute, Release: true, Value: StartValue(r.ID, "t2")})
	if err != nil || !res.Released || rdb.Exists(ctx, r.Lock).Val() != 0 {
		t.Fatalf("settle of the lock's own value: %+v, %v; want it released", res, err)
	}
	if got := rdb.HGet(ctx, TaskKey(q, r.ID), "msg").Val(); got != msg {
		t.Fatal("the settle of a success released together marked the task's record")
	}
}
