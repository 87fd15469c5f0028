// Package attempt is what the dedup middleware did with one attempt of a
// task, for the module's code that wraps the middleware (package dedupotel
// puts it on the attempt's span). It is internal: it serves this module's
// packages, not the users of package dedup.
package attempt

import (
	"context"
	"fmt"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Attempt is what the middleware did with one attempt of a task. Mount the
// wrapping middleware outside dedup.Dedup.Middleware, give the attempt's context
// an *Attempt with With, and read it once the
// inner handler has returned (or panicked): the middleware fills it in
// before it returns. An Attempt never holds a payload or a key's text.
//
// Without With the middleware records nothing and costs nothing
// more; with it, it records what it did, with no Redis call more either.
type Attempt struct {
	// Outcome is what became of the attempt and its lock.
	Outcome Outcome
	// Fingerprint is the task's key hashed, as its lock key ends (see
	// dedup.Result.Fingerprint); empty when the task has no lock (NotLocked),
	// or when the middleware made no Redis call for it (a task whose key's
	// policy acts only at enqueue, whose lock asynq releases).
	Fingerprint string
	// Arrived is true for a task that arrived without a lock (asynq.Scheduler,
	// another service): the execution-time guard keyed it by its type's rule.
	Arrived bool
	// Holder is the other task of a busy key: the one holding it
	// (BusyRetried, BusyDropped, Superseded), or the one
	// the task's payload was folded into (BusyFolded).
	Holder string
	// FollowUp is the follow-up task (RunningDefer) queued as the attempt
	// released its lock; empty for none.
	FollowUp string
}

// Outcome says what the middleware did with one attempt.
type Outcome int

const (
	// None: the middleware did not record the attempt (it was not
	// mounted inside the wrapper, or the task was not run by an asynq server).
	None Outcome = iota
	// NotLocked: the task ran without a lock, as nothing deduplicates
	// it (no rule under dedup.Config.OptIn, dedup.Skip, dedup.Config.NoExecutionGuard) or its
	// key could not be computed at execution (counted as unguarded).
	NotLocked
	// Released: the task ran, and its key goes as asynq moves the
	// task on: released with its success or revoke (by asynq's own
	// scripts, or the middleware), or left to heal at the key's next enqueue
	// once asynq archives it (SkipRetry, last retry); or it went to the
	// follow-up the key owed (FollowUp).
	Released
	// Held: the task ran, failed with retries left, and its lock is
	// held for the retry.
	Held
	// Cooling: the task ran and succeeded; its key stays held for the
	// type's Cooldown.
	Cooling
	// LockLost: the task ran, but its lock was no longer its own at
	// the end (it expired, or was taken over).
	LockLost
	// Unsettled: the task ran, and the call settling its lock failed:
	// the key stays as it was (held by the task, which asynq releases on a
	// success, or heals at the key's next enqueue).
	Unsettled
	// Allowed: a RunningAllow task, which ran without holding its lock.
	Allowed
	// FailOpen: Redis failed, and the task ran without a lock
	// (dedup.Config.FailOpen).
	FailOpen
	// Refused: the task did not run: Redis failed (fail-closed), or its
	// record is in another Redis (dedup.ErrTasksElsewhere). The error says which.
	Refused
	// BusyRetried: the task met its key held by another live task and
	// did not run; asynq runs it again later (on its last attempt, a copy
	// is scheduled instead). See dedup.Busy.
	BusyRetried
	// BusyDropped: the task met its key held (or cooling down, Holder
	// being the task that succeeded) and was dropped without running.
	BusyDropped
	// BusyFolded: the task met its key held and its payload was
	// folded into the key's task (BusyFold), named by Holder.
	BusyFolded
	// Superseded: the task did not run, as a newer payload of its key
	// lives in another task (Holder).
	Superseded
)

var attemptNames = [...]string{"none", "not_locked", "released", "held", "cooling", "lock_lost", "unsettled",
	"allowed", "fail_open", "refused", "busy_retried", "busy_dropped", "busy_folded", "superseded"}

// String returns the outcome's stable name, such as "held" or "busy_folded".
func (o Outcome) String() string {
	if o >= 0 && int(o) < len(attemptNames) {
		return attemptNames[o]
	}
	return fmt.Sprintf("attempt.Outcome(%d)", int(o))
}

// attemptKey is the context key of the Attempt the middleware fills.
type attemptKey struct{}

// With returns a context under which dedup.Dedup.Middleware records what it
// does with the attempt into a. Call it in a middleware mounted outside
// dedup.Dedup.Middleware, and pass the context on to the next handler; the
// handler's context carries it too. A nil a records nothing.
func With(ctx context.Context, a *Attempt) context.Context {
	return context.WithValue(ctx, attemptKey{}, a)
}

// Of returns the Attempt to fill for the attempt of ctx, or nil.
func Of(ctx context.Context) *Attempt {
	a, _ := ctx.Value(attemptKey{}).(*Attempt)
	return a
}

// Set records the outcome; a nil a records nothing.
func (a *Attempt) Set(o Outcome) {
	if a != nil {
		a.Outcome = o
	}
}

// Other records an outcome about another task of the key.
func (a *Attempt) Other(o Outcome, holder string) {
	if a != nil {
		a.Outcome, a.Holder = o, holder
	}
}

// Locked records the lock the attempt is under: its fingerprint, and
// whether the task arrived without a lock.
func (a *Attempt) Locked(fp string, arrived bool) {
	if a != nil {
		a.Fingerprint, a.Arrived = fp, arrived
	}
}

// Settled records how the attempt's key was settled, as report counts it.
func (a *Attempt) Settled(res store.SettleResult, err error) {
	switch {
	case a == nil:
	case err != nil:
		a.Outcome = Unsettled
	case !res.Owned:
		a.Outcome = LockLost
	case res.Cooling:
		a.Outcome = Cooling
	case res.Held:
		a.Outcome = Held
	default:
		a.Outcome, a.FollowUp = Released, res.Follow
	}
}
