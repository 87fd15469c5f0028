package dedup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Released together. A task that arrived without a lock (the execution guard) takes one
// as it starts, which asynq's scripts never release: its asynq record does
// not name it. When such an attempt succeeds and its key keeps no mode
// record (no cooldown, no fail hold, no follow-up, no MaxPending), the
// end is no call of its own: the lock joins those of the other successes of
// the next releaseDelay, and one call per queue releases them all, each if
// it is still its task's (store.ReleaseAll). A lock that has a mode record beside
// it by then (a follow-up another type's enqueue made meanwhile) is settled
// as before.
//
// Until it is released, the lock names a task whose asynq record soon says
// completed or is gone, which every enqueue and start that meets it takes
// as a key to heal at once; a worker that stops without Close leaves its
// last locks to that. Unlike a settle, this release does not mark the
// task's record ended: a shutdown between the handler's return and asynq's
// done runs the task again, as it would a plain asynq task.
//
// Invariants: a lock added before close is sent exactly once, by the timer
// armed when the first of its batch was added; close waits for that timer.

// releaseDelay is how long a success's lock waits for others to share its call.
const releaseDelay = 2 * time.Millisecond

// releases collects the locks of successes that are released together.
type releases struct {
	d      *Dedup
	mu     sync.Mutex
	batch  []pending
	armed  bool // a timer will send batch
	closed bool
	sent   sync.WaitGroup // armed timers
}

// pending is one success waiting for its release: what a settle needs,
// should its lock have a mode record beside it.
type pending struct {
	ref store.Ref
	ttl time.Duration
}

// releasedTogether reports whether an attempt that ended so is released
// with others (releases).
func (l *lease) releasedTogether(s *store.Settle) bool {
	return l.arrived && l.mode == nil && s.End == store.EndSuccess && s.Release && !l.outlivedMark.Load()
}

// add queues the lock of a success for its release, or reports false after
// close (the caller settles it itself).
func (p *releases) add(ref store.Ref, ttl time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.batch = append(p.batch, pending{ref: ref, ttl: ttl})
	if !p.armed {
		p.armed = true
		p.sent.Add(1)
		time.AfterFunc(releaseDelay, p.send)
	}
	return true
}

// send releases the batch, within LockTimeout, and settles the locks left to
// a settle call.
func (p *releases) send() {
	defer p.sent.Done()
	p.mu.Lock()
	batch := p.batch
	p.batch, p.armed = nil, false
	p.mu.Unlock()
	refs := make([]store.Ref, len(batch))
	for i := range batch {
		refs[i] = batch[i].ref
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.d.cfg.LockTimeout)
	defer cancel()
	left, err := p.d.store.ReleaseAll(ctx, refs)
	if err != nil {
		p.d.count(refs[0].Type, evRedisError)
		p.d.log.Warn("dedup: could not release the locks of tasks that arrived without one and succeeded; each heals at its key's next use", slog.Int("locks", len(refs)), slog.Any("error", err))
	}
	for _, i := range left {
		p.settle(ctx, &batch[i])
	}
}

// settle ends a success whose lock has a mode record beside it.
func (p *releases) settle(ctx context.Context, x *pending) {
	res, err := p.d.store.Settle(ctx, &store.Settle{Ref: x.ref, End: store.EndSuccess, TTL: x.ttl, Release: true})
	switch {
	case err != nil:
		p.d.count(x.ref.Type, evRedisError)
		p.d.log.Warn("dedup: could not settle the lock at the end of an attempt", slog.String("type", x.ref.Type), slog.String("task_id", x.ref.ID), slog.Any("error", err))
	case res.Follow != "":
		p.d.log.Debug("dedup: follow-up queued", slog.String("type", x.ref.Type), slog.String("task_id", res.Follow))
	}
}

// close makes later successes settle themselves and waits for the
// releases under way.
func (p *releases) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.sent.Wait()
}
