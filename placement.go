package dedup

import (
	"context"
	"log/slog"
	"sync/atomic"
)

// placement records whether the tasks a WrapClient's enqueuer stores live
// in the Dedup's own Redis. The lock is a cache of asynq's record of its
// holder task, read in the same script (healing, Replace, follow-ups, how
// an attempt asynq gave up ended): with the tasks in another Redis every
// holder would look gone, and live locks would heal the heal grace after they
// were taken. So that setup is refused, not weakened. (The middleware
// checks the same per task, in its start script: the running task's
// record must be there.)
//
// The state moves once, from unknown to here or elsewhere. While it is
// unknown, accepted enqueues are probed: the first maxPlaceProbes of them,
// then one in maxPlaceProbes.
type placement struct {
	state atomic.Int32
	calls atomic.Int64
}

const (
	placeUnknown int32 = iota
	placeHere
	placeElsewhere
)

const maxPlaceProbes = 64

// refused returns an error matching ErrTasksElsewhere once the tasks were
// found in another Redis, else nil.
func (p *placement) refused() error {
	if p.state.Load() != placeElsewhere {
		return nil
	}
	return errorf("%w: the enqueuer given to WrapClient stores its tasks in another Redis than the Dedup's; use one Redis (or one Cluster) for both", ErrTasksElsewhere)
}

// placeProbe is what an enqueue read before it enqueued: how many tasks of
// its queue asynq had completed in the Dedup's Redis.
type placeProbe struct {
	queue     string
	processed int64
	ok        bool
}

// before starts a probe of the call's queue, if one is due.
func (p *placement) before(ctx context.Context, d *Dedup, queue string) placeProbe {
	if p.state.Load() != placeUnknown {
		return placeProbe{}
	}
	if n := p.calls.Add(1); n > maxPlaceProbes && n%maxPlaceProbes != 0 {
		return placeProbe{}
	}
	n, err := d.store.Processed(ctx, queue)
	return placeProbe{queue: queue, processed: n, ok: err == nil}
}

// after finishes a probe once task id was enqueued in the probed queue. The
// task's record here decides "here". Its absence decides "elsewhere" only
// if no task of the queue completed here meanwhile: a fast worker may have
// run and deleted it (asynq counts every completion, deleted or kept).
// A Redis error decides nothing.
func (p *placement) after(ctx context.Context, d *Dedup, pr placeProbe, queue, id string) {
	if !pr.ok || queue != pr.queue || p.state.Load() != placeUnknown {
		return
	}
	exists, processed, err := d.store.TaskTrace(ctx, queue, id)
	switch {
	case err != nil:
	case exists:
		p.state.CompareAndSwap(placeUnknown, placeHere)
	case processed == pr.processed:
		if p.state.CompareAndSwap(placeUnknown, placeElsewhere) {
			d.log.Error("dedup: WrapClient's enqueuer stores tasks in another Redis than the Dedup's; deduplicated calls are refused from now on (ErrTasksElsewhere)", slog.String("queue", queue), slog.String("task_id", id))
		}
	}
}
