package dedup

import (
	"sync"
	"sync/atomic"
)

// event is one countable thing that happened to a lock.
type event int

const (
	evLocked     event = iota // enqueue took a lock
	evDuplicate               // enqueue rejected as a duplicate
	evRollback                // lock given back after asynq refused an enqueue
	evStarted                 // attempt ran holding its lock
	evBusy                    // attempt deferred or skipped by the execution-time guard
	evReleased                // lock released
	evHeld                    // lock kept across a retry
	evLockLost                // running attempt found its lock gone
	evRedisError              // failed lock call
	evFailOpen                // call went on without a lock
	evUnguarded               // attempt ran unlocked: key not computable at execution
	evCoalesced               // enqueue replaced the payload of the waiting task (Replace)
	evMerged                  // enqueue merged into the waiting task's payload (Merge)
	evDeferred                // enqueue folded into the follow-up of a running key (Defer)
	evOverBound               // enqueue of a new key refused: too many keys waiting (MaxPending)
	evProcessed               // attempt finished (any outcome) holding its lock
	numEvents
)

// Stats is a snapshot of counters since New, for this process.
type Stats struct {
	Locked      uint64 // enqueues that took a lock
	Duplicates  uint64 // enqueues rejected with DuplicateTaskError
	Rollbacks   uint64 // locks given back after asynq refused an enqueue
	Started     uint64 // attempts that ran holding their lock
	Busy        uint64 // attempts deferred or skipped by the execution-time guard
	Released    uint64 // locks released (success, revoke, final failure)
	Held        uint64 // locks kept across a retry
	LockLost    uint64 // running attempts that found their lock gone
	RedisErrors uint64 // failed lock calls
	FailOpen    uint64 // calls that went on without a lock (FailOpen)
	Unguarded   uint64 // attempts run unlocked: key could not be computed at execution
	Coalesced   uint64 // enqueues whose payload replaced a waiting task's (Replace)
	Merged      uint64 // enqueues merged into a waiting task's payload (Merge)
	Deferred    uint64 // enqueues folded into the follow-up of a running key (Defer)
	OverBound   uint64 // new keys refused because MaxPending keys were waiting
	Processed   uint64 // attempts that finished holding their lock
}

type counterSet [numEvents]atomic.Uint64

func (c *counterSet) snapshot() Stats {
	return Stats{
		Locked: c[evLocked].Load(), Duplicates: c[evDuplicate].Load(), Rollbacks: c[evRollback].Load(),
		Started: c[evStarted].Load(), Busy: c[evBusy].Load(), Released: c[evReleased].Load(), Held: c[evHeld].Load(),
		LockLost: c[evLockLost].Load(), RedisErrors: c[evRedisError].Load(), FailOpen: c[evFailOpen].Load(),
		Unguarded: c[evUnguarded].Load(), Coalesced: c[evCoalesced].Load(), Merged: c[evMerged].Load(),
		Deferred: c[evDeferred].Load(), OverBound: c[evOverBound].Load(), Processed: c[evProcessed].Load(),
	}
}

// metrics keeps counters in memory: one set for the process and one per
// task type. Counting is lock-free after a type's first event.
type metrics struct {
	all    counterSet
	byType sync.Map // string → *counterSet
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

// Stats returns this process's counters, all task types together.
func (d *Dedup) Stats() Stats { return d.stats.all.snapshot() }

// StatsByType returns this process's counters per task type.
func (d *Dedup) StatsByType() map[string]Stats {
	out := map[string]Stats{}
	d.stats.byType.Range(func(k, v any) bool {
		out[k.(string)] = v.(*counterSet).snapshot()
		return true
	})
	return out
}

// noteCoalesced records that an enqueue was folded into the task holding a
// key (Replace, Merge or Defer), for the hot-key report. key is the explicit
// key when the call used one, else "".
func (d *Dedup) noteCoalesced(typ, fpHex, key string) {}
