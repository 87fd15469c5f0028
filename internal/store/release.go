package store

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// How Release releases a key (lua/release.lua).
const (
	ReleaseHolder = "release" // if Release.Holder holds it
	ReleaseForce  = "force"   // whoever holds it
	ReleaseUnlock = "unlock"  // if the lock's value is Release.Holder exactly: a refused enqueue gives its lock back
	ReleaseStuck  = "stuck"   // if Release.Holder holds it and cannot run, and no policy keeps it (dedupctl doctor --fix)
)

// Release is one call of the release script.
type Release struct {
	Lock   string // the lock's key
	Queue  string
	Type   string // the type whose waiting set may count the key ("" none)
	How    string // ReleaseHolder, ReleaseForce, ReleaseUnlock or ReleaseStuck
	Holder string // the holder expected (the whole value, for ReleaseUnlock)
	Grace  time.Duration
}

// ReleaseResult is what release did.
type ReleaseResult struct {
	Released bool
	Holder   string // the holder it found (released, or kept)
	Queued   string // the follow-up queued now, "" none
	Kept     string // ReleaseStuck, not released: the holder's state, or the kind of hold that keeps it
}

// ReleaseKey runs the release script over c (a Store's client, or an
// operator's), calling it again with the keys it asks for.
func ReleaseKey(ctx context.Context, c redis.Scripter, rel *Release) (ReleaseResult, error) {
	sc := scripts().release
	_, _, fp, _ := ParseLockKey(rel.Lock)
	var h hint
	tries := maxNeeds
	if rel.How != ReleaseForce {
		h.holder = rel.Holder
	} else {
		// An operator's forced release takes whoever holds the key, which
		// producers may take again between its reads: it asks longer.
		tries = 4 * maxNeeds
	}
	for n := 0; ; n++ {
		keys, args := rel.call(fp, &h)
		v, err := sc.Run(ctx, c, keys, args...).Result()
		if err != nil {
			return ReleaseResult{}, err
		}
		rep, err := parseReply(v)
		if err != nil {
			return ReleaseResult{}, err
		}
		switch rep.status {
		case statusNeed:
			if n == tries {
				return ReleaseResult{}, fmt.Errorf("%w: %s", ErrMoving, rel.Lock)
			}
			h = hint{holder: rep.str(1), follow: rep.str(2)}
			continue
		case 1:
			return ReleaseResult{Released: true, Holder: rep.str(0), Queued: rep.str(1)}, nil
		case 2:
			return ReleaseResult{Holder: rep.str(0)}, nil
		case 3:
			return ReleaseResult{Holder: rel.Holder, Kept: rep.str(0)}, nil
		}
		return ReleaseResult{}, nil
	}
}

// call lays out the script's KEYS and ARGV for the holder and follow-up h.
func (rel *Release) call(fp string, h *hint) ([]string, []any) {
	q := rel.Queue
	kl := newKeyList()
	kl.add(roleLock, rel.Lock)
	if rel.How != ReleaseUnlock || rel.Type != "" {
		kl.add(roleMode, ModeOf(rel.Lock))
		kl.add(roleWait, WaitOf(rel.Lock, rel.Type))
	}
	if rel.How != ReleaseUnlock && h.holder != "" {
		kl.add(roleHolder, TaskKey(q, h.holder))
		kl.add(rolePending, PendingKey(q))
		kl.add(roleActive, ActiveKey(q))
		kl.add(roleScheduled, ScheduledKey(q))
		kl.add(roleRetry, RetryKey(q))
	}
	if h.follow != "" {
		kl.add(roleFollowTask, TaskKey(q, h.follow))
	}
	return kl.keys, []any{kl.roleArg(), rel.How, rel.Holder, fp, h.holder, h.follow, int64(rel.Grace / time.Second)}
}

// Unlock gives back the lock a refused enqueue took (its value exactly),
// with its waiting-set entry if the call counted the key (MaxPending). It
// reports whether it did. Without a waiting set it names the lock alone,
// so that it runs during a slot migration too (a script whose keys are on
// both sides is refused, TRYAGAIN).
func (s *Store) Unlock(ctx context.Context, r *Ref, value string, counted bool) (bool, error) {
	typ := ""
	if counted {
		typ = r.Type
	}
	v, err := s.Do(ctx, r.Lock, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return ReleaseKey(c, rdb, &Release{Lock: r.Lock, Queue: r.Queue, Type: typ, How: ReleaseUnlock, Holder: value})
	})
	s.hints.forget(r.Lock)
	res, _ := v.(ReleaseResult)
	return res.Released, err
}
