package dedup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// heartbeater renews the leases of all running attempts of one Dedup with a
// single goroutine and one pipelined round trip per interval (per cluster
// node), however many handlers run.
//
// Invariant: a lease is in entries from just after its attempt took the lock
// until just before the attempt settles it, so a renewal that finds the lock
// released by its own settle is never reported as a loss.
type heartbeater struct {
	d        *Dedup
	interval time.Duration

	mu       sync.Mutex
	entries  map[*lease]struct{}
	rechecks []recheck
	started  bool
	quit     chan struct{}
	done     chan struct{}
}

func newHeartbeater(d *Dedup, interval time.Duration) *heartbeater {
	return &heartbeater{d: d, interval: interval, entries: map[*lease]struct{}{}, quit: make(chan struct{}), done: make(chan struct{})}
}

// run starts the loop once; later calls do nothing.
func (h *heartbeater) run() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.started {
		return
	}
	select {
	case <-h.quit:
		h.d.log.Error("dedup: Middleware used after Close: locks of running handlers will not be renewed")
		return
	default:
	}
	h.started = true
	go h.loop()
}

// stop ends the loop and waits for it. Idempotent.
func (h *heartbeater) stop() {
	h.mu.Lock()
	select {
	case <-h.quit:
	default:
		close(h.quit)
	}
	started := h.started
	h.mu.Unlock()
	if started {
		<-h.done
	}
}

// recheck is a lock to settle again at the next beats: held on a guess of
// what asynq would do with an attempt it gave up (see Dedup.finishOf), to
// settle by the task's record once asynq has written it; or one whose
// settle call failed (Redis refused it during a slot migration, or was
// unreachable a moment); or a watch (store.Finish.Watch): a lock held for
// the task's retry that owes a follow-up, released to the follow-up as
// soon as an operator deletes or archives the waiting task, and watched
// for as long as the hold lasts (until the retry starts or the lock
// expires). A watch lives in this process only: after a restart the
// follow-up is queued by the key's next enqueue, by dedupctl doctor --fix,
// or when its parked time comes.
type recheck struct {
	st   *store.Store // of the lock's prefix
	f    store.Finish
	left int // beats to try before leaving it to heal (not for a watch)
}

// maxRechecks bounds the beats a recheck is tried.
const maxRechecks = 3

// recheckConcurrency bounds the rechecks in flight at once (the batcher
// sends them together).
const recheckConcurrency = 32

// recheck settles f again, without its attempt's token, at the next beats.
func (h *heartbeater) recheck(st *store.Store, f *store.Finish) {
	rc := recheck{st: st, f: *f, left: maxRechecks}
	rc.f.Token = ""
	h.queue(rc)
}

// watch watches the lock f held for its task's retry, which owes the
// follow-up owes.
func (h *heartbeater) watch(st *store.Store, f *store.Finish, owes string) {
	h.queue(watchOf(st, f, owes))
}

func watchOf(st *store.Store, f *store.Finish, owes string) recheck {
	return recheck{st: st, f: store.Finish{Ref: f.Ref, Watch: true, Follow: owes, FollowTTL: f.FollowTTL}}
}

// retry settles f again, as it was (with its attempt's token), at the next
// beats: its settle call failed.
func (h *heartbeater) retry(st *store.Store, f *store.Finish) {
	h.queue(recheck{st: st, f: *f, left: maxRechecks})
}

func (h *heartbeater) queue(rc recheck) {
	h.mu.Lock()
	h.rechecks = append(h.rechecks, rc)
	h.mu.Unlock()
}

func (h *heartbeater) add(l *lease) {
	h.mu.Lock()
	h.entries[l] = struct{}{}
	h.mu.Unlock()
}

// remove unregisters l and reports whether it was still registered (its
// loss not yet reported).
func (h *heartbeater) remove(l *lease) bool {
	h.mu.Lock()
	_, live := h.entries[l]
	delete(h.entries, l)
	h.mu.Unlock()
	return live
}

func (h *heartbeater) loop() {
	defer close(h.done)
	t := time.NewTicker(h.interval)
	defer t.Stop()
	for {
		select {
		case <-h.quit:
			return
		case <-t.C:
			h.beat()
			h.settleGuesses()
		}
	}
}

// beat renews every registered lease in one pipeline.
func (h *heartbeater) beat() {
	h.mu.Lock()
	ls := make([]*lease, 0, len(h.entries))
	for l := range h.entries {
		ls = append(ls, l)
	}
	h.mu.Unlock()
	byStore := map[*store.Store][]*lease{} // (one Store but where a producer's prefix differs: prefix.go)
	for _, l := range ls {
		byStore[l.st] = append(byStore[l.st], l)
	}
	for st, ls := range byStore {
		h.renew(st, ls)
	}
}

// renew renews the leases of one Store's locks in one pipeline.
func (h *heartbeater) renew(st *store.Store, ls []*lease) {
	d := h.d
	es := make([]*store.Extend, len(ls))
	for i, l := range ls {
		es[i] = &store.Extend{Ref: l.ref, Token: l.token, TTL: d.cfg.Lease}
	}
	for i, r := range st.ExtendAll(context.Background(), es) {
		switch {
		case r.Err != nil:
			// Renewal errors never fail a task; the lease may still be renewed in time.
			d.count(ls[i].ref.Type, evRedisError)
			d.log.Warn("dedup: heartbeat failed", slog.String("task_id", ls[i].ref.ID), slog.Any("error", r.Err))
		case !r.Renewed:
			h.lost(ls[i])
		}
	}
}

// settleGuesses settles again the locks held on a guess (the task's
// record now says whether asynq retried or finished it), tries again the
// settles that failed, and checks the watches.
func (h *heartbeater) settleGuesses() {
	h.mu.Lock()
	rs := h.rechecks
	h.rechecks = nil
	h.mu.Unlock()
	var (
		mu    sync.Mutex
		again []recheck
		wg    sync.WaitGroup
		slots = make(chan struct{}, recheckConcurrency)
	)
	for _, rc := range rs {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if next, keep := h.settleOne(rc); keep {
				mu.Lock()
				again = append(again, next)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(again) > 0 {
		h.mu.Lock()
		h.rechecks = append(h.rechecks, again...)
		h.mu.Unlock()
	}
}

// settleOne settles one recheck, and says what to check at the next beat.
func (h *heartbeater) settleOne(rc recheck) (recheck, bool) {
	d := h.d
	res, err := rc.st.Finish(context.Background(), &rc.f)
	switch {
	case rc.f.Watch && (err != nil || res.Held):
		return rc, true
	case err != nil || (res.Held && res.Guessed):
		rc.left--
		return rc, rc.left > 0
	case res.Held && res.Owes != "":
		return watchOf(rc.st, &rc.f, res.Owes), true // settled as held for the retry
	case res.Cooling:
		d.count(rc.f.Ref.Type, evCooling)
	case res.Failed:
		d.count(rc.f.Ref.Type, evFailureHeld)
	case res.Owned && !res.Held:
		d.count(rc.f.Ref.Type, evReleased)
	}
	return rc, false
}

// lost reports a lease whose lock is gone, unless its attempt already ended.
func (h *heartbeater) lost(l *lease) {
	h.mu.Lock()
	_, live := h.entries[l]
	delete(h.entries, l)
	h.mu.Unlock()
	if !live {
		return
	}
	d := h.d
	d.count(l.ref.Type, evLockLost)
	d.log.Warn("dedup: lock lost while the handler runs", slog.String("type", l.ref.Type), slog.String("task_id", l.ref.ID), slog.Bool("cancelled", d.cfg.CancelOnLockLoss))
	if d.cfg.CancelOnLockLoss {
		l.cancel(ErrLockLost)
	}
}
