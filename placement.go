package dedup

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
)

// placement records whether the tasks a Client enqueues, or a server runs,
// are stored in the Dedup's own Redis. The lock is a cache of asynq's
// record of its owner task, read in the same script (healing, Replace,
// follow-ups, how an attempt asynq gave up ended): with the tasks in
// another Redis every owner would look gone, and live locks would heal a
// HealGrace after they were taken. So that setup is refused, not weakened.
//
// The state moves once, from unknown to here or elsewhere; checks are
// made until it does, at most maxPlaceChecks times.
type placement struct {
	state  atomic.Int32
	checks atomic.Int32
}

const (
	placeUnknown int32 = iota
	placeHere
	placeElsewhere
)

// maxPlaceChecks bounds the checks that cannot decide (a task already gone
// from a queue this Redis knows: it ran and was deleted, or it is here and
// was deleted by hand); after that the tasks are taken to be here.
const maxPlaceChecks = 64

// refused returns an error matching ErrTasksElsewhere once the tasks were
// found in another Redis, else nil.
func (p *placement) refused(who string) error {
	if p.state.Load() != placeElsewhere {
		return nil
	}
	return fmt.Errorf("%w: %s stores its tasks in another Redis than the Dedup's; use one Redis (or one Cluster) for both", ErrTasksElsewhere, who)
}

// check asks Redis once where task id of queue lives, unless that is known.
// mustExist is true where the task certainly exists if it is here (the
// middleware asks about the task it is running). It reports whether this
// call found the tasks elsewhere; a Redis error decides nothing.
func (p *placement) check(ctx context.Context, d *Dedup, queue, id string, mustExist bool) bool {
	if p.state.Load() != placeUnknown {
		return false
	}
	exists, queueKnown, err := d.store.TaskSeen(ctx, queue, id)
	switch {
	case err != nil:
		return false
	case exists:
		p.state.Store(placeHere)
		return false
	case mustExist || !queueKnown:
		if p.state.CompareAndSwap(placeUnknown, placeElsewhere) {
			d.log.Error("dedup: tasks are stored in another Redis than the Dedup's; deduplicated calls are refused from now on (ErrTasksElsewhere)", slog.String("queue", queue), slog.String("task_id", id))
			return true
		}
	default:
		if p.checks.Add(1) >= maxPlaceChecks {
			p.state.CompareAndSwap(placeUnknown, placeHere)
		}
	}
	return false
}
