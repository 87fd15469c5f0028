package dedup

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Sentinel errors. Errors this package makes match one of them with
// errors.Is and wrap their cause; errors from asynq (such as
// asynq.ErrTaskIDConflict), from Redis (go-redis's, such as a
// *net.OpError for a refused connection), from the context, or from a
// function you gave (MergeFunc, KeyFunc) are returned wrapped, so
// errors.Is and errors.As find them too. Every error's text begins
// "dedup: ", once, however many of the package's errors it wraps.
var (
	// ErrDuplicateTask reports that another task holds the key. The error is
	// always a *DuplicateTaskError, which also matches asynq.ErrDuplicateTask.
	ErrDuplicateTask = errors.New("dedup: duplicate task")

	// ErrInvalidPayload reports a payload the chosen fields or key function
	// cannot fingerprint (not JSON, a field missing). The error is a
	// *PayloadError; nothing was locked or enqueued.
	ErrInvalidPayload = errors.New("dedup: invalid payload")

	// ErrFieldMissing is the cause in a *PayloadError when a selected field is
	// absent and Rule.MissingAsNull is not set.
	ErrFieldMissing = errors.New("dedup: selected field missing")

	// ErrInvalidOption reports a bad configuration or per-call option, such as
	// asynq.Unique or asynq.Group passed with deduplication on. Nothing was
	// locked or enqueued.
	ErrInvalidOption = errors.New("dedup: invalid option")

	// ErrUnavailable reports that Redis could not be reached for a lock
	// operation (fail-closed) or at start-up, and that the call stored
	// nothing: it was not sent (a refused connection, a name that does not
	// resolve, a failed TLS handshake, the breaker open), or Redis refused
	// it before running it. It wraps the Redis error, and its text quotes
	// it ("dedup: redis unavailable: acquire: dial tcp …: connect:
	// connection refused"). When Redis refuses the login (WRONGPASS,
	// NOAUTH) or the user's ACL the call (NOPERM), the text says so
	// instead ("dedup: redis refused authentication: WRONGPASS …", "dedup:
	// redis denied permission: NOPERM …"), and nothing retries it (New
	// fails at its first PING). A call that may have reached Redis and run
	// is ErrOutcomeUnknown instead.
	ErrUnavailable = errors.New("dedup: redis unavailable")

	// ErrOutcomeUnknown reports an enqueue that may or may not have stored
	// its task: a lock call that carried the task (Dedup.NewClient's direct
	// path) failed after it may have reached Redis (a connection lost or a
	// deadline passed mid-call), and the task was not found stored (the
	// call may still run late) or Redis could not be asked. A call that
	// cannot have been sent (a connection refused, see ErrUnavailable) is
	// never ErrOutcomeUnknown. The error also matches ErrUnavailable; the
	// call's task ID is in its text, and asynq's Inspector tells once Redis
	// answers. FailOpen does not enqueue such a call again, which could
	// store it twice; the call, if it runs late, never stores a task that
	// exists.
	ErrOutcomeUnknown = errors.New("dedup: outcome unknown: the task may have been stored")

	// ErrCircuitOpen is the cause of a lock call refused without asking
	// Redis, because Redis kept failing (see Config.BreakerThreshold). It is
	// handled like any Redis error: wrapped in ErrUnavailable (fail-closed)
	// or let through (fail-open).
	ErrCircuitOpen = errors.New("dedup: circuit open: redis keeps failing")

	// ErrKeyBusy is returned by the middleware when a task arrives whose key
	// is held by another live task (the execution-time guard). asynq retries
	// it later; pass IsFailure to asynq.Config so that doesn't use up retries.
	ErrKeyBusy = errors.New("dedup: key busy")

	// ErrTooManyPending reports an enqueue of a new key refused because the
	// type's MaxPending keys are already waiting in the queue. Nothing was
	// locked or enqueued.
	ErrTooManyPending = errors.New("dedup: too many pending keys")

	// ErrIncompatible reports that asynq's stored task record is not laid
	// out as this package expects (asynq v0.26.0); nothing was changed.
	ErrIncompatible = errors.New("dedup: asynq task record not understood")

	// ErrContention reports a Merge that kept losing its compare-and-set to
	// other producers (the stored payload has every other merge, not this
	// one), or a lock that changed hands every time the enqueue read it.
	// The call changed nothing.
	ErrContention = errors.New("dedup: merge contention")

	// ErrTasksElsewhere reports a Client made by WrapClient whose enqueuer
	// stores tasks in another Redis than the Dedup's, or a server whose
	// tasks are not in the Dedup's Redis. Locks are checked against asynq's
	// record of their holder task in the lock's Redis; with the tasks
	// elsewhere every holder would look gone and duplicates would be
	// admitted, so deduplicated calls are refused instead (nothing locked
	// or enqueued; a server does not run the task). A WrapClient finds out
	// from its first accepted enqueues, the middleware from each task's
	// record as it starts; logged once.
	ErrTasksElsewhere = errors.New("dedup: tasks live in another redis")

	// ErrLockLost is the cause of a handler context cancelled because its
	// lock was taken over or expired (Config.CancelOnLockLoss).
	ErrLockLost = errors.New("dedup: lock lost")
)

// DuplicateTaskError is returned by Client.Enqueue when another task holds
// the key. It matches both ErrDuplicateTask and asynq.ErrDuplicateTask, so
// code written for asynq.Unique keeps working.
type DuplicateTaskError struct {
	Holder string // the task holding the key
	Queue  string // the queue the lock belongs to
	Type   string // the rejected task's type
	Key    string // the Redis key of the lock
	// CoolingDown: Holder succeeded, and the key stays held for its
	// Cooldown (or Period); FreeIn is how long it has left, as Redis
	// counted at the call.
	CoolingDown bool
	// FailHeld: Holder failed for good, and the key stays held (OnFailure)
	// for FreeIn more; a negative FreeIn: until released by hand.
	FailHeld bool
	FreeIn   time.Duration

	ownID bool // Holder is the call's own caller-chosen ID
}

func (e *DuplicateTaskError) Error() string {
	switch {
	case e.CoolingDown:
		return fmt.Sprintf("dedup: duplicate task: type %q in queue %q cools down after task %s for %v more", e.Type, e.Queue, e.Holder, e.FreeIn)
	case e.FailHeld && e.FreeIn < 0:
		return fmt.Sprintf("dedup: duplicate task: type %q in queue %q is held after task %s failed, until released", e.Type, e.Queue, e.Holder)
	case e.FailHeld:
		return fmt.Sprintf("dedup: duplicate task: type %q in queue %q is held after task %s failed, for %v more", e.Type, e.Queue, e.Holder, e.FreeIn)
	}
	return fmt.Sprintf("dedup: duplicate task: type %q in queue %q is held by task %s", e.Type, e.Queue, e.Holder)
}

// Is reports whether target is ErrDuplicateTask or asynq.ErrDuplicateTask;
// or asynq.ErrTaskIDConflict when the task holding the key has the call's
// own caller-chosen ID (enqueued again with another payload), as asynq's
// client answers a taken ID.
func (e *DuplicateTaskError) Is(target error) bool {
	return target == ErrDuplicateTask || target == asynq.ErrDuplicateTask || (e.ownID && target == asynq.ErrTaskIDConflict)
}

// BusyError is returned by the middleware when the running task's key is held
// by another live task. It matches ErrKeyBusy.
type BusyError struct {
	TaskID string // the task that arrived
	Holder string // the task holding the key
	Key    string // the Redis key of the lock
}

func (e *BusyError) Error() string {
	return fmt.Sprintf("dedup: task %s deferred: key is held by task %s", e.TaskID, e.Holder)
}

// Is reports whether target is ErrKeyBusy.
func (e *BusyError) Is(target error) bool { return target == ErrKeyBusy }

// IsFailure is meant for asynq.Config.IsFailure: a task deferred by the
// execution-time guard (ErrKeyBusy) is retried without counting as a failure.
// Every other non-nil error is a failure, as in asynq's default.
func IsFailure(err error) bool {
	return err != nil && !errors.Is(err, ErrKeyBusy)
}

// unavailable wraps a Redis error so it matches ErrUnavailable and the
// cause; a refused login or permission says so (refusalOf).
func unavailable(op string, err error) error {
	if r := refusalOf(err); r != nil {
		return errorf("%w: %w", r, err)
	}
	return errorf("%w: %s: %w", ErrUnavailable, op, err)
}

// Redis refusing the client itself: ErrUnavailable, read as what it is.
var (
	errLoginRefused      = &wrapped{msg: "dedup: redis refused authentication", err: ErrUnavailable}
	errPermissionRefused = &wrapped{msg: "dedup: redis denied permission", err: ErrUnavailable}
)

// refusalOf is errLoginRefused or errPermissionRefused for err that is such
// a refusal (which no retry changes), else nil.
func refusalOf(err error) error {
	switch {
	case store.LoginRefused(err):
		return errLoginRefused
	case store.PermissionRefused(err):
		return errPermissionRefused
	}
	return nil
}

// outcomeUnknown is the error of a call about task id that may have
// stored it: it failed with callErr (nil: a call that answered, whose
// task is looked for) and the look whether it stored the task failed with
// lookErr, or (nil) found nothing yet. It matches ErrOutcomeUnknown and
// ErrUnavailable.
func outcomeUnknown(id string, callErr, lookErr error) error {
	switch {
	case callErr == nil:
		return errorf("%w (task %s): asking whether it was stored: %w", errUnknown, id, lookErr)
	case lookErr == nil:
		return errorf("%w (task %s): %w; not stored yet, but the call may still run", errUnknown, id, callErr)
	}
	return errorf("%w (task %s): %w; asking whether it ran: %w", errUnknown, id, callErr, lookErr)
}

// errUnknown reads as ErrOutcomeUnknown, and matches ErrUnavailable too.
var errUnknown = &wrapped{msg: ErrOutcomeUnknown.Error(), err: errors.Join(ErrOutcomeUnknown, ErrUnavailable)}

// prefix begins the text of every error of this package.
const prefix = "dedup: "

// errorf is fmt.Errorf for this package's errors: its text begins with
// prefix once. An error of the package's (or of internal/store's) named
// inside reads without its own prefix; %w keeps every error wrapped for
// errors.Is and errors.As, the prefixed ones included.
func errorf(format string, args ...any) error {
	for i, a := range args {
		if e, ok := a.(error); ok && e != nil {
			args[i] = inner{e}
		}
	}
	err := fmt.Errorf(format, args...)
	msg := err.Error()
	if !strings.HasPrefix(msg, prefix) {
		msg = prefix + msg
	}
	return &wrapped{msg: msg, err: err}
}

// inner is an error named inside another of this package's: its text
// without the prefix.
type inner struct{ err error }

func (e inner) Error() string { return unprefixed(e.err) }
func (e inner) Unwrap() error { return e.err }

// unprefixed is err's text without a leading prefix.
func unprefixed(err error) string {
	if err == nil {
		return "<nil>"
	}
	return strings.TrimPrefix(err.Error(), prefix)
}

// wrapped is an error whose message is reworded (errorf, ruleError) but
// which still matches, with errors.Is and errors.As, err and everything
// err does.
type wrapped struct {
	msg string
	err error
}

func (w *wrapped) Error() string { return w.msg }
func (w *wrapped) Unwrap() error { return w.err }
