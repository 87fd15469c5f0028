package store

import (
	"context"
	"time"
)

// Merge is one call of the merge script (lua/merge.lua): write a merged
// payload into the task acquire returned with StatusMerge, if the key has
// not changed since.
type Merge struct {
	Ref     Ref
	Target  string // AcquireResult.Task
	Follow  bool   // AcquireResult.FollowUp
	Version string // AcquireResult.Version
	Payload []byte // the merged payload
	// DebounceDue and TTL, as in Acquire: a scheduled holder merged into
	// becomes due then, and its lock lasts TTL from now.
	DebounceDue int64
	TTL         time.Duration
	Bounded     bool      // with DebounceDue: the type counts its waiting keys (MaxPending)
	Now         time.Time // with DebounceDue: the producer's clock
}

// MergeResult is what merge did.
type MergeResult struct {
	Written bool   // the merged payload was written
	State   string // Written: the target's asynq state
	Broken  string // asynq's record is not what the script expects: why
}

// Merge runs the merge script.
func (s *Store) Merge(ctx context.Context, m *Merge) (MergeResult, error) {
	r := &m.Ref
	keys := []string{r.Lock, r.Mode(), TaskKey(r.Queue, m.Target)}
	args := []any{m.Target, flag(m.Follow), m.Version, payloadField(m.Payload)}
	if m.DebounceDue != 0 {
		keys = append(keys, ScheduledKey(r.Queue))
		if m.Bounded {
			keys = append(keys, WaitOf(r.Lock, r.Type))
		}
		args = append(args, m.DebounceDue, ms(m.TTL), r.FP, m.Now.UnixMilli())
	}
	v, err := s.run(ctx, s.sc.merge, keys, args...)
	if err != nil {
		return MergeResult{}, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return MergeResult{}, err
	}
	if rep.status == StatusBroken {
		return MergeResult{Broken: rep.str(0)}, nil
	}
	return MergeResult{Written: rep.status == 1, State: rep.str(0)}, nil
}
