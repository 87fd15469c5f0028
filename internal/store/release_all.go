package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// releaseAllChunk bounds the locks one call releases, so that one call
// holds Redis for a few hundred microseconds at most.
const releaseAllChunk = 256

// ReleaseAll releases the locks refs name, of tasks that took them as they
// started (StartValue: they arrived without one) and
// succeeded, each if it is still its task's (lua/release_all.lua). One call per
// queue (its slot) and chunk. left indexes those with a mode record beside
// the lock, which a Settle must end (a follow-up may be owed); a lock
// another task holds now, or that is gone, is left alone. A failed call's
// locks stay until their task's record, gone, lets the key's next use heal
// them; err joins those calls' errors.
func (s *Store) ReleaseAll(ctx context.Context, refs []Ref) (left []int, err error) {
	byQueue := map[string][]int{}
	for i := range refs {
		byQueue[refs[i].Queue] = append(byQueue[refs[i].Queue], i)
	}
	var (
		mu   sync.Mutex // (eachGroup runs the queues' groups at once)
		errs []error
	)
	eachGroup(byQueue, func(idx []int) {
		for len(idx) > 0 {
			n := min(len(idx), releaseAllChunk)
			l, err := s.releaseChunk(ctx, refs, idx[:n])
			mu.Lock()
			left, errs = append(left, l...), append(errs, err)
			mu.Unlock()
			idx = idx[n:]
		}
	})
	return left, errors.Join(errs...)
}

// releaseChunk runs one release_all call for refs[idx...], all of one queue.
func (s *Store) releaseChunk(ctx context.Context, refs []Ref, idx []int) ([]int, error) {
	keys, args := make([]string, 0, 2*len(idx)), make([]any, 0, len(idx))
	for _, i := range idx {
		keys = append(keys, refs[i].Lock, refs[i].Mode())
		args = append(args, refs[i].ID)
	}
	v, err := s.run(ctx, s.sc.releaseAll, keys, args...)
	if err != nil {
		return nil, fmt.Errorf("dedup: release %d locks of queue %s together: %w", len(idx), refs[idx[0]].Queue, err)
	}
	arr, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("dedup: unexpected release_all reply %T", v)
	}
	var left []int
	for _, e := range arr {
		n, ok := e.(int64)
		if !ok || n < 1 || int(n) > len(idx) {
			return left, fmt.Errorf("dedup: unexpected release_all reply element %v", e)
		}
		left = append(left, idx[n-1])
	}
	return left, nil
}
