package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// keptHeld writes a key of queue q kept by its task (HoldKept) until until,
// the task in asynq state (as asynq stores it: its record names the lock),
// and returns the task's Ref.
func keptHeld(t *testing.T, rdb redis.Cmdable, s *Store, q, fp, state string, until time.Time) Ref {
	t.Helper()
	ctx := context.Background()
	r := s.ref(q, fp, NewPlainID())
	putTask(rdb, q, r.ID, state)
	if state != "" {
		rdb.HSet(ctx, TaskKey(q, r.ID), "unique_key", r.Lock)
	}
	if err := rdb.Set(ctx, r.Lock, KeptValue(r.ID, until), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	return r
}

// A key kept by its task (NewClient's cooldown or period) is held while
// the task lives, cools once asynq's record says it completed, exactly
// until its moment (FreeIn), and heals when the task is gone or archived,
// or completed with its moment passed: for an enqueue, a task that starts,
// an operator's reads and the doctor alike.
func TestKeptKeyCoolsOnceAsynqRecordsItsTaskCompletedUntilItsMoment(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	in10m := time.Now().Add(10 * time.Minute)
	cases := []struct {
		name, state string
		until       time.Time
		cooling     bool // else: held (a live holder) or free (heals)
		free        bool
	}{
		{"pending", StatePending, in10m, false, false},
		{"active", StateActive, in10m, false, false},
		{"completed", StateCompleted, in10m, true, false},
		{"completed, its moment passed", StateCompleted, time.Now().Add(-time.Second), false, true},
		{"archived", StateArchived, in10m, false, true},
		{"gone", "", in10m, false, true},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fp := "00000000000000" + string(rune('a'+i)) + "0"
			r := keptHeld(t, rdb, s, q, fp, c.state, c.until)
			ls, err := ReadLocks(ctx, rdb, s.Keys(), []string{r.Lock})
			if err != nil || len(ls) != 1 {
				t.Fatalf("ReadLocks: %v %v", ls, err)
			}
			l := ls[0]
			found, _, err := Diagnose(ctx, rdb, ls, time.Minute, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			rel, err := ReleaseKey(ctx, rdb, &Release{Lock: r.Lock, Queue: q, How: ReleaseStuck, Holder: r.ID, Grace: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			st, err := s.Start(ctx, &Start{Ref: s.ref(q, fp, "arrival-"+fp), TTL: time.Hour})
			switch {
			case c.cooling:
				if l.State() != LockCooling || !near(l.TTL, 10*time.Minute, 2*time.Second) || len(found) != 0 || rel.Released {
					t.Fatalf("state %s ttl %v, doctor %v, stuck release %+v; want cooling for 10m, kept", l.State(), l.TTL, found, rel)
				}
				putTask(rdb, q, "arrival-"+fp, StatePending)
				st, err = s.Start(ctx, &Start{Ref: s.ref(q, fp, "arrival-"+fp), TTL: time.Hour})
				if err != nil || st.Status != StatusCooling || st.Holder != r.ID || !near(st.Cooling, 10*time.Minute, 2*time.Second) {
					t.Fatalf("a task starting: %+v %v; want cooling for 10m", st, err)
				}
				res := mustAcquire(t, s, directAcquire(s, q, fp, FoldReplace, "x"))
				if res.Status != StatusCooling || res.Task != r.ID || res.Failed || !near(res.Cooling, 10*time.Minute, 2*time.Second) {
					t.Fatalf("an enqueue: %+v; want cooling for 10m, held by %s", res, r.ID)
				}
			case c.free:
				if l.State() != LockOrphaned || len(found) != 1 || !rel.Released {
					t.Fatalf("state %s, doctor %v, stuck release %+v; want orphaned, found and released", l.State(), found, rel)
				}
				if res := mustAcquire(t, s, directAcquire(s, q, fp, FoldReplace, "x")); res.Status != StatusTaken {
					t.Fatalf("an enqueue: %+v; want the key taken", res)
				}
			default:
				if st := l.State(); st == LockCooling || st == LockOrphaned || rel.Released {
					t.Fatalf("state %s, stuck release %+v; want held by its live task", st, rel)
				}
				if res := mustAcquire(t, s, directAcquire(s, q, fp, FoldReject, "x")); res.Status != StatusHeld || res.Task != r.ID {
					t.Fatalf("an enqueue: %+v; want held by %s", res, r.ID)
				}
			}
			_ = err
		})
	}
}

// A kept task that failed for good under a fail hold (its lock persisted)
// and is run again by hand takes its key back for its run, and the key
// still lasts until its cooldown ends: its success leaves it cooling until
// then, with no call at the end to lengthen it.
func TestKeptKeyRunAgainAfterAFailHoldLastsItsWindow(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := keptHeld(t, rdb, s, q, "00000000000000f1", StateActive, time.Now().Add(3*time.Hour))
	rdb.HSet(ctx, r.Mode(), FieldHolder, r.ID, FieldError, "boom")
	rdb.Persist(ctx, r.Lock) // FailHoldUntilReleased
	st, err := s.Start(ctx, &Start{Ref: r, TTL: time.Hour})
	if err != nil || st.Status != StatusTaken {
		t.Fatalf("start of the task run again: %+v %v, want its key", st, err)
	}
	if pttl := rdb.PTTL(ctx, r.Lock).Val(); !near(pttl, 3*time.Hour, 5*time.Second) {
		t.Fatalf("the key lives %v more, want its window's 3h", pttl)
	}
}
