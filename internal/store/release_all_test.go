package store

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

// ReleaseAll releases each lock that still holds its attempt's value, and
// only those: a lock another task took since (the key healed after its
// task completed), a later attempt of the same task (its own token), one
// its task holds kept (a cooldown), and a missing one stay as they are;
// one with a mode record beside it is left, untouched, for a settle call
// (its follow-up, a gone holder's record).
func TestReleaseAllReleasesOnlyLocksStillHoldingTheirAttemptsValue(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	taken := func(i int) Taken {
		r := s.ref(q, fmt.Sprintf("%016x", 0x300+i), NewPlainID())
		return Taken{Ref: r, Value: StartValue(r.ID, "t1")}
	}
	other, mine, later, kept, moded, missing := taken(1), taken(2), taken(3), taken(4), taken(5), taken(6)
	rdb.Set(ctx, other.Ref.Lock, StartValue(NewPlainID(), "t9"), time.Hour)
	rdb.Set(ctx, mine.Ref.Lock, mine.Value, time.Hour)
	rdb.Set(ctx, later.Ref.Lock, StartValue(later.Ref.ID, "t2"), time.Hour)
	rdb.Set(ctx, kept.Ref.Lock, KeptValue(kept.Ref.ID, time.Now().Add(time.Hour)), time.Hour)
	rdb.Set(ctx, moded.Ref.Lock, moded.Value, time.Hour)
	rdb.HSet(ctx, moded.Ref.Mode(), FieldHolder, moded.Ref.ID, FieldFollow, NewPlainID())
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()

	out, err := s.ReleaseAll(ctx, []Taken{other, mine, later, kept, moded, missing})
	if err != nil {
		t.Fatal(err)
	}
	want := []int{ReleasedNot, ReleasedNow, ReleasedNot, ReleasedNot, ReleasedLeft, ReleasedNot}
	if !slices.Equal(out, want) {
		t.Fatalf("released %v, want %v", out, want)
	}
	d := diff(before, w.snapshot())
	if len(d) != 1 || rdb.Exists(ctx, mine.Ref.Lock).Val() != 0 {
		t.Fatalf("changed %v; want only %s deleted", d, mine.Ref.Lock)
	}
}

// Locks of several queues, more than one call carries, are released by
// queue and chunk; what was done is reported in the caller's order.
func TestReleaseAllOfManyQueuesAndChunksReportsInTheCallersOrder(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	qs := []string{redistest.Uniq(t) + "a", redistest.Uniq(t) + "b"}
	var ts []Taken
	var want []int
	for i := range 2*releaseAllChunk + 10 {
		r := s.ref(qs[i%2], fmt.Sprintf("%016x", 0x1000+i), NewPlainID())
		rdb.Set(ctx, r.Lock, StartValue(r.ID, ""), time.Hour)
		w := ReleasedNow
		if i%97 == 0 {
			rdb.HSet(ctx, r.Mode(), FieldHolder, r.ID)
			w = ReleasedLeft
		}
		ts, want = append(ts, Taken{Ref: r, Value: StartValue(r.ID, "")}), append(want, w)
	}
	out, err := s.ReleaseAll(ctx, ts)
	if err != nil || !slices.Equal(out, want) {
		t.Fatalf("released %v, %v; want %v", out, err, want)
	}
	for i, t2 := range ts {
		if kept := rdb.Exists(ctx, t2.Ref.Lock).Val() == 1; kept != (want[i] == ReleasedLeft) {
			t.Fatalf("lock %d kept=%v", i, kept)
		}
	}
}
