package dedup

import (
	"fmt"

	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
)

// Conflict says what an enqueue does when its key is held by a task that is
// still waiting to run (pending, scheduled, or waiting for a retry).
type Conflict int

const (
	// Reject returns a *DuplicateTaskError naming the waiting task. Default.
	Reject Conflict = iota
	// Replace writes the new payload into the waiting task, in place: it
	// keeps its ID and its place in the queue, and when it runs its handler
	// sees the newest payload (latest wins). For payloads that describe state.
	Replace
	// Merge writes MergeFunc(old, new) into the waiting task, in place. For
	// commutative updates (counters, sets, max timestamps). Concurrent
	// producers never lose an update: the write is compare-and-set.
	Merge
)

func (c Conflict) String() string {
	switch c {
	case Reject:
		return "reject"
	case Replace:
		return "replace"
	case Merge:
		return "merge"
	}
	return fmt.Sprintf("Conflict(%d)", int(c))
}

// fold is the policy as the lock script spells it.
func (c Conflict) fold() store.Fold {
	switch c {
	case Replace:
		return store.FoldReplace
	case Merge:
		return store.FoldMerge
	}
	return store.FoldReject
}

// Running says what an enqueue does when its key's task is running.
type Running int

const (
	// RunningReject returns a *DuplicateTaskError naming the running task:
	// the lock lasts until the task is done. Default.
	RunningReject Running = iota
	// RunningAllow frees the key when its task starts: a new enqueue creates
	// a new task, which may run while the first still runs.
	RunningAllow
	// RunningDefer never runs two tasks of a key at once. Enqueues that arrive
	// while it runs are folded (by the Conflict policy: replaced or merged;
	// with Reject, only the first is kept) into one follow-up task, which
	// takes the lock and is queued when the run ends — whether it succeeds or
	// fails for good; after a failure with retries left, the follow-up waits
	// for the retry. The follow-up is stored in asynq at once (parked in the
	// scheduled set until the run ends), so a worker crash cannot lose it:
	// it runs after the crashed task's retry, or when its parking time
	// (the key's TTL) passes.
	RunningDefer
)

func (r Running) String() string {
	switch r {
	case RunningReject:
		return "reject"
	case RunningAllow:
		return "allow"
	case RunningDefer:
		return "defer"
	}
	return fmt.Sprintf("Running(%d)", int(r))
}

// code is the policy as locks record it.
func (r Running) code() store.Running {
	switch r {
	case RunningAllow:
		return store.RunAllow
	case RunningDefer:
		return store.RunDefer
	}
	return store.RunReject
}

// MergeFunc combines the payload stored in a waiting task with a new one.
// It must not change the fields the key is made of. An error leaves the
// stored payload as it was and is returned to the caller.
type MergeFunc func(old, new []byte) ([]byte, error)

// Outcome says what an enqueue did. The zero Outcome, printed "none", is
// that of a call that returned an error (rejected, refused or failed: see
// the error), as in a failed BatchResult.
type Outcome int

const (
	// Created: a new task was enqueued holding the key.
	Created Outcome = iota + 1
	// Replaced: the new payload replaced a waiting task's (Result.TaskID).
	Replaced
	// Merged: the new payload was merged into a waiting task's (Result.TaskID).
	Merged
	// Deferred: the key's task is running; a follow-up task (Result.TaskID)
	// was created to run after it. Later calls folded into that follow-up
	// report Replaced or Merged, with Result.FollowUp set.
	Deferred
)

// String returns the outcome's name: "created", "replaced", "merged",
// "deferred", or "none" for the zero Outcome.
func (o Outcome) String() string {
	switch o {
	case 0:
		return "none"
	case Created:
		return "created"
	case Replaced:
		return "replaced"
	case Merged:
		return "merged"
	case Deferred:
		return "deferred"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is what Client.Submit did. A rejected enqueue is an error
// (*DuplicateTaskError), not a Result.
type Result struct {
	Outcome Outcome
	// TaskID is the task that will carry this call's payload: the new task,
	// the waiting task it was folded into, or the follow-up.
	TaskID string
	// Info describes that task. For Created it is asynq's own TaskInfo; for
	// the others it is filled from what the lock script saw: ID, Queue, Type,
	// Payload (the stored one after the call) and State; other fields are zero.
	Info *asynq.TaskInfo
	// FollowUp is true when TaskID is the follow-up of a running task
	// (RunningDefer): always for Deferred, which created it, and for a
	// Replaced or Merged call folded into a follow-up made earlier.
	FollowUp bool
	// NotApplied names, for a call folded into another task (Replaced,
	// Merged, Deferred), the call's options that task did not take
	// (asynq's ProcessIn, MaxRetry, Timeout, a TaskID, ...; a
	// dedup.Cooldown, dedup.Headers): it keeps its own. Nil when there
	// were none, and for Created.
	NotApplied []string
	// Fingerprint is the call's key hashed, as its lock key ends (16 or 32
	// hex digits; see Config.HashKey): never the key's own text. Empty for
	// a call that is not deduplicated (Skip, Config.OptIn without a rule).
	Fingerprint string
	// Conflict and Running are the policies the call was made with: its
	// type's rule with the call's options (zero for a call that is not
	// deduplicated).
	Conflict Conflict
	Running  Running
	// FailOpen is true when Redis failed and the task was enqueued without
	// a lock (Config.FailOpen); the execution-time guard locks it when it
	// starts.
	FailOpen bool
}

// OnConflict sets this call's policy for a key held by a waiting task,
// overriding the type's rule. Merge needs a merge function: the call's
// MergeWith, or the type's Rule.MergeFunc. With Config.OptIn it opts the
// call in.
func OnConflict(c Conflict) asynq.Option {
	return option{desc: "dedup.OnConflict(" + c.String() + ")", apply: func(r *resolved) error {
		if c < Reject || c > Merge {
			return errorf("%w: unknown Conflict %d", ErrInvalidOption, int(c))
		}
		r.callConflict, r.callConflictSet, r.optedIn = c, true, true
		return nil
	}}
}

// MergeWith makes this call merge into a waiting task's payload with fn
// (OnConflict Merge with this function). With Config.OptIn it opts the
// call in.
func MergeWith(fn MergeFunc) asynq.Option {
	return option{desc: "dedup.MergeWith(…)", apply: func(r *resolved) error {
		if fn == nil {
			return errorf("%w: MergeWith(nil)", ErrInvalidOption)
		}
		r.callMerge, r.optedIn = fn, true
		return nil
	}}
}

// settleConflict applies the call's OnConflict and MergeWith once every
// option has been read, so their order does not matter: MergeWith means
// Merge, and contradicts an OnConflict of another policy.
func (r *resolved) settleConflict() error {
	if err := r.takeConflict(); err != nil {
		return err
	}
	if r.conflict == Merge && r.merge == nil {
		return errorf("%w: OnConflict(Merge) without a merge function (use MergeWith, or Rule.MergeFunc)", ErrInvalidOption)
	}
	return nil
}

// takeConflict makes the OnConflict and MergeWith read so far the rule's
// policy (MergeWith means Merge, and contradicts an OnConflict of another
// policy).
func (r *resolved) takeConflict() error {
	switch {
	case r.callMerge != nil && r.callConflictSet && r.callConflict != Merge:
		return errorf("%w: MergeWith and OnConflict(%v) in one call", ErrInvalidOption, r.callConflict)
	case r.callMerge != nil:
		r.conflict, r.merge = Merge, r.callMerge
	case r.callConflictSet:
		r.conflict = r.callConflict
	}
	return nil
}

// WaitForRoom makes a call whose new key is over the type's MaxPending wait
// (polling with backoff, bounded by its context) instead of failing with
// ErrTooManyPending. With Config.OptIn it opts the call in.
func WaitForRoom() asynq.Option {
	return option{desc: "dedup.WaitForRoom()", apply: func(r *resolved) error {
		r.waitForRoom, r.optedIn = true, true
		return nil
	}}
}
