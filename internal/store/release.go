package store

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// ReleaseResult is what an operator's release did.
type ReleaseResult struct {
	Released bool
	Gone     bool   // there was no lock any more
	Owner    string // not released: the task that owns the lock now
	Runnable string // not released (ReleaseStuck): the owner can run now, in this asynq state
	Index    string // released: the owner's index key, if it was deleted with the lock
	FollowUp string // released (ReleaseStuck): the follow-up the key was handed to, now pending
}

// ReleaseLock runs the release script (lua/release.lua) for an operator
// (dedupctl): it deletes the lock l, read before, only if its owner is
// still l's and has not taken it again since (its take time is l's), with
// the owner's index key when it points to this lock and the lock's entry
// in its type's waiting set.
func ReleaseLock(ctx context.Context, c redis.Scripter, k Keys, l *Lock) (ReleaseResult, error) {
	return releaseLock(ctx, c, k, l, false)
}

// ReleaseStuck is ReleaseLock for dedupctl doctor --fix: it also keeps the
// lock if its owner can run after all (its record exists, is not
// completed or archived, and is where its state says), read in the same
// script, so a task stored again since the diagnosis keeps its lock. A
// follow-up the lock owes that still waits takes the lock and is queued
// at once (as the end of its owner's run would have done).
func ReleaseStuck(ctx context.Context, c redis.Scripter, k Keys, l *Lock) (ReleaseResult, error) {
	return releaseLock(ctx, c, k, l, true)
}

func releaseLock(ctx context.Context, c redis.Scripter, k Keys, l *Lock, stuck bool) (ReleaseResult, error) {
	idx := k.Index(l.Queue, l.Owner)
	keys := []string{l.Key, idx, k.Wait(l.Queue, l.WaitType())}
	args := []any{l.OwnerStored(), l.FP, l.Fields[FieldCreated]}
	if stuck {
		q := l.Queue
		keys = append(keys, TaskKey(q, l.Owner), PendingKey(q), ActiveKey(q), ScheduledKey(q), RetryKey(q))
		args = append(args, l.Owner, l.Follow, PackOwner(l.Follow, l.FP))
		if l.Follow != "" {
			keys = append(keys, k.Follow(q, l.FP), TaskKey(q, l.Follow))
		}
	}
	v, err := scripts().release.Run(ctx, c, keys, args...).Result()
	if err != nil {
		return ReleaseResult{}, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return ReleaseResult{}, err
	}
	switch rep.status {
	case 0:
		return ReleaseResult{Gone: true}, nil
	case 2:
		return ReleaseResult{Owner: UnpackOwner(rep.str(0), l.FP)}, nil
	case 3:
		return ReleaseResult{Runnable: rep.str(0)}, nil
	case 1:
		res := ReleaseResult{Released: true, FollowUp: rep.str(1)}
		if rep.str(0) == "1" {
			res.Index = idx
		}
		return res, nil
	}
	return ReleaseResult{}, fmt.Errorf("dedup: release %s: unexpected reply %v", l.Key, v)
}
