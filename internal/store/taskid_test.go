package store

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"pgregory.net/rapid"
)

// A lock stores its owner's ID packed; every ID reads back as itself, a
// lock record holds exactly the Go side's packing (the scripts never pack),
// the wrapper's own IDs shrink to their 20 random digits, and a whole ID (a
// lock of the earlier layout) still reads back as that ID.
func TestLockIDPacking(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	q := redistest.Uniq(t)
	rapid.Check(t, func(t *rapid.T) {
		fp := rapid.StringMatching(`[0-9a-f]{16}|[0-9a-f]{32}`).Draw(t, "fp")
		id := rapid.OneOf(
			rapid.Just(NewLockedID(fp)),                            // the wrapper's own
			rapid.Just(NewLockedID(fp[:len(fp)/2]+fp[:len(fp)/2])), // another key's
			rapid.StringMatching(`[0-9a-f]{20}`),                   // looks packed
			rapid.StringMatching(`=.{0,24}`),                       // looks escaped
			rapid.StringMatching(`dd-[0-9a-f]{16}-[0-9a-fA-F]{19,21}`),
			rapid.String(),
		).Draw(t, "id")
		if id == "" {
			return // asynq never has an empty task ID
		}
		packed := PackOwner(id, fp)
		if got := UnpackOwner(packed, fp); got != id {
			t.Fatalf("unpack(pack(%q)) = %q (packed %q)", id, got, packed)
		}
		if fpOf, ok := ParseLockedID(id); ok && fpOf == fp && len(packed) != randomHexDigits {
			t.Fatalf("the wrapper's ID %q packs to %q, not its random digits", id, packed)
		}
		if fpOf, ok := ParseLockedID(id); ok && UnpackOwner(id, fp) != id {
			t.Fatalf("a whole ID %q (key %s) does not read back as itself", id, fpOf)
		}
		ref := Ref{Queue: q, FP: fp, ID: id, Type: "t", Indexed: true}
		if _, err := s.Acquire(ctx, &Acquire{Ref: ref, OnWaiting: FoldReject, OnRunning: RunReject, TTL: time.Minute, Now: time.Now()}); err != nil {
			t.Fatal(err)
		}
		defer rdb.Del(ctx, s.Keys().LockOf(&ref), s.Keys().Index(q, id))
		stored, err := rdb.HGet(ctx, s.Keys().LockOf(&ref), FieldOwner).Result()
		if err != nil || stored != packed {
			t.Fatalf("the lock of %q stores %q (%v); Go packs it as %q", id, stored, err, packed)
		}
		if owner, found, err := s.OwnerOf(ctx, q, fp); err != nil || !found || owner != id {
			t.Fatalf("OwnerOf = %q, %v, %v; want %q", owner, found, err, id)
		}
	})
}

// The copies Again stores carry their key, and say whether their original
// arrived without a lock (da-) or was locked at enqueue (dk-); callers may
// choose neither form.
func TestCopyIDs(t *testing.T) {
	fp := "0123456789abcdef"
	a, k := NewAgainID(fp), NewKeptID(fp)
	if got, ok := ParseAgainID(a); !ok || got != fp {
		t.Errorf("ParseAgainID(%q) = %q, %v", a, got, ok)
	}
	if got, ok := ParseKeptID(k); !ok || got != fp {
		t.Errorf("ParseKeptID(%q) = %q, %v", k, got, ok)
	}
	if _, ok := ParseKeptID(a); ok {
		t.Errorf("ParseKeptID took an arrival's copy %q", a)
	}
	if _, ok := ParseAgainID(k); ok {
		t.Errorf("ParseAgainID took a kept copy %q", k)
	}
	for _, id := range []string{a, k} {
		if !Reserved(id, fp) || !Reserved(id, "") {
			t.Errorf("a caller may choose %q", id)
		}
	}
}
