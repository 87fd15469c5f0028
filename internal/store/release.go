package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// ReleaseResult is what an operator's release did.
type ReleaseResult struct {
	Released bool
	Gone     bool   // there was no lock any more
	Owner    string // not released: the task that owns the lock now
	Runnable string // not released (ReleaseStuck): the owner can run now, in this asynq state
	Index    string // released: the owner's index key, if it was deleted with the lock (ReleaseStuck)
	// FollowUp: released, and the follow-up the lock owed, which waited, is
	// queued now (its payload is the newest): the key's owner (ReleaseStuck)
	// or, the key free, to take it when it starts (FollowUpOwns false).
	FollowUp     string
	FollowUpOwns bool
}

// ReleaseLock runs the release script (lua/release.lua) for an operator
// (Dedup.Release, dedupctl release): it deletes the lock l, read before,
// only if its owner is still l's and has not taken it again since (its
// take time is l's), with the lock's entry in its type's waiting set. The
// owner's index key (a caller-chosen ID) stays, so the owner, if it still
// runs, finds its key. A follow-up the lock owes that waits is queued now,
// even while an attempt of the owner runs (its payload is the newest), and
// takes the key when it starts.
func ReleaseLock(ctx context.Context, c redis.Scripter, k Keys, l *Lock) (ReleaseResult, error) {
	return releaseLock(ctx, c, k, l, false)
}

// ReleaseStuck is ReleaseLock for dedupctl doctor --fix: it also keeps the
// lock if its owner can run after all (its record exists, is not
// completed or archived, and is where its state says), read in the same
// script, so a task stored again since the diagnosis keeps its lock. It
// deletes the owner's index key, and a follow-up the lock owes that still
// waits takes the lock and is queued at once (as the end of its owner's
// run would have done).
func ReleaseStuck(ctx context.Context, c redis.Scripter, k Keys, l *Lock) (ReleaseResult, error) {
	return releaseLock(ctx, c, k, l, true)
}

func releaseLock(ctx context.Context, c redis.Scripter, k Keys, l *Lock, stuck bool) (ReleaseResult, error) {
	q, idx := l.Queue, k.Index(l.Queue, l.Owner)
	kl := newKeyList()
	kl.add(roleLock, l.Key)
	kl.add(roleIndex, idx)
	kl.add(roleWait, k.Wait(q, l.WaitType()))
	if stuck || l.Follow != "" {
		kl.add(roleOwner, TaskKey(q, l.Owner))
		kl.add(rolePending, PendingKey(q))
		kl.add(roleActive, ActiveKey(q))
		kl.add(roleScheduled, ScheduledKey(q))
		kl.add(roleRetry, RetryKey(q))
	}
	if l.Follow != "" {
		kl.add(roleFollow, k.Follow(q, l.FP))
		kl.add(roleFollowTask, TaskKey(q, l.Follow))
	}
	mode := "stuck"
	if !stuck {
		mode = ""
		kl.add(roleSuperseded, k.Superseded(q, l.Owner))
	}
	args := []any{kl.roleString(), l.OwnerStored(), l.FP, l.Fields[FieldCreated], l.Owner, l.Follow, PackOwner(l.Follow, l.FP), mode}
	v, err := scripts().release.Run(ctx, c, kl.keys, args...).Result()
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
		res := ReleaseResult{Released: true, FollowUp: rep.str(1), FollowUpOwns: rep.str(2) == "owner"}
		if rep.str(0) == "1" {
			res.Index = idx
		}
		return res, nil
	}
	return ReleaseResult{}, fmt.Errorf("dedup: release %s: unexpected reply %v", l.Key, v)
}

// ForceRelease runs the force script (lua/force.lua): it releases the lock
// of r (its queue, fingerprint and type) whoever holds it, in one step
// (again only for a lock that owes a follow-up it did not expect), and
// reports the owner it released (ReleaseResult.Owner, with Released) or
// that there was no lock (Gone). It reads the owner first, to mark it
// released (if it still owns the lock when the script runs).
func ForceRelease(ctx context.Context, c redis.Cmdable, k Keys, r *Ref) (ReleaseResult, error) {
	lock := k.LockOf(r)
	owner, err := c.HGet(ctx, lock, FieldOwner).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return ReleaseResult{}, err
	}
	follow := ""
	for n := 0; ; n++ {
		kl := newKeyList()
		kl.add(roleLock, lock)
		kl.add(roleWait, k.Wait(r.Queue, r.Type))
		kl.add(rolePending, PendingKey(r.Queue))
		kl.add(roleScheduled, ScheduledKey(r.Queue))
		kl.add(roleFollow, k.Follow(r.Queue, r.FP))
		if follow != "" {
			kl.add(roleFollowTask, TaskKey(r.Queue, follow))
		}
		if owner != "" {
			kl.add(roleSuperseded, k.Superseded(r.Queue, UnpackOwner(owner, r.FP)))
		}
		v, err := scripts().force.Run(ctx, c, kl.keys, kl.roleString(), r.FP, follow, owner).Result()
		if err != nil {
			return ReleaseResult{}, err
		}
		rep, err := parseReply(v)
		if err != nil {
			return ReleaseResult{}, err
		}
		switch {
		case rep.status == 0:
			return ReleaseResult{Gone: true}, nil
		case rep.status == 1:
			return ReleaseResult{Released: true, Owner: UnpackOwner(rep.str(0), r.FP), FollowUp: rep.str(1)}, nil
		case rep.status != 4 || n == maxNeeds:
			return ReleaseResult{}, fmt.Errorf("dedup: force-release %s: unexpected reply %v", lock, v)
		}
		follow = rep.str(0)
	}
}
