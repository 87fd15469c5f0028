package lockview

import (
	"context"
	"sort"

	"github.com/asynq-dedup/dedup/internal/store"
)

// States are the lock states, in the order they are shown.
var States = []string{store.LockWaiting, store.LockRunning, store.LockRetryWait, store.LockCooling, store.LockFailed, store.LockOrphaned}

// Tally is how many locks of one queue and task type are in each state.
type Tally struct {
	Queue   string
	Type    string
	ByState map[string]int
	Total   int
}

// CountLocks counts the locks of prefix by queue, type and state with a
// full SCAN (on every master of a cluster), count keys per page; sorted by
// queue, then type.
func CountLocks(ctx context.Context, src Source, prefix string, count int64) ([]*Tally, error) {
	s, err := NewScanner(ctx, src, prefix, Filter{}, count)
	if err != nil {
		return nil, err
	}
	type qt struct{ q, t string }
	by := map[qt]*Tally{}
	err = s.Each(ctx, func(l *Info) {
		k := qt{l.Queue, l.Type}
		t := by[k]
		if t == nil {
			t = &Tally{Queue: l.Queue, Type: l.Type, ByState: map[string]int{}}
			by[k] = t
		}
		t.ByState[l.State]++
		t.Total++
	})
	if err != nil {
		return nil, err
	}
	out := make([]*Tally, 0, len(by))
	for _, t := range by {
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Queue != out[j].Queue {
			return out[i].Queue < out[j].Queue
		}
		return out[i].Type < out[j].Type
	})
	return out, nil
}
