package dedup

import (
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Stats is a snapshot of event counters: since New for this process (Stats,
// StatsByType), or since the first flush for all processes (ReadStats).
//
// Stats is the one list of the events this package counts: each field
// counts one event, and its tag is the event's stable name, which is the
// key of Stats.Map, the field of the stats hashes in Redis (ReadStats) and
// the "event" label of the Prometheus collector (package dedupprom). A name
// is not changed lightly: the two renamed so far (docs/glossary.md) are
// still read from stats hashes flushed under their former names.
type Stats struct {
	Locked      uint64 `event:"locked"`       // enqueues that took a lock
	Duplicates  uint64 `event:"duplicate"`    // enqueues rejected with DuplicateTaskError
	Rollbacks   uint64 `event:"rollback"`     // locks given back after asynq refused an enqueue
	Started     uint64 `event:"started"`      // attempts that ran holding their lock (RunningAllow: its lock released as they start)
	Busy        uint64 `event:"busy"`         // attempts deferred or skipped by the execution-time guard
	Released    uint64 `event:"released"`     // locks released: success, revoke, final failure; RunningAllow: as the task starts
	Held        uint64 `event:"held"`         // locks kept across a retry
	LockLost    uint64 `event:"lock_lost"`    // running attempts that found their lock gone
	RedisErrors uint64 `event:"redis_error"`  // failed lock calls
	FailOpen    uint64 `event:"fail_open"`    // calls that went on without a lock, Config.FailOpen
	Unguarded   uint64 `event:"unguarded"`    // attempts run unlocked: key could not be computed at execution
	Replaced    uint64 `event:"replaced"`     // enqueues whose payload replaced a waiting task's, Replace
	Merged      uint64 `event:"merged"`       // enqueues merged into a waiting task's payload, Merge
	Deferred    uint64 `event:"deferred"`     // enqueues that created the follow-up of a running key (Defer); later folds into it count as replaced or merged
	OverBound   uint64 `event:"over_bound"`   // new keys refused because MaxPending keys were waiting
	Processed   uint64 `event:"processed"`    // started attempts that finished
	BreakerOpen uint64 `event:"breaker_open"` // times the circuit breaker opened
	Superseded  uint64 `event:"superseded"`   // attempts not run: the task lost its lock to a newer payload of its key (its follow-up, Replace + Defer; or, an operator having released it, a Replace task of its type that took the key since)
	Cooling     uint64 `event:"cooling"`      // locks kept after their task succeeded, until its Cooldown ends
	FailHeld    uint64 `event:"fail_held"`    // locks kept after their task failed for good (OnFailure)
}

// event is one countable thing: the index of its Stats field.
type event int

// The events the code counts, named by their Stats fields.
const (
	evLocked      = event(unsafe.Offsetof(Stats{}.Locked) / counterSize)
	evDuplicate   = event(unsafe.Offsetof(Stats{}.Duplicates) / counterSize)
	evRollback    = event(unsafe.Offsetof(Stats{}.Rollbacks) / counterSize)
	evStarted     = event(unsafe.Offsetof(Stats{}.Started) / counterSize)
	evBusy        = event(unsafe.Offsetof(Stats{}.Busy) / counterSize)
	evReleased    = event(unsafe.Offsetof(Stats{}.Released) / counterSize)
	evHeld        = event(unsafe.Offsetof(Stats{}.Held) / counterSize)
	evLockLost    = event(unsafe.Offsetof(Stats{}.LockLost) / counterSize)
	evRedisError  = event(unsafe.Offsetof(Stats{}.RedisErrors) / counterSize)
	evFailOpen    = event(unsafe.Offsetof(Stats{}.FailOpen) / counterSize)
	evUnguarded   = event(unsafe.Offsetof(Stats{}.Unguarded) / counterSize)
	evReplaced    = event(unsafe.Offsetof(Stats{}.Replaced) / counterSize)
	evMerged      = event(unsafe.Offsetof(Stats{}.Merged) / counterSize)
	evDeferred    = event(unsafe.Offsetof(Stats{}.Deferred) / counterSize)
	evOverBound   = event(unsafe.Offsetof(Stats{}.OverBound) / counterSize)
	evProcessed   = event(unsafe.Offsetof(Stats{}.Processed) / counterSize)
	evBreakerOpen = event(unsafe.Offsetof(Stats{}.BreakerOpen) / counterSize)
	evSuperseded  = event(unsafe.Offsetof(Stats{}.Superseded) / counterSize)
	evCooling     = event(unsafe.Offsetof(Stats{}.Cooling) / counterSize)
	evFailHeld    = event(unsafe.Offsetof(Stats{}.FailHeld) / counterSize)

	counterSize = unsafe.Sizeof(uint64(0))
	numEvents   = event(unsafe.Sizeof(Stats{}) / counterSize)
)

// eventNames are the events' names, from Stats's tags; eventByName maps
// them back.
var eventNames, eventByName = func() ([numEvents]string, map[string]event) {
	var names [numEvents]string
	byName := make(map[string]event, numEvents)
	t := reflect.TypeFor[Stats]()
	for i := range t.NumField() {
		f := t.Field(i)
		name := f.Tag.Get("event")
		if _, dup := byName[name]; f.Type.Kind() != reflect.Uint64 || name == "" || dup {
			panic(fmt.Sprintf("dedup: Stats field %s: every field is a uint64 with a name of its own", f.Name))
		}
		names[i], byName[name] = name, event(i)
	}
	return names, byName
}()

// field returns the counter of s that counts e.
func (s *Stats) field(e event) *uint64 {
	return reflect.ValueOf(s).Elem().Field(int(e)).Addr().Interface().(*uint64)
}

// Map returns the counters keyed by their names (the fields' "event"
// tags).
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
	// noteFold costs one atomic load when reporting is off.
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

// renamedEvents are the former names of renamed events (docs/glossary.md):
// stats hashes flushed before the rename keep them, and statsOf adds their
// counts to the event's, so totals do not split.
var renamedEvents = map[string]event{"coalesced": evReplaced, "failure_held": evFailHeld}

// statsOf reads a stats hash: fields that are not event names (or former
// names) or do not hold a count are ignored.
func statsOf(h map[string]string) Stats {
	var s Stats
	for f, v := range h {
		e, ok := eventByName[f]
		if !ok {
			if e, ok = renamedEvents[f]; !ok {
				continue
			}
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			continue
		}
		*s.field(e) += n
	}
	return s
}
