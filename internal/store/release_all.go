package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// Taken is a lock an attempt took as it started: its key and the value it
// set (StartValue, with the attempt's token).
type Taken struct {
	Ref   Ref
	Value string
}

// What ReleaseAll did with each lock.
const (
	ReleasedNot    = 0  // the lock no longer holds the attempt's value (another's, or gone): untouched
	ReleasedNow    = 1  // deleted
	ReleasedLeft   = 2  // a mode record beside it: a Settle must end it
	ReleasedFailed = -1 // its call failed: the lock stays, for the key's next use to heal
)

// releaseAllChunk bounds the locks one call releases, so that one call
// holds Redis for a few hundred microseconds at most.
const releaseAllChunk = 256

// ReleaseAll releases the locks ts name, taken by attempts that succeeded
// since, each if it still holds its attempt's value (lua/release_all.lua):
// one call per queue (its slot) and chunk. out says, per lock, what was
// done (ReleasedNot, …); err joins the failed calls' errors.
func (s *Store) ReleaseAll(ctx context.Context, ts []Taken) (out []int, err error) {
	byQueue := map[string][]int{}
	for i := range ts {
		byQueue[ts[i].Ref.Queue] = append(byQueue[ts[i].Ref.Queue], i)
	}
	out = make([]int, len(ts))
	var (
		mu   sync.Mutex // (eachGroup runs the queues' groups at once)
		errs []error
	)
	eachGroup(byQueue, func(idx []int) {
		for len(idx) > 0 {
			n := min(len(idx), releaseAllChunk)
			err := s.releaseChunk(ctx, ts, idx[:n], out)
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
			idx = idx[n:]
		}
	})
	return out, errors.Join(errs...)
}

// releaseChunk runs one release_all call for ts[idx...], all of one queue,
// and writes what it did with each into out.
func (s *Store) releaseChunk(ctx context.Context, ts []Taken, idx []int, out []int) error {
	keys, args := make([]string, 0, 2*len(idx)), make([]any, 0, len(idx))
	for _, i := range idx {
		keys = append(keys, ts[i].Ref.Lock, ts[i].Ref.Mode())
		args = append(args, ts[i].Value)
		out[i] = ReleasedFailed
	}
	v, err := s.run(ctx, s.sc.releaseAll, keys, args...)
	if err != nil {
		return fmt.Errorf("dedup: release %d locks of queue %s together: %w", len(idx), ts[idx[0]].Ref.Queue, err)
	}
	arr, ok := v.([]any)
	if !ok || len(arr) != len(idx) {
		return fmt.Errorf("dedup: unexpected release_all reply %T of %d", v, len(idx))
	}
	for j, e := range arr {
		n, ok := e.(int64)
		if !ok || n < ReleasedNot || n > ReleasedLeft {
			return fmt.Errorf("dedup: unexpected release_all reply element %v", e)
		}
		out[idx[j]] = int(n)
	}
	return nil
}
