package dedup

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// event is one countable thing that happened to a lock.
type event int

const (
	evLocked      event = iota // enqueue took a lock
	evDuplicate                // enqueue rejected as a duplicate
	evRollback                 // lock given back after asynq refused an enqueue
	evStarted                  // attempt ran holding its lock
	evBusy                     // attempt deferred or skipped by the execution-time guard
	evReleased                 // lock released
	evHeld                     // lock kept across a retry
	evLockLost                 // running attempt found its lock gone
	evRedisError               // failed lock call
	evFailOpen                 // call went on without a lock
	evUnguarded                // attempt ran unlocked: key not computable at execution
	evCoalesced                // enqueue replaced the payload of the waiting task (Replace)
	evMerged                   // enqueue merged into the waiting task's payload (Merge)
	evDeferred                 // enqueue folded into the follow-up of a running key (Defer)
	evOverBound                // enqueue of a new key refused: too many keys waiting (MaxPending)
	evProcessed                // attempt finished (any outcome) holding its lock
	evBreakerOpen              // circuit breaker opened (counted under type "")
	numEvents
)

// eventNames are the stable names of the events: the fields of the stats
// hashes in Redis (ReadStats), the keys of Stats.Map and the "event" label
// of the Prometheus collector. Never rename one: flushed totals would split.
var eventNames = [numEvents]string{
	evLocked:      "locked",
	evDuplicate:   "duplicate",
	evRollback:    "rollback",
	evStarted:     "started",
	evBusy:        "busy",
	evReleased:    "released",
	evHeld:        "held",
	evLockLost:    "lock_lost",
	evRedisError:  "redis_error",
	evFailOpen:    "fail_open",
	evUnguarded:   "unguarded",
	evCoalesced:   "coalesced",
	evMerged:      "merged",
	evDeferred:    "deferred",
	evOverBound:   "over_bound",
	evProcessed:   "processed",
	evBreakerOpen: "breaker_open",
}

// eventByName maps a name of eventNames back to its event.
var eventByName = func() map[string]event {
	m := make(map[string]event, numEvents)
	for e, n := range eventNames {
		m[n] = event(e)
	}
	return m
}()

// Stats is a snapshot of event counters: since New for this process (Stats,
// StatsByType), or since the first flush for all processes (ReadStats).
type Stats struct {
	Locked      uint64 // enqueues that took a lock ("locked")
	Duplicates  uint64 // enqueues rejected with DuplicateTaskError ("duplicate")
	Rollbacks   uint64 // locks given back after asynq refused an enqueue ("rollback")
	Started     uint64 // attempts that ran holding their lock ("started")
	Busy        uint64 // attempts deferred or skipped by the execution-time guard ("busy")
	Released    uint64 // locks released: success, revoke, final failure ("released")
	Held        uint64 // locks kept across a retry ("held")
	LockLost    uint64 // running attempts that found their lock gone ("lock_lost")
	RedisErrors uint64 // failed lock calls ("redis_error")
	FailOpen    uint64 // calls that went on without a lock, Config.FailOpen ("fail_open")
	Unguarded   uint64 // attempts run unlocked: key could not be computed at execution ("unguarded")
	Coalesced   uint64 // enqueues whose payload replaced a waiting task's, Replace ("coalesced")
	Merged      uint64 // enqueues merged into a waiting task's payload, Merge ("merged")
	Deferred    uint64 // enqueues folded into the follow-up of a running key, Defer ("deferred")
	OverBound   uint64 // new keys refused because MaxPending keys were waiting ("over_bound")
	Processed   uint64 // attempts that finished holding their lock ("processed")
	BreakerOpen uint64 // times the circuit breaker opened ("breaker_open")
}

// field returns the counter of s that counts e.
func (s *Stats) field(e event) *uint64 {
	switch e {
	case evLocked:
		return &s.Locked
	case evDuplicate:
		return &s.Duplicates
	case evRollback:
		return &s.Rollbacks
	case evStarted:
		return &s.Started
	case evBusy:
		return &s.Busy
	case evReleased:
		return &s.Released
	case evHeld:
		return &s.Held
	case evLockLost:
		return &s.LockLost
	case evRedisError:
		return &s.RedisErrors
	case evFailOpen:
		return &s.FailOpen
	case evUnguarded:
		return &s.Unguarded
	case evCoalesced:
		return &s.Coalesced
	case evMerged:
		return &s.Merged
	case evDeferred:
		return &s.Deferred
	case evOverBound:
		return &s.OverBound
	case evProcessed:
		return &s.Processed
	case evBreakerOpen:
		return &s.BreakerOpen
	}
	panic(fmt.Sprintf("dedup: unknown event %d", e))
}

// EventNames returns the names of the counters of Stats, in the order of
// its fields: "locked", "duplicate", "rollback", "started", "busy",
// "released", "held", "lock_lost", "redis_error", "fail_open", "unguarded",
// "coalesced", "merged", "deferred", "over_bound", "processed",
// "breaker_open". They are the
// keys of Stats.Map, the fields of the stats hashes in Redis and the "event"
// label of the Prometheus collector (package dedupprom).
func EventNames() []string {
	out := make([]string, numEvents)
	copy(out, eventNames[:])
	return out
}

// Map returns the counters keyed by their EventNames.
func (s Stats) Map() map[string]uint64 {
	out := make(map[string]uint64, numEvents)
	for e := range numEvents {
		out[eventNames[e]] = *s.field(e)
	}
	return out
}

type counts [numEvents]uint64

func (c *counts) stats() Stats {
	var s Stats
	for e := range numEvents {
		*s.field(e) = c[e]
	}
	return s
}

type counterSet [numEvents]atomic.Uint64

func (c *counterSet) load() counts {
	var out counts
	for e := range c {
		out[e] = c[e].Load()
	}
	return out
}

func (c *counterSet) snapshot() Stats {
	n := c.load()
	return n.stats()
}

// metrics keeps counters in memory, one set for the process and one per task
// type (counting is lock-free after a type's first event), and the
// diagnostics that read them: the stats flusher and the hot-key reporter.
type metrics struct {
	all    counterSet
	byType sync.Map // string → *counterSet

	// rep is the running hot-key reporter, nil when there is none, so that
	// noteCoalesced costs one atomic load when reporting is off.
	rep atomic.Pointer[reporter]

	mu      sync.Mutex // guards flusher, repLoop and closed
	flusher *loop
	repLoop *loop
	closed  bool

	flushMu      sync.Mutex         // serialises flushes; guards the fields below
	flushed      map[string]*counts // per type: the counts already added in Redis
	inTypeSet    map[string]bool    // per type: added to the types set at least once
	flushFailing bool               // the last flush failed (log once per outage)
}

// count records one event for a task type.
func (d *Dedup) count(typ string, e event) {
	d.stats.all[e].Add(1)
	v, ok := d.stats.byType.Load(typ)
	if !ok {
		v, _ = d.stats.byType.LoadOrStore(typ, new(counterSet))
	}
	v.(*counterSet)[e].Add(1)
}

// Stats returns this process's counters since New, all task types together.
func (d *Dedup) Stats() Stats { return d.stats.all.snapshot() }

// StatsByType returns this process's counters since New, per task type.
func (d *Dedup) StatsByType() map[string]Stats {
	out := map[string]Stats{}
	d.stats.byType.Range(func(k, v any) bool {
		out[k.(string)] = v.(*counterSet).snapshot()
		return true
	})
	return out
}

// typeCounts returns the current counts per task type.
func (d *Dedup) typeCounts() map[string]counts {
	out := map[string]counts{}
	d.stats.byType.Range(func(k, v any) bool {
		out[k.(string)] = v.(*counterSet).load()
		return true
	})
	return out
}

// DefaultFlushInterval is the interval StartFlusher uses when given 0.
const DefaultFlushInterval = 10 * time.Second

// Stats keys. They carry no hash tag: each is a key of its own, in whatever
// slot it hashes to.
//
//	<prefix>:stats:types         set of the task types that have totals
//	<prefix>:stats:type:<type>   hash of one type's totals, field per event name
func statsTypesKey(prefix string) string { return prefix + ":stats:types" }
func statsKey(prefix, typ string) string { return prefix + ":stats:type:" + typ }

// StartFlusher starts adding this process's counters to totals in Redis
// every interval (default DefaultFlushInterval when 0), so that ReadStats
// sees the counts of every process that flushes. Each flush is one
// pipelined round trip (one per node on Redis Cluster) of HINCRBYs of what
// was counted since the last flush, into one hash per task type, bounded by
// Config.LockTimeout; it runs on its own goroutine, never on an enqueue or
// a handler. A failed flush is
// logged and its counts are kept for the next one; Close stops the flusher
// and flushes one last time.
//
// A flush whose reply is lost after Redis applied it (a timeout, a dropped
// connection) is sent again, so the totals may count that interval twice;
// they never lose a count that a flush reported as done.
//
// Calling StartFlusher again replaces the interval. It fails with
// ErrInvalidOption for a negative interval or after Close.
func (d *Dedup) StartFlusher(interval time.Duration) error {
	if interval < 0 {
		return fmt.Errorf("%w: flush interval %v is negative", ErrInvalidOption, interval)
	}
	if interval == 0 {
		interval = DefaultFlushInterval
	}
	m := &d.stats
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("%w: StartFlusher called after Close", ErrInvalidOption)
	}
	if m.flusher != nil {
		m.flusher.stop() // flushes; the next loop goes on from there
	}
	t := time.NewTicker(interval)
	m.flusher = startLoop(t.C, t.Stop, d.flushLogged, d.flushLogged)
	return nil
}

// flushLogged runs one flush bounded by LockTimeout and logs its failure.
func (d *Dedup) flushLogged() {
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.LockTimeout)
	defer cancel()
	_ = d.FlushStats(ctx)
}

// FlushStats adds what this process counted since its last flush to the
// totals in Redis now, in one pipelined round trip. The flusher
// (StartFlusher) calls it on its interval; call it yourself to flush without
// one, such as before a short-lived process exits. Counts of a failed flush
// are kept for the next one. It fails with an error matching ErrUnavailable.
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
	m := &d.stats
	if m.flushed == nil {
		m.flushed = map[string]*counts{}
		m.inTypeSet = map[string]bool{}
	}
	type pending struct {
		typ  string
		cur  counts
		base *counts
		cmds [numEvents]*redis.IntCmd
	}
	var (
		ps    []*pending
		types []any
	)
	for typ, cur := range d.typeCounts() {
		base := m.flushed[typ]
		if base == nil {
			base = new(counts)
			m.flushed[typ] = base
		}
		if cur != *base || !m.inTypeSet[typ] {
			ps = append(ps, &pending{typ: typ, cur: cur, base: base})
			types = append(types, typ)
		}
	}
	if len(ps) == 0 {
		return nil
	}
	prefix := d.cfg.Prefix
	var sadd *redis.IntCmd
	_, _ = d.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, pt := range ps {
			key := statsKey(prefix, pt.typ)
			for e := range numEvents {
				if delta := pt.cur[e] - pt.base[e]; delta > 0 {
					pt.cmds[e] = p.HIncrBy(ctx, key, eventNames[e], int64(delta))
				}
			}
		}
		sadd = p.SAdd(ctx, statsTypesKey(prefix), types...)
		return nil
	})
	first := sadd.Err()
	for _, pt := range ps {
		for e, c := range pt.cmds {
			if c == nil {
				continue
			}
			if err := c.Err(); err != nil {
				if first == nil {
					first = err
				}
				continue
			}
			pt.base[e] = pt.cur[e]
		}
		if sadd.Err() == nil {
			m.inTypeSet[pt.typ] = true
		}
	}
	return first
}

// ReadStats returns the totals per task type that every process with a
// flusher (Dedup.StartFlusher) has added to Redis under prefix (""
// means DefaultPrefix), since the first flush. It needs no Dedup, so an
// operator tool can call it with any client of the same Redis. Counts a
// process has not flushed yet (at most one flush interval's) are missing.
// Delete the keys "<prefix>:stats:types" and "<prefix>:stats:type:<type>"
// to start the totals again. Hash fields that are not event names or do
// not hold a count are ignored. Errors match ErrUnavailable.
func ReadStats(ctx context.Context, rdb redis.UniversalClient, prefix string) (map[string]Stats, error) {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	types, err := rdb.SMembers(ctx, statsTypesKey(prefix)).Result()
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
			cmds[i] = p.HGetAll(ctx, statsKey(prefix, typ))
		}
		return nil
	})
	for i, typ := range types {
		h, err := cmds[i].Result()
		if err != nil {
			return nil, unavailable("read stats", err)
		}
		var s Stats
		for f, v := range h {
			e, ok := eventByName[f]
			if !ok {
				continue
			}
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				continue
			}
			*s.field(e) = n
		}
		out[typ] = s
	}
	return out, nil
}

// loop runs a function on every tick of a ticker on its own goroutine, and
// a last function when stopped.
type loop struct {
	quit chan struct{}
	done chan struct{}
}

// startLoop calls onTick for every value from tick until stop, then
// stopTick (if not nil) and onStop (if not nil).
func startLoop(tick <-chan time.Time, stopTick func(), onTick, onStop func()) *loop {
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
					onStop()
				}
				return
			case <-tick:
				onTick()
			}
		}
	}()
	return l
}

// stop ends the loop and waits until its last function has returned.
func (l *loop) stop() {
	close(l.quit)
	<-l.done
}

// stopDiagnostics stops the hot-key reporter (logging its last, partial
// window) and the stats flusher (flushing one last time). Called by Close;
// idempotent. Start* calls after it fail.
func (d *Dedup) stopDiagnostics() {
	m := &d.stats
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	m.closed = true
	if m.repLoop != nil {
		m.repLoop.stop()
		m.repLoop = nil
		m.rep.Store(nil)
	}
	if m.flusher != nil {
		m.flusher.stop()
		m.flusher = nil
	}
}
