package dedup

import (
	"context"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// releaser releases the locks of attempts that ended for good (success,
// revoked, final failure) while asynq still ran them, of a key the wrapper
// chose the ID of (no index key to settle), owing no follow-up they knew of
// and of a rule without a cooldown (store.DoneAll), off the handler's path:
// a processed task waits for no release of its own. A release waits up to
// releaseLinger for company, and then every release of its queue waiting
// goes in one call (a call's cost is mostly fixed: a round trip, a script
// run), so under load one call carries tens. Each queue has at most one call
// out, and no queue's call waits for another's.
//
// Until the release lands the key reads as held by a task that is done: the
// acquire script finds its record gone (or completed or archived) and takes
// the key at once. A release left unsent when the process dies leaves such
// a lock until its running lease ends (Lease).
type releaser struct {
	d        *Dedup
	mu       sync.Mutex
	pending  map[string][]release // by queue: one call's locks share a slot
	inflight map[string]bool      // queues with a call out: theirs wait for the next
	wake     chan struct{}        // buffered: a release was added, or a call came back
	quit     chan struct{}
	done     chan struct{}
	started  bool
	sends    sync.WaitGroup
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
	return &releaser{d: d, pending: map[string][]release{}, inflight: map[string]bool{},
		wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
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
	r.mu.Lock()
	select {
	case <-r.quit: // (read under mu: stop sees every release added before)
		r.mu.Unlock()
		r.send([]release{rl})
		return
	default:
	}
	q := rl.f.Ref.Queue
	r.pending[q] = append(r.pending[q], rl)
	r.mu.Unlock()
	r.poke()
}

func (r *releaser) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// stop sends what is pending, ends the loop and waits for every call out.
// Idempotent.
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
	for {
		r.sends.Wait()
		if !r.dispatch() {
			return
		}
	}
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
			r.dispatch()
		case <-r.quit:
			return
		}
	}
}

// dispatch sends each queue's pending releases, unless a call of that queue
// is out (its releases go when it comes back), each queue's on its own
// goroutine: a queue whose master hangs holds up only its own. It reports
// whether it sent any.
func (r *releaser) dispatch() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	sent := false
	for q, rs := range r.pending {
		if r.inflight[q] {
			continue
		}
		delete(r.pending, q)
		r.inflight[q], sent = true, true
		r.sends.Go(func() {
			r.send(rs)
			r.mu.Lock()
			delete(r.inflight, q)
			more := len(r.pending[q]) > 0
			r.mu.Unlock()
			if more {
				r.poke()
			}
		})
	}
	return sent
}

// send releases rs (one queue's), maxDoneBatch locks per call.
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
			rl.f.Begun = false // (done has just declined: straight to finish)
			fres, err := st.Finish(ctx, &rl.f)
			d.report(st, &rl.f, fres, err, rl.live)
		default:
			d.report(st, &rl.f, store.FinishResult{Owned: res.Released}, res.Err, rl.live)
		}
	}
}
