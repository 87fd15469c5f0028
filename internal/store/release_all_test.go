package store

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

// ReleaseAll releases each lock still taken at start by its task, and only
// those: a lock another task took since (the key healed after its task
// completed), one its task holds kept (a cooldown), and a missing one stay
// as they are; one with a mode record beside it is left, named, for a
// settle call (a follow-up may be owed), untouched.
func TestReleaseAllReleasesOnlyLocksStillTakenAtStartByTheirTasks(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	ref := func(i int) Ref { return s.ref(q, fmt.Sprintf("%016x", 0x300+i), NewPlainID()) }
	mine, taken, kept, moded, missing := ref(1), ref(2), ref(3), ref(4), ref(5)
	rdb.Set(ctx, mine.Lock, StartValue(mine.ID), time.Hour)
	rdb.Set(ctx, taken.Lock, StartValue(NewPlainID()), time.Hour)
	rdb.Set(ctx, kept.Lock, KeptValue(kept.ID, time.Now().Add(time.Hour)), time.Hour)
	rdb.Set(ctx, moded.Lock, StartValue(moded.ID), time.Hour)
	rdb.HSet(ctx, moded.Mode(), FieldHolder, moded.ID, FieldFollow, NewPlainID())
	w := &scriptWorld{rdb: rdb, s: s, q: q}
	before := w.snapshot()

	left, err := s.ReleaseAll(ctx, []Ref{taken, mine, kept, moded, missing})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(left, []int{3}) {
		t.Fatalf("left to a settle call: %v, want [3] (the lock with a mode record)", left)
	}
	d := diff(before, w.snapshot())
	if len(d) != 1 || rdb.Exists(ctx, mine.Lock).Val() != 0 {
		t.Fatalf("changed %v; want only %s deleted", d, mine.Lock)
	}
}

// Locks of several queues, more than one call carries, are released by
// queue and chunk; the indexes left refer to the caller's slice.
func TestReleaseAllOfManyQueuesAndChunksNamesWhatIsLeftByTheCallersIndex(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	qs := []string{redistest.Uniq(t) + "a", redistest.Uniq(t) + "b"}
	var refs []Ref
	var want []int
	for i := range 2*releaseAllChunk + 10 {
		r := s.ref(qs[i%2], fmt.Sprintf("%016x", 0x1000+i), NewPlainID())
		rdb.Set(ctx, r.Lock, StartValue(r.ID), time.Hour)
		if i%97 == 0 {
			rdb.HSet(ctx, r.Mode(), FieldHolder, r.ID)
			want = append(want, i)
		}
		refs = append(refs, r)
	}
	left, err := s.ReleaseAll(ctx, refs)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(left)
	if !slices.Equal(left, want) {
		t.Fatalf("left %v, want %v", left, want)
	}
	for i, r := range refs {
		if kept := rdb.Exists(ctx, r.Lock).Val() == 1; kept != slices.Contains(want, i) {
			t.Fatalf("lock %d kept=%v", i, kept)
		}
	}
}
