package dedup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// DefaultHeartbeat is how often the heartbeat looks at the running
// handlers: a handler that has run this long gets its key's lifetime
// extended (to its TTL from then, and again each time half of that has
// passed), so a lock never expires under a handler however long it runs,
// while the short handlers that are most of them cost nothing.
const DefaultHeartbeat = 10 * time.Second

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
	return &heartbeater{d: d, interval: interval, entries: map[*lease]*beat{}, quit: make(chan struct{}), done: make(chan struct{})}
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
		}
	}
}

// due lists the attempts whose keys need extending at now: running for at
// least one interval, and not extended within half their TTL.
func (h *heartbeater) due(now time.Time) []*lease {
	h.mu.Lock()
	defer h.mu.Unlock()
	var ls []*lease
	for l, b := range h.entries {
		if now.Sub(b.since) >= h.interval && (b.extended.IsZero() || now.Sub(b.extended) >= l.ttl/2) {
			b.extended = now
			ls = append(ls, l)
		}
	}
	return ls
}

// beat extends the keys of the attempts due.
func (h *heartbeater) beat(now time.Time) {
	d := h.d
	ls := h.due(now)
	if len(ls) == 0 {
		return
	}
	ctx := context.Background()
	es := make([]*store.Extend, 0, len(ls))
	keyed := ls[:0]
	for _, l := range ls {
		if !d.findLock(ctx, l) {
			continue // (a plain task whose record names no lock)
		}
		es = append(es, &store.Extend{Ref: l.ref, TTL: l.ttl})
		keyed = append(keyed, l)
	}
	for i, r := range d.store.ExtendAll(ctx, es) {
		switch {
		case r.Err != nil:
			// Extension errors never fail a task; the next beat tries again.
			d.count(keyed[i].ref.Type, evRedisError)
			d.log.Warn("dedup: heartbeat failed", slog.String("task_id", keyed[i].ref.ID), slog.Any("error", r.Err))
			h.again(keyed[i])
		case !r.Owned:
			h.lost(keyed[i])
		}
	}
}

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
