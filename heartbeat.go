package dedup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// defaultHeartbeat is how often the heartbeat looks at the running
// handlers: a handler that has run this long gets its key's lifetime
// extended (to its TTL from then, and again each time half of that has
// passed), so a lock never expires under a handler however long it runs,
// while the short handlers that are most of them cost nothing.
const defaultHeartbeat = 10 * time.Second

// heartbeater extends the locks of the long-running attempts of one Dedup,
// from one goroutine.
//
// Invariant: an attempt is in entries from just before its handler runs
// until just after it returns, so an extension that finds the key settled
// by its own attempt is never reported as a loss.
type heartbeater struct {
	d        *Dedup
	interval time.Duration

	mu      sync.Mutex
	entries map[*lease]*beat
	watches map[string]watch // by lock key
	started bool
	quit    chan struct{}
	done    chan struct{}
}

// beat is one running attempt's times.
type beat struct {
	since    time.Time // when its handler started
	extended time.Time // when its key's lifetime was last extended; zero: never
}

func newHeartbeater(d *Dedup, interval time.Duration) *heartbeater {
	return &heartbeater{d: d, interval: interval, entries: map[*lease]*beat{}, watches: map[string]watch{}, quit: make(chan struct{}), done: make(chan struct{})}
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
		h.d.log.Error("dedup: Middleware used after Close: locks of long-running handlers will not be extended")
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

func (h *heartbeater) add(l *lease) {
	h.mu.Lock()
	h.entries[l] = &beat{since: time.Now()}
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
		case now := <-t.C:
			h.beat(now)
			h.checkWatches(now)
		}
	}
}

// due lists the attempts whose keys need extending at now: running for at
// least one interval, and not extended within half their TTL; and, at every
// beat, those whose key notes that asynq gave their attempt up (the note
// lapses unless renewed, noteLife).
func (h *heartbeater) due(now time.Time) []*lease {
	h.mu.Lock()
	defer h.mu.Unlock()
	var ls []*lease
	for l, b := range h.entries {
		if l.outlivedMark.Load() || now.Sub(b.since) >= h.interval && (b.extended.IsZero() || now.Sub(b.extended) >= l.ttl/2) {
			b.extended = now
			ls = append(ls, l)
		}
	}
	return ls
}

// beat extends the keys of the attempts due.
func (h *heartbeater) beat(now time.Time) {
	ls := h.due(now)
	if len(ls) == 0 {
		return
	}
	ctx := context.Background()
	var plain []*lease
	var es []*store.Extend
	for _, l := range h.keyed(ctx, ls) {
		if l.outlivedMark.Load() {
			h.check(l, h.renewNote(ctx, l))
			continue
		}
		plain = append(plain, l)
		es = append(es, &store.Extend{Ref: l.ref, TTL: l.ttl})
	}
	for i, r := range h.d.store.ExtendAll(ctx, es) {
		h.check(plain[i], r)
	}
}

// renewNote extends the key of an attempt asynq gave up, renewing the note
// that its handler still runs, under the lease's lock: once the handler has
// returned, no renewal starts and none is under way, so the note its
// settle clears stays cleared (the next attempt of the task, under the same
// ID, may hold the key by then).
func (h *heartbeater) renewNote(ctx context.Context, l *lease) store.ExtendResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.returned {
		return store.ExtendResult{Owned: true} // (its settle follows)
	}
	ttl := l.ttl
	if l.settledEarly {
		// Its fail hold is the key's lifetime now (failNow): lengthened
		// only where it would end while the handler still runs, which
		// keeps the key as long as the note does.
		ttl = h.noteLife()
	}
	return h.d.store.ExtendAll(ctx, []*store.Extend{{Ref: l.ref, TTL: ttl, Outlived: h.noteLife(), Note: l.note}})[0]
}

// check acts on one extension's result: an error is tried again at the
// next beat (extension errors never fail a task); a key no longer the
// task's is a loss.
func (h *heartbeater) check(l *lease, r store.ExtendResult) {
	switch {
	case r.Err != nil:
		h.d.count(l.ref.Type, evRedisError)
		h.d.log.Warn("dedup: heartbeat failed", slog.String("task_id", l.ref.ID), slog.Any("error", r.Err))
		h.again(l)
	case !r.Owned:
		h.lost(l)
	}
}

// keyed returns the attempts of ls whose lock is known, reading a plain
// task's from its record the first time (as many at once as ExtendAll
// extends). One whose record could not be read is tried again at the next
// beat; one whose record names no lock has none to extend.
func (h *heartbeater) keyed(ctx context.Context, ls []*lease) []*lease {
	found := make([]bool, len(ls))
	var wg sync.WaitGroup
	slots := make(chan struct{}, lookupConcurrency)
	for i, l := range ls {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			ok, err := h.d.lockOf(ctx, l)
			if err != nil {
				h.d.count(l.ref.Type, evRedisError)
				h.d.log.Warn("dedup: heartbeat could not read a task's lock", slog.String("task_id", l.ref.ID), slog.Any("error", err))
				h.again(l)
			}
			found[i] = ok
		})
	}
	wg.Wait()
	out := ls[:0]
	for i, l := range ls {
		if found[i] {
			out = append(out, l)
		}
	}
	return out
}

// noteLife is how long a note that asynq gave an attempt up while its
// handler runs lasts unless the next beats renew it: a handler whose worker
// died holds its key this long at most.
func (h *heartbeater) noteLife() time.Duration { return 3 * h.interval }

// lookupConcurrency bounds the lock reads one beat makes at once.
const lookupConcurrency = 16

// again makes a failed extension due at the next beat.
func (h *heartbeater) again(l *lease) {
	h.mu.Lock()
	if b, ok := h.entries[l]; ok {
		b.extended = time.Time{}
	}
	h.mu.Unlock()
}

// lost reports an attempt whose key is no longer its task's, unless the
// attempt already ended.
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

// A watch is a key held for its task's retry that owes a follow-up
// (RunningDefer): should an operator delete or archive the waiting task,
// the follow-up, which carries the newest payload, is queued at the next
// heartbeat rather than when its parking time ends. A watch lives in this
// process only, until the retry is due.
type watch struct {
	ref    store.Ref // the task waiting for its retry, and its lock
	follow string
	until  time.Time
}

// watchRetryMargin is how long past a retry's due time its watch is kept.
const watchRetryMargin = 5 * time.Second

// watch watches the key of ref, held for ref's retry, which owes follow.
func (h *heartbeater) watch(ref store.Ref, follow string, due time.Duration) {
	h.mu.Lock()
	h.watches[ref.Lock] = watch{ref: ref, follow: follow, until: time.Now().Add(due + watchRetryMargin)}
	h.mu.Unlock()
}

// checkWatches queues the follow-ups of watched keys whose task cannot run
// any more (lockview's doctor --fix semantics: store.ReleaseStuck), and
// drops the watches that are done.
func (h *heartbeater) checkWatches(now time.Time) {
	h.mu.Lock()
	ws := make([]watch, 0, len(h.watches))
	for _, w := range h.watches {
		ws = append(ws, w)
	}
	h.mu.Unlock()
	for _, w := range ws {
		if !h.checkWatch(w, now) {
			h.mu.Lock()
			delete(h.watches, w.ref.Lock)
			h.mu.Unlock()
		}
	}
}

// checkWatch checks one watch and reports whether to keep it.
func (h *heartbeater) checkWatch(w watch, now time.Time) bool {
	d := h.d
	// (No grace: the task was stored, it ran.)
	rel := &store.Release{Lock: w.ref.Lock, Queue: w.ref.Queue, Type: w.ref.Type, How: store.ReleaseStuck, Holder: w.ref.ID}
	v, err := d.store.Do(context.Background(), w.ref.Lock, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return store.ReleaseKey(c, rdb, rel)
	})
	res, _ := v.(store.ReleaseResult)
	switch {
	case err != nil:
		return now.Before(w.until) // tried again at the next beat
	case res.Released:
		d.log.Info("dedup: a task waiting for its retry is gone: the follow-up it owed is queued", slog.String("task_id", w.ref.ID), slog.String("follow_up", res.Queued))
		return false
	}
	return res.Kept != "" && store.Waiting(res.Kept) && now.Before(w.until)
}
