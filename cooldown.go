package dedup

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Cooldown (throttle): "at most one digest per user per week". After the
// key's task succeeds, its lock stays until the cooldown has passed since
// the key was taken, and every enqueue of the key meanwhile fails with a
// *DuplicateTaskError naming that task, with CoolingDown set, whatever the
// Conflict policy (there is no waiting task left to fold into). A task that
// fails for good, is revoked, archived or deleted releases the key as
// usual: only success cools down. The lock lives at least until the
// cooldown ends, so a worker that dies mid-run leaves the key held, and
// asynq's recovered retry finds it its own. A task arriving without a lock
// at a cooling key (Scheduler, another service) is dropped, counted as
// busy, and OnDecision is told with CoolingDown and Dropped set.
//
// This is sidekiq-unique-jobs' until_expired and BullMQ's throttle mode.
// Dedup.Release ends a cooldown early.

// Cooldown sets this call's cooldown (see Rule.Cooldown), overriding the
// type's rule: if this call takes the key, once its task succeeds the key
// stays held until d after this enqueue. A call folded into a waiting task
// leaves that key's cooldown as it was (Result.NotApplied names it). Above
// 100 years it is 100 years. With Config.OptIn it opts the call in.
func Cooldown(d time.Duration) asynq.Option {
	desc := fmt.Sprintf("dedup.Cooldown(%v)", d)
	return option{desc: desc, apply: func(r *resolved) error {
		if d <= 0 {
			return errorf("%w: Cooldown %v is not positive", ErrInvalidOption, d)
		}
		r.cooldown, r.optedIn = lifetime(d), true
		r.callKept = append(r.callKept[:len(r.callKept):len(r.callKept)], desc) // (a copy: the rule's slice is shared)
		return nil
	}}
}

// firingHold keys a Scheduler firing: its key is held for hold from the
// take, whatever its task does (the key only has to outlive its window),
// and its middleware makes no Redis call.
func firingHold(hold time.Duration) asynq.Option {
	return option{desc: fmt.Sprintf("dedup.firingHold(%v)", hold), apply: func(r *resolved) error {
		r.firing = lifetime(hold)
		return nil
	}}
}

// checkModes refuses the holds and debounce where they would break their
// promise: a cooldown with a running policy that starts a second run in
// the window, a fail hold of a key freed as its task starts, a debounce
// without a fold to debounce or with a follow-up whose due time its
// holder's end owns.
func (r *resolved) checkModes() error {
	switch {
	case r.cooldown < 0 || r.debounce < 0:
		return errorf("%w: negative Cooldown or Debounce", ErrInvalidOption)
	case r.cooldown > 0 && r.running != RunningReject:
		return errorf("%w: Cooldown needs OnRunning RunningReject (%v would run the key again within the cooldown)", ErrInvalidOption, r.running)
	case r.period > 0 && r.running != RunningReject:
		return errorf("%w: Period needs OnRunning RunningReject (%v would run the key again within the window)", ErrInvalidOption, r.running)
	case r.failHold != 0 && r.running == RunningAllow:
		return errorf("%w: OnFailure's hold needs a running policy that keeps the key while its task runs (RunningAllow frees it as the task starts: no key is left to hold after a failure)", ErrInvalidOption)
	case r.period > 0 && r.cooldown > 0:
		return errorf("%w: Period and Cooldown cannot be combined (a key cools down until its window ends)", ErrInvalidOption)
	case r.debounce > 0 && r.conflict == Reject:
		return errorf("%w: Debounce needs OnConflict Replace or Merge (a rejected enqueue has nothing to debounce)", ErrInvalidOption)
	case r.debounce > 0 && r.running == RunningDefer:
		return errorf("%w: Debounce cannot be combined with RunningDefer", ErrInvalidOption)
	}
	return nil
}

// cooling answers a task that arrived without a lock at a key that cools
// down after its last task succeeded, or is held after it failed: dropped,
// as the enqueue would have been rejected.
func (d *Dedup) cooling(t *asynq.Task, l *store.Ref, holder string, left time.Duration, failed bool) error {
	d.count(t.Type(), evBusy)
	d.decide(Decision{Event: eventNames[evBusy], Type: t.Type(), Queue: l.Queue, Key: d.lockKey(l), TaskID: holder, Dropped: true, CoolingDown: !failed, FailHeld: failed})
	why := "dedup: dropped task, its key cools down after its last task succeeded"
	if failed {
		why = "dedup: dropped task, its key is held after its last task failed (OnFailure)"
	}
	d.log.Info(why, slog.String("type", t.Type()), slog.String("task_id", l.ID), slog.String("holder", holder), slog.Duration("left", left))
	return nil
}
