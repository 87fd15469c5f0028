package store

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// owes writes the state a missed owed signal leaves: no lock, and a mode
// record whose holder (in holderState, "" for no record) owed follow-up f,
// stored in followState; mode adds fields to the record.
func owes(t *testing.T, rdb redis.Cmdable, s *Store, q, fp, holderState, followState string, mode ...any) (r Ref, f string) {
	t.Helper()
	ctx := context.Background()
	r = s.ref(q, fp, NewPlainID())
	f = NewFollowID()
	putTask(rdb, q, r.ID, holderState)
	putTask(rdb, q, f, followState)
	fields := append([]any{FieldHolder, r.ID, FieldType, "t", FieldRunning, "d", FieldFollow, f}, mode...)
	if err := rdb.HSet(ctx, r.Mode(), fields...).Err(); err != nil {
		t.Fatal(err)
	}
	rdb.PExpire(ctx, r.Mode(), time.Hour)
	return r, f
}

// A key whose lock is gone while its mode record names a follow-up that
// still waits, owed by a holder that cannot run (missing, completed,
// archived), is found owing; a holder that can still run (it hands the key
// on at its end), a key with a lock (Diagnose's), a follow-up that no longer
// waits, a fail hold, a record owing nothing and a mode record of another
// prefix are not. The stuck release queues the follow-up found.
func TestDiagnoseOwedFindsAFollowUpParkedBehindAKeyWithNoLock(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	missing, fMissing := owes(t, rdb, s, q, "0000000000000301", "", StateScheduled)
	completed, fCompleted := owes(t, rdb, s, q, "0000000000000302", StateCompleted, StateRetry)
	archived, fArchived := owes(t, rdb, s, q, "0000000000000303", StateArchived, StatePending)
	owes(t, rdb, s, q, "0000000000000304", StateActive, StateScheduled)  // the holder runs
	owes(t, rdb, s, q, "0000000000000305", StatePending, StateScheduled) // the holder waits
	owes(t, rdb, s, q, "0000000000000306", "", StateCompleted)           // the follow-up ran
	owes(t, rdb, s, q, "0000000000000307", "", "")                       // the follow-up was deleted
	owes(t, rdb, s, q, "0000000000000308", StateArchived, StateScheduled, FieldError, "boom")
	locked, _ := owes(t, rdb, s, q, "0000000000000309", "", StateScheduled)
	rdb.Set(ctx, locked.Lock, Value(locked.ID), time.Hour)
	nothing := s.ref(q, "000000000000030a", NewPlainID())
	rdb.HSet(ctx, nothing.Mode(), FieldHolder, nothing.ID, FieldRunning, "d")

	keys, err := rdb.Keys(ctx, s.keys.ModePattern(q)).Result()
	if err != nil {
		t.Fatal(err)
	}
	other := NewKeys("other-"+s.keys.Prefix()).Lock(q, "000000000000030b")
	rdb.HSet(ctx, ModeOf(other), FieldHolder, NewPlainID(), FieldFollow, NewFollowID())
	found, err := DiagnoseOwed(ctx, rdb, s.keys, append(keys, ModeOf(other), "not-a-mode-record"))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, o := range found {
		got[o.Lock.Key] = o.Lock.Owner + " " + o.Follow + " " + o.Lock.TaskState + " " + o.Lock.Type
	}
	want := map[string]string{
		missing.Lock:   missing.ID + " " + fMissing + " missing t",
		completed.Lock: completed.ID + " " + fCompleted + " completed t",
		archived.Lock:  archived.ID + " " + fArchived + " archived t",
	}
	if len(got) != len(want) || got[missing.Lock] != want[missing.Lock] || got[completed.Lock] != want[completed.Lock] || got[archived.Lock] != want[archived.Lock] {
		t.Fatalf("found %v; want %v", got, want)
	}
	i := slices.IndexFunc(found, func(o Owing) bool { return o.Lock.Key == missing.Lock })
	l := found[i].Lock
	res, err := ReleaseKey(ctx, rdb, &Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: ReleaseStuck, Holder: l.Owner, Grace: time.Minute})
	if err != nil || !res.Released || res.Queued != fMissing {
		t.Fatalf("stuck release of the key found: %+v, %v; want released, %s queued", res, err, fMissing)
	}
	if st := rdb.HGet(ctx, TaskKey(q, fMissing), "state").Val(); st != StatePending || rdb.ZScore(ctx, ScheduledKey(q), fMissing).Err() == nil {
		t.Fatalf("follow-up %s: %q; want pending, out of the scheduled set", fMissing, st)
	}
	t.Logf("after the release: lock %q, mode record %v", rdb.Get(ctx, l.Key).Val(), rdb.HGetAll(ctx, ModeOf(l.Key)).Val())
}
