package store

import (
	"context"
	"fmt"
)

// Done is one attempt's release in a call of the done script
// (lua/done.lua): an attempt that holds its lock ended for good.
type Done struct {
	Ref   Ref
	Token string // the attempt's; "" for an attempt that ran without a start (its lock holds none)
}

// DoneResult is what done did with one lock.
type DoneResult struct {
	Released bool  // released
	Finish   bool  // the lock owes a follow-up or has a cooldown: untouched, Finish settles it
	Err      error // the call failed: untouched as far as is known
}

// Owned reports whether the lock was still the attempt's (released, or
// left to Finish).
func (r DoneResult) Owned() bool { return r.Released || r.Finish }

// done runs the done script for one attempt; settled is false when the lock
// holds more than its owner (a follow-up, a cooldown) and finish must settle
// it.
func (s *Store) done(ctx context.Context, f *Finish) (res FinishResult, settled bool, err error) {
	r := &f.Ref
	v, err := s.run(ctx, s.sc.done, []string{s.keys.LockOf(r)}, r.stored(), r.ID, f.Token)
	if err != nil {
		return FinishResult{}, false, err
	}
	rs, err := parseDone(v, 1)
	if err != nil {
		return FinishResult{}, false, err
	}
	return FinishResult{Owned: rs[0].Owned()}, !rs[0].Finish, nil
}

// DoneAll releases many locks whose attempts ended for good, in one call
// of the done script per node (per slot on Redis Cluster, concurrently),
// each through that node's breaker.
func (s *Store) DoneAll(ctx context.Context, ds []Done) []DoneResult {
	out := make([]DoneResult, len(ds))
	groups := map[string][]int{} // by the lock's hash tag: the keys of one call share a slot
	for i := range ds {
		tag := ds[i].Ref.Queue
		groups[tag] = append(groups[tag], i)
	}
	eachGroup(groups, func(idx []int) { s.doneGroup(ctx, ds, idx, out) })
	return out
}

// doneGroup runs the done script for the attempts ds[idx] of one queue and
// writes their results to out[idx].
func (s *Store) doneGroup(ctx context.Context, all []Done, idx []int, out []DoneResult) {
	keys := make([]string, len(idx))
	args := make([]any, 0, 3*len(idx))
	for j, i := range idx {
		r := &all[i].Ref
		keys[j] = s.keys.LockOf(r)
		args = append(args, r.stored(), r.ID, all[i].Token)
	}
	v, err := s.run(ctx, s.sc.done, keys, args...)
	var rs []DoneResult
	if err == nil {
		rs, err = parseDone(v, len(idx))
	}
	for j, i := range idx {
		if err != nil {
			out[i].Err = err
			continue
		}
		out[i] = rs[j]
	}
}

// parseDone reads the done script's reply for n locks.
func parseDone(v any, n int) ([]DoneResult, error) {
	a, ok := v.([]any)
	if !ok || len(a) != n {
		return nil, fmt.Errorf("dedup: unexpected done reply %T (%d locks)", v, n)
	}
	out := make([]DoneResult, n)
	for i, e := range a {
		c, ok := e.(int64)
		if !ok || c < 0 || c > 2 {
			return nil, fmt.Errorf("dedup: unexpected done reply %v for lock %d", e, i)
		}
		out[i] = DoneResult{Released: c == 1, Finish: c == 2}
	}
	return out, nil
}
