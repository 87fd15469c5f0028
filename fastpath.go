package dedup

import (
	"context"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Free starts. Most tasks a worker runs were stored by NewClient together
// with their lock (the direct path), and that lock holds nothing but its
// owner: no follow-up, cooldown or MaxPending entry. For such a task asynq's
// own record already answers what a start would write down: the lock's
// owner runs while its record says active, and a worker that died is one
// whose asynq lease lapsed (the acquire script reads both). So its first
// attempt runs without a start script, its lock untouched (no attempt
// token); the heartbeat renews that lock from its first beat on, and a
// release is sent off the handler's path, many tasks' in one call
// (releaser, which releases every attempt's lock so when it can). A
// processed task then costs no Redis call of its own.
//
// An attempt starts free only when nothing but the lock's owner can be
// there to meet:
//   - the task ID says so (store.NewTimedLockedID: the producer wrote the
//     task with its lock, by a rule with no MaxPending, Cooldown or
//     RunningAllow) and says the lock lasts at least one Lease more: the
//     first beat (within Lease/3) renews it in time, with two thirds of a
//     Lease to spare for the clocks of producer and worker;
//   - it is the task's first attempt (a retry, which a crash or a lapsed
//     lease may have left behind a newer holder, starts as before);
//   - the server's own rule has no Cooldown or RunningAllow either;
//   - no operator released its lock while it waited (the release adds the
//     header store.ReleasedHeader to the waiting task's message);
//   - Lease is at least asynq's task lease (30 s), so a worker that dies
//     before the first beat leaves a lock freed within one Lease;
//   - the queue has no lock under another prefix (prefix.go).

// asynqLease is asynq's task lease: an active task whose lease lapsed
// belongs to a worker that died.
const asynqLease = 30 * time.Second

// startsFree reports whether locks taken by r hold nothing but their owner.
func (r *resolved) startsFree() bool {
	return r.maxPending == 0 && r.cooldown == 0 && r.running != RunningAllow
}

// freeStart returns the lease of an attempt that starts free, or nil.
func (d *Dedup) freeStart(ctx context.Context, queue, id string, t *asynq.Task, rule *resolved) *lease {
	until, ok := store.LockedUntil(id)
	if !ok || d.cfg.Lease < asynqLease || time.Until(until) < d.cfg.Lease || !rule.startsFree() {
		return nil
	}
	if _, released := t.Headers()[store.ReleasedHeader]; released {
		return nil
	}
	if n, _ := asynq.GetRetryCount(ctx); n != 0 {
		return nil
	}
	if len(d.otherPrefixes(ctx, queue)) > 0 {
		return nil
	}
	fp, _ := store.ParseLockedID(id)
	return &lease{ref: store.Ref{Queue: queue, FP: fp, ID: id, Type: t.Type()}, st: d.store, free: true}
}

// releaser releases the locks of attempts that ended for good (success,
// revoked, final failure) while asynq still ran them, of a key the wrapper
// chose the ID of (no index key to settle) and owing no follow-up they knew
// of (store.DoneAll), off the handler's path: a release waits up to
// releaseLinger for company, and every release waiting then goes in one
// call, so under load one call carries tens (a call's cost is mostly fixed:
// a round trip, a script run).
//
// Until the release lands the key reads as held by a task that is done: the
// acquire script finds its record gone (or completed or archived) and takes
// the key at once. A release left unsent when the process dies leaves such
// a lock until its TTL.
type releaser struct {
	d       *Dedup
	mu      sync.Mutex
	pending []release
	wake    chan struct{} // buffered: a pending release was added
	quit    chan struct{}
	done    chan struct{}
	started bool
}

// release is one lock to release, under the Dedup's own prefix.
type release struct {
	f    store.Finish
	live bool // the attempt's loss was not reported by the heartbeat
}

// maxDoneBatch bounds the locks of one done call.
const maxDoneBatch = 256

// releaseLinger is how long a release waits for others to share its call.
const releaseLinger = 2 * time.Millisecond

func newReleaser(d *Dedup) *releaser {
	return &releaser{d: d, wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// run starts the loop once; later calls do nothing.
func (r *releaser) run() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.started {
		r.started = true
		go r.loop()
	}
}

// add queues a release. After stop it is sent at once.
func (r *releaser) add(rl release) {
	select {
	case <-r.quit:
		r.send([]release{rl})
		return
	default:
	}
	r.mu.Lock()
	r.pending = append(r.pending, rl)
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// stop sends what is pending and ends the loop. Idempotent.
func (r *releaser) stop() {
	r.mu.Lock()
	select {
	case <-r.quit:
	default:
		close(r.quit)
	}
	started := r.started
	r.mu.Unlock()
	if started {
		<-r.done
	}
	r.send(r.take()) // added after the loop's last look
}

func (r *releaser) loop() {
	defer close(r.done)
	for {
		select {
		case <-r.wake:
			select {
			case <-time.After(releaseLinger):
			case <-r.quit:
			}
			r.send(r.take())
		case <-r.quit:
			r.send(r.take())
			return
		}
	}
}

func (r *releaser) take() []release {
	r.mu.Lock()
	defer r.mu.Unlock()
	rs := r.pending
	r.pending = nil
	return rs
}

// send releases rs, maxDoneBatch locks per call.
func (r *releaser) send(rs []release) {
	for len(rs) > 0 {
		n := min(len(rs), maxDoneBatch)
		r.sendBatch(rs[:n])
		rs = rs[n:]
	}
}

// sendBatch releases the locks of rs and reports each as settle does.
func (r *releaser) sendBatch(rs []release) {
	d, st := r.d, r.d.store
	ds := make([]store.Done, len(rs))
	for i := range rs {
		ds[i] = store.Done{Ref: rs[i].f.Ref, Token: rs[i].f.Token}
	}
	ctx := context.Background()
	for i, res := range st.DoneAll(ctx, ds) {
		rl := &rs[i]
		switch {
		case res.Finish: // a follow-up or a cooldown to settle
			fres, err := st.Finish(ctx, &rl.f)
			d.report(st, &rl.f, fres, err, rl.live)
		default:
			d.report(st, &rl.f, store.FinishResult{Owned: res.Released}, res.Err, rl.live)
		}
	}
}
