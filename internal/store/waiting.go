package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// The waiting set of a type in a queue (Keys.Wait, MaxPending) counts the
// keys whose task waits to run: a lock taken at enqueue enters it (field b,
// until its lifetime), a Defer follow-up enters it when it is made (until
// it starts). Its entries leave when their task starts, or expire with
// their lock. Tasks can also stop waiting behind the lock's back (an
// operator deletes or archives them, purges or deletes the queue): such an
// entry would hold a slot for its lock's lifetime. So when the set is full,
// PruneWaiting checks each entry against asynq's record, as healing checks
// an owner, and drops those whose task cannot run.

// pruneEvery bounds how often one Store checks one waiting set that looks
// the same: a full set of live keys costs its refused calls one check a
// second, not one each.
const pruneEvery = time.Second

// pruneCheck is when, and on what counts, a Store last checked a waiting
// set.
type pruneCheck struct {
	at              time.Time
	waiting, queued int64
}

// pruneChunk bounds the candidates of one prune script call.
const pruneChunk = 64

// PruneWaiting drops from the waiting set of typ in queue the entries of
// keys that wait no more, and reports how many. waiting and queued are the
// counts the refused call saw: the set's keys, and the tasks in the queue's
// pending list and scheduled set. More keys than tasks means some entries
// are certainly stale (a purged queue): the set is checked at once, unless
// this Store checked it on those same counts less than a second ago. A set
// that is not (a full set of live keys, most likely) is checked at most
// once a second.
func (s *Store) PruneWaiting(ctx context.Context, queue, typ string, waiting, queued int64, now time.Time) (int, error) {
	wait := s.keys.Wait(queue, typ)
	this := pruneCheck{at: now, waiting: waiting, queued: queued}
	if v, ok := s.pruned.Load(wait); ok {
		last := v.(pruneCheck)
		same := last.waiting == waiting && last.queued == queued
		if now.Sub(last.at) < pruneEvery && (waiting <= queued || same) {
			return 0, nil
		}
	}
	s.pruned.Store(wait, this)
	fps, err := s.waitingKeys(ctx, wait, now)
	if err != nil || len(fps) == 0 {
		return 0, err
	}
	entries, err := s.readEntries(ctx, queue, wait, fps)
	if err != nil {
		return 0, err
	}
	var dead []waitEntry
	for _, e := range entries {
		if !e.waits(typ, s.cfg.HealGrace, now) {
			dead = append(dead, e)
		}
	}
	removed := 0
	for len(dead) > 0 {
		n := min(len(dead), pruneChunk)
		k, err := s.prune(ctx, queue, wait, dead[:n])
		if err != nil {
			return removed, err
		}
		removed += k
		dead = dead[n:]
	}
	return removed, nil
}

// waitingKeys reads the fingerprints whose entries have not expired.
func (s *Store) waitingKeys(ctx context.Context, wait string, now time.Time) ([]string, error) {
	v, err := s.Do(ctx, wait, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.ZRangeByScore(c, wait, &redis.ZRangeBy{Min: "(" + strconv.FormatInt(now.UnixMilli(), 10), Max: "+inf"}).Result()
	})
	if err != nil {
		return nil, err
	}
	fps, ok := v.([]string)
	if !ok {
		return nil, errors.New("store: unexpected reply to the waiting set's read")
	}
	return fps, nil
}

// waitEntry is one key of a waiting set, as read for PruneWaiting.
type waitEntry struct {
	fp                    string
	value                 string // the lock's value, "" for no lock
	bounded, follow       string // the mode record's waiting-set type and follow-up (of the holder)
	ownerState, follState string // of the lock's holder, and of its follow-up
}

// waits reports whether the entry's key still waits, as healing would
// judge its lock: counted under typ, and its holder or follow-up waiting or
// about to (a holder not stored yet, younger than grace).
func (e *waitEntry) waits(typ string, grace time.Duration, now time.Time) bool {
	p := ParseValue(e.value)
	switch {
	case e.value == "":
		return Waiting(e.follState) // no lock: a follow-up its gone holder owed may still wait
	case e.bounded != typ:
		return false // not counted here
	case Waiting(e.ownerState) || Waiting(e.follState):
		return true
	case e.ownerState == "" && p.Kind == HoldWrap:
		return now.Sub(p.At) < grace
	}
	return false // running (its entry left as it started), held past its task, or gone
}

// readEntries reads the locks of fps with their mode records, then their
// holders' and follow-ups' asynq states: two pipelined round trips.
func (s *Store) readEntries(ctx context.Context, queue, route string, fps []string) ([]waitEntry, error) {
	out := make([]waitEntry, len(fps))
	locks := make([]*redis.StringCmd, len(fps))
	modes := make([]*redis.SliceCmd, len(fps))
	_, err := s.Pipelined(ctx, route, func(p redis.Pipeliner) {
		for i, fp := range fps {
			lock := s.keys.Lock(queue, fp)
			locks[i] = p.Get(ctx, lock)
			modes[i] = p.HMGet(ctx, ModeOf(lock), FieldHolder, FieldBounded, FieldFollow)
		}
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("read waiting locks: %w", err)
	}
	states := make([][2]*redis.StringCmd, len(fps))
	_, err = s.Pipelined(ctx, route, func(p redis.Pipeliner) {
		for i, fp := range fps {
			e := &out[i]
			e.fp, e.value = fp, locks[i].Val()
			m := modes[i].Val()
			str := func(j int) string {
				if j < len(m) {
					v, _ := m[j].(string)
					return v
				}
				return ""
			}
			holder := ParseValue(e.value).Holder
			e.follow = str(2)
			if e.value == "" || str(0) == holder {
				e.bounded = str(1)
			}
			if holder != "" {
				states[i][0] = p.HGet(ctx, TaskKey(queue, holder), "state")
			}
			if e.follow != "" {
				states[i][1] = p.HGet(ctx, TaskKey(queue, e.follow), "state")
			}
		}
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("read waiting holders: %w", err)
	}
	for i := range out {
		if c := states[i][0]; c != nil {
			out[i].ownerState = c.Val()
		}
		if c := states[i][1]; c != nil {
			out[i].follState = c.Val()
		}
	}
	return out, nil
}

// prune runs the prune script (lua/prune.lua) for entries of one waiting
// set.
func (s *Store) prune(ctx context.Context, queue, wait string, es []waitEntry) (int, error) {
	keys := make([]string, 0, len(es)+1)
	args := make([]any, 0, 2*len(es))
	keys = append(keys, wait)
	for i := range es {
		e := &es[i]
		keys = append(keys, s.keys.Lock(queue, e.fp))
		args = append(args, e.fp, e.value)
	}
	v, err := s.run(ctx, s.sc.prune, keys, args...)
	if err != nil {
		return 0, err
	}
	n, ok := v.(int64)
	if !ok {
		return 0, fmt.Errorf("dedup: unexpected prune reply %T", v)
	}
	return int(n), nil
}
