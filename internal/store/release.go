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
	Index    string // released: the owner's index key, if it was deleted with the lock
}

// ReleaseLock runs the release script (lua/release.lua) for an operator
// (dedupctl): it deletes the lock l, read before, only if its owner is still
// l's, with the owner's index key when it points to this lock and the
// lock's entry in its type's waiting set.
func ReleaseLock(ctx context.Context, c redis.Scripter, k Keys, l *Lock) (ReleaseResult, error) {
	idx := k.Index(l.Queue, l.Owner)
	keys := []string{l.Key, idx, k.Wait(l.Queue, l.WaitType())}
	v, err := scripts().release.Run(ctx, c, keys, l.OwnerStored(), l.FP).Result()
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
	case 1:
		res := ReleaseResult{Released: true}
		if rep.str(0) == "1" {
			res.Index = idx
		}
		return res, nil
	}
	return ReleaseResult{}, fmt.Errorf("dedup: release %s: unexpected reply %v", l.Key, v)
}
