package dedup

import (
	"context"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Released together. A task that arrived without a lock (the execution
// guard) takes one as it starts, which asynq's scripts never release: its
// asynq record does not name it. When such an attempt succeeds and its key
// keeps no mode record (no cooldown, no fail hold, no follow-up, no
// MaxPending), its end makes no call of its own: its lock is released with
// those of the other successes ending at the same moment, by one call per
// queue (store.ReleaseAll), each if it still holds the value its attempt
// took. The handler's result reaches asynq once that call has answered, so
// the lock is gone before asynq records the success, as with a settle.
//
// Batching is a group commit: a success that finds no call under way sends
// one, with every success queued by then; those that arrive meanwhile wait
// for the next, which the first sender starts on its own goroutine. So a
// lone success makes one call, and many share one.
//
// A lock is released only while it holds its attempt's value (its token,
// store.StartValue): a release that arrives late (a call cut off at its
// deadline yet run) leaves a later attempt's lock alone. A lock with a mode
// record beside it by then is settled as before. Unlike a settle, the
// release does not mark the task's record ended: a shutdown between the
// handler's return and asynq's done runs the task again, as it would a
// plain asynq task.
//
// Invariants: every queued success is answered exactly once (its done
// channel closed) by the send that took it; at most one send is under way;
// close waits for it.

// releases collects the successes that are released together.
type releases struct {
	d       *Dedup
	mu      sync.Mutex
	queue   []*pending
	sending bool // a send is under way; it takes the queue when it ends
	closed  bool
	idle    sync.Cond // signalled when sending ends (close waits on it)
}

// pending is one success waiting for its release: what a settle needs,
// should its lock have a mode record beside it.
type pending struct {
	taken store.Taken
	ttl   time.Duration
	res   store.SettleResult // what became of its lock, once done is closed
	err   error
	done  chan struct{}
}

func newReleases(d *Dedup) *releases {
	p := &releases{d: d}
	p.idle.L = &p.mu
	return p
}

// releasedTogether reports whether an attempt that ended so is released
// with others (releases).
func (l *lease) releasedTogether(s *store.Settle) bool {
	return l.arrived && l.mode == nil && s.End == store.EndSuccess && s.Release && !l.outlivedMark.Load() &&
		l.held == store.StartValue(l.ref.ID, l.token) // (else a lock it met as its own, of another value: settled)
}

// release releases the lock of a success with the others of the moment and
// returns, once that is done (or failed, within LockTimeout), the success
// with what became of its lock; nil after close, when the caller settles
// it itself.
func (p *releases) release(l *lease, ttl time.Duration) *pending {
	x := &pending{taken: store.Taken{Ref: l.ref, Value: l.held}, ttl: ttl, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.queue = append(p.queue, x)
	first := !p.sending
	p.sending = true
	p.mu.Unlock()
	if first {
		p.sendQueued()
		go p.drain() // (those queued meanwhile)
	}
	<-x.done
	return x
}

// drain sends what was queued during earlier sends, until nothing is.
func (p *releases) drain() {
	for p.sendQueued() {
	}
}

// sendQueued sends the queue, if any, and reports whether it sent; with
// nothing queued, the send under way ends.
func (p *releases) sendQueued() bool {
	p.mu.Lock()
	batch := p.queue
	p.queue = nil
	if len(batch) == 0 {
		p.sending = false
		p.idle.Broadcast()
	}
	p.mu.Unlock()
	if len(batch) == 0 {
		return false
	}
	p.send(batch)
	return true
}

// send releases a batch, within LockTimeout (a lock left to a settle call
// is settled), and answers each success with what became of its lock,
// counted and logged as a settle's end is (report).
func (p *releases) send(batch []*pending) {
	ts := make([]store.Taken, len(batch))
	for i, x := range batch {
		ts[i] = x.taken
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.d.cfg.LockTimeout)
	defer cancel()
	out, err := p.d.store.ReleaseAll(ctx, ts)
	for i, x := range batch {
		r := x.taken.Ref
		switch out[i] {
		case store.ReleasedNow:
			x.res = store.SettleResult{Owned: true, Released: true}
		case store.ReleasedFailed:
			x.err = err
		case store.ReleasedLeft:
			x.res, x.err = p.d.store.Settle(ctx, &store.Settle{Ref: r, End: store.EndSuccess, TTL: x.ttl, Release: true, Value: x.taken.Value})
		} // (store.ReleasedNot: the zero result, not the task's)
		p.d.report(r.Type, &lease{ref: r}, x.res, x.err, true, 0)
		close(x.done)
	}
}

// close makes later successes settle themselves and waits for the send
// under way.
func (p *releases) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for p.sending {
		p.idle.Wait()
	}
}
