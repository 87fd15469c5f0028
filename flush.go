package dedup

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// defaultFlushInterval is the interval StartFlusher uses when given 0.
const defaultFlushInterval = 10 * time.Second

// StartFlusher starts adding this process's counters to totals in Redis
// every interval (default 10 s when 0), so that ReadStats
// sees the counts of every process that flushes. Each flush is one
// pipelined round trip (one per node on Redis Cluster) of HINCRBYs of what
// was counted since the last flush, into one hash per task type (and, by
// one script call per type, into that type's hash of the current minute,
// kept two hours, for the web overview), bounded by Config.LockTimeout; it runs on its own goroutine, never on an enqueue or
// a handler. A failed flush is
// logged and its counts are kept for the next one; Close stops the flusher
// and flushes one last time, and returns that flush's failure.
//
// A flush whose reply is lost after Redis applied it (a timeout, a dropped
// connection) is sent again, so the totals may count that interval twice;
// they never lose a count that a flush reported as done.
//
// Calling StartFlusher again replaces the interval. It fails with
// ErrInvalidOption for a negative interval or after Close.
func (d *Dedup) StartFlusher(interval time.Duration) error {
	if interval < 0 {
		return errorf("%w: flush interval %v is negative", ErrInvalidOption, interval)
	}
	if interval == 0 {
		interval = defaultFlushInterval
	}
	m := &d.stats
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errorf("%w: StartFlusher called after Close", ErrInvalidOption)
	}
	if m.flusher != nil {
		_ = m.flusher.stop() // flushes (logged); the next loop goes on from there
	}
	t := time.NewTicker(interval)
	m.flusher = startLoop(t.C, t.Stop, func() { _ = d.flushLogged() }, d.flushLogged)
	return nil
}

// flushLogged runs one flush bounded by LockTimeout, logs its failure
// (FlushStats does) and returns it.
func (d *Dedup) flushLogged() error {
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.LockTimeout)
	defer cancel()
	return d.FlushStats(ctx)
}

// FlushStats adds what this process counted since its last flush to the
// totals in Redis now, in one pipelined round trip. The flusher
// (StartFlusher) calls it on its interval; call it yourself to flush without
// one, such as before a short-lived process exits. Counts of a failed flush
// are kept for the next one. It fails with an error matching ErrUnavailable
// and its cause (the failed dial's error when Redis cannot be reached).
func (d *Dedup) FlushStats(ctx context.Context) error {
	m := &d.stats
	m.flushMu.Lock()
	defer m.flushMu.Unlock()
	err := d.flush(ctx)
	switch {
	case err != nil && !m.flushFailing:
		m.flushFailing = true
		d.log.Warn("dedup: could not flush stats to Redis; counts are kept for the next flush", slog.Any("error", err))
	case err != nil:
		d.log.Debug("dedup: stats flush failed again", slog.Any("error", err))
	case m.flushFailing:
		m.flushFailing = false
		d.log.Info("dedup: stats flush works again")
	}
	if err != nil {
		return unavailable("flush stats", err)
	}
	return nil
}

// flush sends the counts not yet in Redis; the caller holds flushMu. Only
// the counts of commands that succeeded are marked flushed, so a partial
// failure (a Cluster node down) neither loses nor repeats anything. Every
// type with new counts is added to the types set again, so the totals come
// back in full view after an operator deleted the keys.
func (d *Dedup) flush(ctx context.Context) error {
	ps := d.unflushed()
	if len(ps) == 0 {
		return nil
	}
	keys := d.store.Keys()
	types := make([]any, len(ps))
	minute := time.Now().Unix() / 60
	var sadd *redis.IntCmd
	cmds, err := d.store.Pipelined(ctx, "", func(p redis.Pipeliner) { // (the stats keys span nodes)
		for i, pt := range ps {
			types[i] = pt.typ
			var deltas []any // event, count pairs
			for e := range numEvents {
				if delta := pt.cur[e] - pt.base[e]; delta > 0 {
					pt.cmds[e] = p.HIncrBy(ctx, keys.Stats(pt.typ), eventNames[e], int64(delta))
					deltas = append(deltas, eventNames[e], int64(delta))
				}
			}
			store.AddMinuteStats(ctx, p, keys.StatsMinute(pt.typ, minute), deltas)
		}
		sadd = p.SAdd(ctx, keys.StatsTypes(), types...)
	})
	if cmds == nil {
		return err // not sent, or left at the deadline: nothing is known to be added
	}
	// The pipeline's own error comes first: a call a failed dial ended
	// (internal/store/reach.go) says so there, while its commands hold
	// only the cancellation.
	return cmp.Or(err, d.markFlushed(ps, sadd.Err()))
}

// pendingFlush is one type's counts not yet added in Redis, and its
// commands once queued.
type pendingFlush struct {
	typ  string
	cur  counts
	base *counts
	cmds [numEvents]*redis.IntCmd
}

// unflushed returns the types with counts not yet in Redis.
func (d *Dedup) unflushed() []*pendingFlush {
	m := &d.stats
	if m.flushed == nil {
		m.flushed = map[string]*counts{}
		m.inTypeSet = map[string]bool{}
	}
	var ps []*pendingFlush
	for typ, cur := range d.typeCounts() {
		base := m.flushed[typ]
		if base == nil {
			base = new(counts)
			m.flushed[typ] = base
		}
		if cur != *base || !m.inTypeSet[typ] {
			ps = append(ps, &pendingFlush{typ: typ, cur: cur, base: base})
		}
	}
	return ps
}

// markFlushed records the counts whose commands succeeded and returns the
// first failure.
func (d *Dedup) markFlushed(ps []*pendingFlush, saddErr error) error {
	first := saddErr
	for _, pt := range ps {
		for e, c := range pt.cmds {
			if c == nil {
				continue
			}
			if err := c.Err(); err != nil {
				first = cmp.Or(first, err)
				continue
			}
			pt.base[e] = pt.cur[e]
		}
		if saddErr == nil {
			d.stats.inTypeSet[pt.typ] = true
		}
	}
	return first
}

// ReadStats returns the totals per task type that every process with a
// flusher (Dedup.StartFlusher) has added to Redis under prefix (""
// means "dedup"), since the first flush. It needs no Dedup, so an
// operator tool can call it with any client of the same Redis. Counts a
// process has not flushed yet (at most one flush interval's) are missing.
// Delete the keys "<prefix>:stats:types" and "<prefix>:stats:type:<type>"
// to start the totals again. Hash fields that are not event names or do
// not hold a count are ignored. Errors match ErrUnavailable.
func ReadStats(ctx context.Context, rdb redis.UniversalClient, prefix string) (map[string]Stats, error) {
	if prefix == "" {
		prefix = defaultPrefix
	}
	keys := store.NewKeys(prefix)
	types, err := rdb.SMembers(ctx, keys.StatsTypes()).Result()
	if err != nil {
		return nil, unavailable("read stats", err)
	}
	out := make(map[string]Stats, len(types))
	if len(types) == 0 {
		return out, nil
	}
	cmds := make([]*redis.MapStringStringCmd, len(types))
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, typ := range types {
			cmds[i] = p.HGetAll(ctx, keys.Stats(typ))
		}
		return nil
	})
	for i, typ := range types {
		h, err := cmds[i].Result()
		if err != nil {
			return nil, unavailable("read stats", err)
		}
		out[typ] = statsOf(h)
	}
	return out, nil
}

// loop runs a function on every tick of a ticker on its own goroutine, and
// a last function when stopped.
type loop struct {
	quit    chan struct{}
	done    chan struct{}
	stopErr error // what the last function returned; read after done
}

// startLoop calls onTick for every value from tick until stop, then
// stopTick (if not nil) and onStop (if not nil).
func startLoop(tick <-chan time.Time, stopTick func(), onTick func(), onStop func() error) *loop {
	l := &loop{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		if stopTick != nil {
			defer stopTick()
		}
		for {
			select {
			case <-l.quit:
				if onStop != nil {
					l.stopErr = onStop()
				}
				return
			case <-tick:
				onTick()
			}
		}
	}()
	return l
}

// stop ends the loop, waits until its last function has returned, and
// returns that function's error.
func (l *loop) stop() error {
	close(l.quit)
	<-l.done
	return l.stopErr
}

// stopDiagnostics stops the hot-key reporter (logging its last, partial
// window) and the stats flusher (flushing one last time), and returns the
// failure of that last flush. Called by Close; idempotent (only the first
// call flushes). Start* calls after it fail.
func (d *Dedup) stopDiagnostics() error {
	m := &d.stats
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	if m.repLoop != nil {
		_ = m.repLoop.stop()
		m.repLoop = nil
		m.rep.Store(nil)
	}
	if m.flusher == nil {
		return nil
	}
	err := m.flusher.stop()
	m.flusher = nil
	if err != nil {
		return errorf("final stats flush failed: %w", err)
	}
	return nil
}
