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
// A lock is released only while it holds its attempt's value (its token,
// store.StartValue): a release that arrives late, after a later attempt
// of the task or a later task under the same caller-chosen ID took the key,
// leaves that lock alone. Stats counts the success released, lock_lost or
// redis_error once the call has answered.
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
	taken store.Taken
	ttl   time.Duration
}

// releasedTogether reports whether an attempt that ended so is released
// with others (releases).
func (l *lease) releasedTogether(s *store.Settle) bool {
	return l.arrived && l.mode == nil && s.End == store.EndSuccess && s.Release && !l.outlivedMark.Load() &&
		l.held == store.StartValue(l.ref.ID, l.token) // (else a lock it met as its own, of another value: settled)
}

// add queues the lock of a success for its release, or reports false after
// close (the caller settles it itself).
func (p *releases) add(l *lease, ttl time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.batch = append(p.batch, pending{taken: store.Taken{Ref: l.ref, Value: l.held}, ttl: ttl})
	if !p.armed {
		p.armed = true
		p.sent.Add(1)
		time.AfterFunc(releaseDelay, p.send)
	}
	return true
}

// send releases the batch, within LockTimeout, and counts what became of
// each lock; one left to a settle call is settled.
func (p *releases) send() {
	defer p.sent.Done()
	p.mu.Lock()
	batch := p.batch
	p.batch, p.armed = nil, false
	p.mu.Unlock()
	ts := make([]store.Taken, len(batch))
	for i := range batch {
		ts[i] = batch[i].taken
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.d.cfg.LockTimeout)
	defer cancel()
	out, err := p.d.store.ReleaseAll(ctx, ts)
	if err != nil {
		p.d.log.Warn("dedup: could not release the locks of tasks that arrived without one and succeeded; each heals at its key's next use", slog.Int("locks", len(ts)), slog.Any("error", err))
	}
	for i, o := range out {
		r := &batch[i].taken.Ref
		switch o {
		case store.ReleasedNow:
			p.d.count(r.Type, evReleased)
		case store.ReleasedFailed:
			p.d.count(r.Type, evRedisError)
		case store.ReleasedNot:
			p.d.count(r.Type, evLockLost)
			p.d.log.Warn("dedup: lock was no longer this task's at the end", slog.String("type", r.Type), slog.String("task_id", r.ID))
		case store.ReleasedLeft:
			p.settle(ctx, &batch[i])
		}
	}
}

// settle ends a success whose lock has a mode record beside it.
func (p *releases) settle(ctx context.Context, x *pending) {
	r := x.taken.Ref
	res, err := p.d.store.Settle(ctx, &store.Settle{Ref: r, End: store.EndSuccess, TTL: x.ttl, Release: true, Value: x.taken.Value})
	p.d.report(r.Type, &lease{ref: r}, res, err, true, 0)
}

// close makes later successes settle themselves and waits for the
// releases under way.
func (p *releases) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.sent.Wait()
}
