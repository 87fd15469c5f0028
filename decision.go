package dedup

import (
	"log/slog"
)

// Decision is what Config.OnDecision hears each time deduplication changes
// what happens to a task: an enqueue rejected as a duplicate or folded into
// another task, or a task that reached the server and met a busy key. It
// never carries a payload.
type Decision struct {
	// Event names what happened, as the counters do (Stats.Map):
	// "duplicate", "replaced" (Replace), "merged", "deferred" (a new
	// follow-up of a running task) or "busy" (the execution-time guard).
	Event string
	// Type and Queue of the task the decision was about.
	Type, Queue string
	// Key is the lock key: prefix, queue and fingerprint (16 or 32 hex
	// digits of the hashed key), never the key's own text.
	Key string
	// TaskID is the task holding the key (duplicate, busy) or carrying the
	// payload now (replaced, merged, deferred).
	TaskID string
	// FollowUp is true when TaskID is the follow-up of a running task
	// (RunningDefer), not the key's waiting task.
	FollowUp bool
	// Dropped is true for a busy task dropped (BusyDrop, Config.SkipBusy,
	// or a key cooling down).
	Dropped bool
	// CoolingDown is true when the key is held after its task succeeded
	// (Cooldown, Period): TaskID is that task.
	CoolingDown bool
	// FailHeld is true when the key is held after its task failed for good
	// (OnFailure): TaskID is that task.
	FailHeld bool
}

// decide tells Config.OnDecision, if set. The hook runs on the caller's
// goroutine; a panic in it is logged and does not fail the call.
func (d *Dedup) decide(dec Decision) {
	hook := d.cfg.OnDecision
	if hook == nil {
		return
	}
	defer func() {
		if r := recover(); r != nil {
			d.log.Error("dedup: OnDecision panicked", slog.Any("panic", r), slog.String("event", dec.Event), slog.String("type", dec.Type))
		}
	}()
	hook(dec)
}
