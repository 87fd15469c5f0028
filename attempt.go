package dedup

import (
	"context"
	"fmt"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Attempt is what the middleware did with one attempt of a task, for code
// that wraps the middleware (package dedupotel puts it on the attempt's
// span). Mount the wrapping middleware outside Dedup.Middleware, give the
// attempt's context an *Attempt with WithAttempt, and read it once the
// inner handler has returned (or panicked): the middleware fills it in
// before it returns. An Attempt never holds a payload or a key's text.
//
// Without WithAttempt the middleware records nothing and costs nothing
// more; with it, it records what it did, with no Redis call more either.
type Attempt struct {
	// Outcome is what became of the attempt and its lock.
	Outcome AttemptOutcome
	// Fingerprint is the task's key hashed, as its lock key ends (see
	// Result.Fingerprint); empty when the task has no lock (AttemptNotLocked),
	// or when the middleware made no Redis call for it (a task whose key's
	// policy acts only at enqueue, whose lock asynq releases).
	Fingerprint string
	// Arrived is true for a task that arrived without a lock (asynq.Scheduler,
	// another service): the execution-time guard keyed it by its type's rule.
	Arrived bool
	// Holder is the other task of a busy key: the one holding it
	// (AttemptBusyRetried, AttemptBusyDropped, AttemptSuperseded), or the one
	// the task's payload was folded into (AttemptBusyFolded).
	Holder string
	// FollowUp is the follow-up task (RunningDefer) queued as the attempt
	// released its lock; empty for none.
	FollowUp string
}

// AttemptOutcome says what the middleware did with one attempt.
type AttemptOutcome int

const (
	// AttemptNone: the middleware did not record the attempt (it was not
	// mounted inside the wrapper, or the task was not run by an asynq server).
	AttemptNone AttemptOutcome = iota
	// AttemptNotLocked: the task ran without a lock, as nothing deduplicates
	// it (no rule under Config.OptIn, Skip, Config.NoExecutionGuard) or its
	// key could not be computed at execution (counted as unguarded).
	AttemptNotLocked
	// AttemptReleased: the task ran, and its key goes as asynq moves the
	// task on: released with its success or revoke (by asynq's own
	// scripts, or the middleware), or left to heal at the key's next enqueue
	// once asynq archives it (SkipRetry, last retry); or it went to the
	// follow-up the key owed (FollowUp).
	AttemptReleased
	// AttemptHeld: the task ran, failed with retries left, and its lock is
	// held for the retry.
	AttemptHeld
	// AttemptCooling: the task ran and succeeded; its key stays held for the
	// type's Cooldown.
	AttemptCooling
	// AttemptLockLost: the task ran, but its lock was no longer its own at
	// the end (it expired, or was taken over).
	AttemptLockLost
	// AttemptUnsettled: the task ran, and the call settling its lock failed:
	// the key stays as it was (held by the task, which asynq releases on a
	// success, or heals at the key's next enqueue).
	AttemptUnsettled
	// AttemptAllowed: a RunningAllow task, which ran without holding its lock.
	AttemptAllowed
	// AttemptFailOpen: Redis failed, and the task ran without a lock
	// (Config.FailOpen).
	AttemptFailOpen
	// AttemptRefused: the task did not run: Redis failed (fail-closed), or its
	// record is in another Redis (ErrTasksElsewhere). The error says which.
	AttemptRefused
	// AttemptBusyRetried: the task met its key held by another live task and
	// did not run; asynq runs it again later (on its last attempt, a copy
	// is scheduled instead). See Busy.
	AttemptBusyRetried
	// AttemptBusyDropped: the task met its key held (or cooling down, Holder
	// being the task that succeeded) and was dropped without running.
	AttemptBusyDropped
	// AttemptBusyFolded: the task met its key held and its payload was
	// folded into the key's task (BusyFold), named by Holder.
	AttemptBusyFolded
	// AttemptSuperseded: the task did not run, as a newer payload of its key
	// lives in another task (Holder).
	AttemptSuperseded
)

var attemptNames = [...]string{"none", "not_locked", "released", "held", "cooling", "lock_lost", "unsettled",
	"allowed", "fail_open", "refused", "busy_retried", "busy_dropped", "busy_folded", "superseded"}

// String returns the outcome's stable name, such as "held" or "busy_folded".
func (o AttemptOutcome) String() string {
	if o >= 0 && int(o) < len(attemptNames) {
		return attemptNames[o]
	}
	return fmt.Sprintf("AttemptOutcome(%d)", int(o))
}

// attemptKey is the context key of the Attempt the middleware fills.
type attemptKey struct{}

// WithAttempt returns a context under which Dedup.Middleware records what it
// does with the attempt into a. Call it in a middleware mounted outside
// Dedup.Middleware, and pass the context on to the next handler; the
// handler's context carries it too. A nil a records nothing.
func WithAttempt(ctx context.Context, a *Attempt) context.Context {
	return context.WithValue(ctx, attemptKey{}, a)
}

// attemptOf returns the Attempt to fill for the attempt of ctx, or nil.
func attemptOf(ctx context.Context) *Attempt {
	a, _ := ctx.Value(attemptKey{}).(*Attempt)
	return a
}

// set records the outcome; a nil a records nothing.
func (a *Attempt) set(o AttemptOutcome) {
	if a != nil {
		a.Outcome = o
	}
}

// other records an outcome about another task of the key.
func (a *Attempt) other(o AttemptOutcome, holder string) {
	if a != nil {
		a.Outcome, a.Holder = o, holder
	}
}

// locked records the lock the attempt is under.
func (a *Attempt) locked(l *lease) {
	if a != nil {
		a.Fingerprint, a.Arrived = l.ref.FP, l.arrived
	}
}

// settled records how the attempt's key was settled, as report counts it.
func (a *Attempt) settled(res store.SettleResult, err error) {
	switch {
	case a == nil:
	case err != nil:
		a.Outcome = AttemptUnsettled
	case !res.Owned:
		a.Outcome = AttemptLockLost
	case res.Cooling:
		a.Outcome = AttemptCooling
	case res.Held:
		a.Outcome = AttemptHeld
	default:
		a.Outcome, a.FollowUp = AttemptReleased, res.Follow
	}
}
