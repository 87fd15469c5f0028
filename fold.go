package dedup

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// next says what an enqueue does after one acquire.
type next int

const (
	done    next = iota // the answer is final
	enqueue             // the lock is taken (or fail-open): enqueue through asynq
	again               // call acquire again
)

// waits counts the retries of one enqueue's acquire.
type waits struct{ merges, reserved, room int }

// errMergeChangedKey is the cause of a merge whose result has another key
// than its inputs (or no key at all).
var errMergeChangedKey = errors.New("merge function changed the key (or broke the payload)")

// maxMergeAttempts bounds the compare-and-set retries of one Merge.
const maxMergeAttempts = 32

// A holder whose producer took the lock but has not stored its task yet
// (a WrapClient's Enqueuer, one round trip away) is waited for, briefly
// (about 0.8 s in all); then the call is answered as a duplicate of it, its
// payload not folded in: a task that never comes (its producer died, an
// operator deleted it) leaves the lock to heal after the heal grace, which no
// caller should wait out.
const maxReservedWaits = 20

var reservedBackoff = backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}

// roomBackoff spaces the polls of WaitForRoom.
var roomBackoff = backoff{Min: 10 * time.Millisecond, Max: time.Second}

// lock runs the acquire script until its answer is final: the call is
// answered (a duplicate, a fold, a task the script stored itself), or the
// lock is taken and the task is to be enqueued.
func (c *Client) lock(ctx context.Context, k *call) (Result, next, error) {
	var w waits
	return c.relock(ctx, k, &w)
}

// relock is lock for a call that has made w's retries already.
func (c *Client) relock(ctx context.Context, k *call, w *waits) (Result, next, error) {
	for {
		res, err := c.d.store.Acquire(ctx, &k.acquire)
		out, n, err := c.acquired(ctx, k, res, err, w)
		if n != again {
			return out, n, err
		}
	}
}

// acquired turns one acquire's answer, or its failure err, into the
// call's: final, enqueue, or again.
func (c *Client) acquired(ctx context.Context, k *call, res store.AcquireResult, err error, w *waits) (Result, next, error) {
	if err != nil && w.room > 0 && !res.Sent && ctx.Err() != nil {
		// The caller's context ended while it waited for room: the answer
		// is still "no room", whichever call the end interrupted.
		c.d.count(k.typ, evOverBound)
		return Result{}, done, errorf("%w: waited for room: %w", ErrTooManyPending, ctx.Err())
	}
	if err != nil {
		return c.acquireFailed(ctx, k, res.Sent, err)
	}
	return c.outcome(ctx, k, res, w)
}

// acquireFailed decides what a failed acquire means: fail-closed, or
// fail-open (the execution-time guard still locks the task).
func (c *Client) acquireFailed(ctx context.Context, k *call, sent bool, err error) (Result, next, error) {
	if errors.Is(err, store.ErrMoving) {
		return Result{}, done, errorf("%w: %q: %w", ErrContention, k.typ, err)
	}
	if sent {
		// The script carried the task and may run, and store it, after the
		// call gave up on it, even after a look finds nothing: the answer is
		// "created" or "unknown", never "failed"; and not fail-open, which
		// would enqueue it a second time. Unless Redis refused it before
		// running it, for a reason that refuses any late copy too (ACL, out
		// of memory): then nothing was stored, and nothing will be. (A
		// call that never reached Redis, such as one whose connection was
		// refused, is not sent: store.Unreached.)
		uerr := unavailable("acquire", err)
		ti, lerr := c.landed(ctx, k, uerr)
		switch refused := store.Refused(err); {
		case ti != nil:
			return Result{Outcome: Created, TaskID: ti.ID, Info: ti}, done, nil
		case lerr != nil && !refused: // (refused: no copy ran, whatever the look says)
			return Result{}, done, lerr
		case !refused:
			return Result{}, done, outcomeUnknown(k.ref.ID, uerr, nil)
		}
	}
	if cerr := ctx.Err(); cerr != nil && errors.Is(err, cerr) {
		return Result{}, done, errorf("dedup: enqueue %q: %w", k.typ, err) // the caller's own end, not an outage
	}
	if !c.d.onRedisError(ctx, "acquire", k.typ, err) {
		return Result{}, done, unavailable("acquire", err)
	}
	k.locked = false
	if err := k.markUnlocked(); err != nil {
		return Result{}, done, err
	}
	return Result{}, enqueue, nil
}

// outcome turns the script's answer into the call's.
func (c *Client) outcome(ctx context.Context, k *call, res store.AcquireResult, w *waits) (Result, next, error) {
	d := c.d
	switch res.Status {
	case store.StatusTaken:
		if !res.Stored {
			return Result{}, enqueue, nil
		}
		d.count(k.typ, evLocked) // the script stored the task too: one round trip
		return Result{Outcome: Created, TaskID: k.ref.ID, Info: k.storedInfo()}, done, nil
	case store.StatusSelf, store.StatusConflict:
		return c.idTaken(ctx, k, res.Status)
	case store.StatusHeld:
		if res.Task == k.ref.ID {
			return c.ownHolder(ctx, k, res)
		}
		return Result{}, done, c.duplicate(k, res)
	case store.StatusCooling:
		return Result{}, done, c.duplicate(k, res)
	case store.StatusReplaced:
		return c.folded(k, Replaced, evReplaced, res.Task, k.task.Payload(), res.State, res.FollowUp), done, nil
	case store.StatusDeferred:
		return c.folded(k, Deferred, evDeferred, res.Task, k.task.Payload(), "scheduled", true), done, nil
	case store.StatusMerge:
		if res.Task == k.ref.ID && (k.callerID == "" || bytes.Equal(res.Payload, k.task.Payload())) {
			return c.repeated(ctx, k) // merging the payload into itself would count it twice
		}
		return c.merge(ctx, k, res, w)
	case store.StatusReserved:
		return c.waitReserved(ctx, k, res, w)
	case store.StatusOver:
		return c.waitRoom(ctx, k, res, w)
	case store.StatusBroken:
		return Result{}, done, errorf("%w: %s", ErrIncompatible, res.Reason)
	}
	return Result{}, done, errorf("dedup: unexpected acquire status %d", res.Status)
}

// idTaken answers a call whose task ID already holds the key (StatusSelf:
// the caller enqueues it again, through asynq) or is taken
// (StatusConflict). A direct call carried its task: when its own ID holds
// the key, or its own ID (not the caller's) is taken, an earlier run of
// this very call stored the task (go-redis retries a call whose reply was
// lost), and then the answer is that task, created.
func (c *Client) idTaken(ctx context.Context, k *call, st store.Status) (Result, next, error) {
	if k.acquire.Direct && (st == store.StatusSelf || k.callerID == "") {
		ti, err := c.landed(ctx, k, nil)
		switch {
		case ti != nil:
			return Result{Outcome: Created, TaskID: ti.ID, Info: ti}, done, nil
		case err != nil:
			return Result{}, done, err
		}
	}
	if st == store.StatusSelf {
		// asynq's client stores it under the lock its ID holds, and its
		// record will not name that lock: its end releases it.
		k.self = true
		if !k.terms.flags.Has(store.FlagRelease) {
			k.terms.flags += store.Flags([]byte{store.FlagRelease})
			if err := k.markTask(); err != nil {
				return Result{}, done, err
			}
		}
		return Result{}, enqueue, nil
	}
	return Result{}, done, errorf("dedup: enqueue %q: %w", k.typ, asynq.ErrTaskIDConflict)
}

// ownHolder answers a call that met its own task holding the key: a
// repeat of a call that created it (go-redis retried a call whose reply was
// lost, or the caller enqueues again under its caller-chosen ID with the
// same payload) gets that task, created; another payload under the same
// caller-chosen ID is a duplicate of it (that also matches
// asynq.ErrTaskIDConflict, asynq's answer to a taken ID).
func (c *Client) ownHolder(ctx context.Context, k *call, res store.AcquireResult) (Result, next, error) {
	if k.callerID == "" { // an ID the wrapper chose for this call alone
		return c.repeated(ctx, k)
	}
	ti, err := c.landed(ctx, k, nil)
	switch {
	case err != nil:
		return Result{}, done, err
	case ti != nil:
		return Result{Outcome: Created, TaskID: ti.ID, Info: ti}, done, nil
	}
	err = c.duplicate(k, res)
	var dup *DuplicateTaskError
	if errors.As(err, &dup) {
		dup.ownID = true
	}
	return Result{}, done, err
}

// repeated answers a call whose task is stored already (an earlier run of
// the same call, or the same payload under its caller-chosen ID): created.
func (c *Client) repeated(ctx context.Context, k *call) (Result, next, error) {
	ti, err := c.landed(ctx, k, nil)
	switch {
	case err != nil:
		return Result{}, done, err
	case ti == nil:
		ti = &asynq.TaskInfo{ID: k.ref.ID, Queue: k.queue, Type: k.typ, Payload: k.task.Payload()}
	}
	return Result{Outcome: Created, TaskID: ti.ID, Info: ti}, done, nil
}

// duplicate is the error of a call whose key holder the script named
// (held, still unstored, cooling down after its success, or held after
// its failure).
func (c *Client) duplicate(k *call, res store.AcquireResult) error {
	cooling := res.Status == store.StatusCooling && !res.Failed
	if !k.rule.quiet {
		c.d.count(k.typ, evDuplicate)
		c.d.decide(Decision{Event: eventNames[evDuplicate], Type: k.typ, Queue: k.queue, Key: res.Lock, TaskID: res.Task, FollowUp: res.FollowUp, CoolingDown: cooling, FailHeld: res.Failed})
	}
	return &DuplicateTaskError{Holder: res.Task, Queue: k.queue, Type: k.typ, Key: res.Lock, CoolingDown: cooling, FailHeld: res.Failed, FreeIn: res.Cooling}
}

// folded describes the task a call was folded into, from what the lock
// script saw.
func (c *Client) folded(k *call, o Outcome, ev event, id string, payload []byte, state string, followUp bool) Result {
	if !k.rule.quiet { // (a busy arrival folded by the middleware is counted as busy)
		c.d.count(k.typ, ev)
		c.d.noteFold(k.typ, k.ref.FP, k.rule.key)
	}
	if c.d.cfg.OnDecision != nil && !k.rule.quiet {
		c.d.decide(Decision{Event: eventNames[ev], Type: k.typ, Queue: k.queue, Key: c.d.lockKey(&k.ref), TaskID: id, FollowUp: followUp})
	}
	return Result{Outcome: o, TaskID: id, FollowUp: followUp, NotApplied: k.notApplied(), Info: &asynq.TaskInfo{
		ID: id, Queue: k.queue, Type: k.typ, Payload: payload, State: parseState(state),
	}}
}

// notApplied names the call's asynq options that a fold leaves unused: the
// payload goes into a task that keeps its own options. The queue is where
// the key lives, and applies; a task ID the wrapper chose is not the
// caller's.
func (k *call) notApplied() []string {
	var out []string
	own, _ := taskOpts(k.task) // asynq.NewTask's, which the call's follow
	for _, o := range append(own[:len(own):len(own)], k.pass...) {
		if _, mine := o.(option); mine || o == nil {
			continue // (this package's: applied, or named below)
		}
		switch o.Type() {
		case asynq.QueueOpt:
			continue
		case asynq.ProcessInOpt, asynq.ProcessAtOpt:
			if k.rule.debounce > 0 {
				continue // the fold moved the task's due time (Debounce)
			}
		case asynq.TaskIDOpt:
			if k.callerID == "" {
				continue
			}
		}
		out = append(out, o.String())
	}
	out = append(out, k.rule.callKept...) // the key keeps the cooldown and failure policy it was taken with
	return out
}

func parseState(s string) asynq.TaskState {
	switch s {
	case store.StatePending:
		return asynq.TaskStatePending
	case store.StateScheduled:
		return asynq.TaskStateScheduled
	case store.StateRetry:
		return asynq.TaskStateRetry
	case store.StateActive:
		return asynq.TaskStateActive
	}
	return 0
}

// merge merges the new payload into the stored one and writes it with a
// compare-and-set; a lost race reads the new state and merges again.
func (c *Client) merge(ctx context.Context, k *call, res store.AcquireResult, w *waits) (Result, next, error) {
	d := c.d
	merged, err := k.rule.merge(res.Payload, k.task.Payload())
	if err != nil {
		return Result{}, done, errorf("dedup: merge %q into task %s: %w", k.typ, res.Task, err)
	}
	if mfp, err := d.fingerprintHex(k.typ, merged, &k.rule); err != nil || mfp != k.ref.FP {
		return Result{}, done, &PayloadError{Type: k.typ, Err: errMergeChangedKey}
	}
	cr, err := d.store.Merge(ctx, &store.Merge{Ref: k.ref, Target: res.Task, Follow: res.FollowUp, Version: res.Version, Payload: merged,
		DebounceDue: k.acquire.DebounceDue, TTL: k.acquire.TTL, Bounded: k.acquire.MaxPending > 0, Now: time.Now()})
	switch {
	case err != nil:
		d.count(k.typ, evRedisError)
		return Result{}, done, unavailable("merge", err)
	case cr.Broken != "":
		return Result{}, done, errorf("%w: %s", ErrIncompatible, cr.Broken)
	case cr.Written:
		return c.folded(k, Merged, evMerged, res.Task, merged, cr.State, res.FollowUp), done, nil
	}
	if w.merges++; w.merges >= maxMergeAttempts {
		return Result{}, done, errorf("%w: %q into task %s after %d attempts", ErrContention, k.typ, res.Task, w.merges)
	}
	return Result{}, again, nil
}

// waitReserved waits for a holder whose producer took the lock but has not
// stored the task yet (one round trip away), to fold into it once it has.
func (c *Client) waitReserved(ctx context.Context, k *call, res store.AcquireResult, w *waits) (Result, next, error) {
	if w.reserved++; w.reserved > maxReservedWaits {
		return Result{}, done, c.duplicate(k, res)
	}
	if err := sleep(ctx, reservedBackoff.delay(w.reserved)); err != nil {
		return Result{}, done, errorf("dedup: waiting for task %s to be stored: %w", res.Task, err)
	}
	return Result{}, again, nil
}

// waitRoom waits, with WaitForRoom, while the type's MaxPending keys wait.
// First it drops the entries of keys whose task cannot run any more (an
// operator deleted or archived it): they hold no slot.
func (c *Client) waitRoom(ctx context.Context, k *call, res store.AcquireResult, w *waits) (Result, next, error) {
	waiting := res.Waiting
	if n, err := c.d.store.PruneWaiting(ctx, k.queue, k.typ, res.Waiting, res.Queued, time.Now()); err != nil {
		c.d.count(k.typ, evRedisError)
		c.d.log.Warn("dedup: could not check the waiting keys of a full MaxPending type", slog.String("type", k.typ), slog.Any("error", err))
	} else if n > 0 {
		return Result{}, again, nil
	}
	if !k.rule.waitForRoom {
		c.d.count(k.typ, evOverBound)
		return Result{}, done, errorf("%w: %d keys of %q already waiting in queue %q", ErrTooManyPending, waiting, k.typ, k.queue)
	}
	if err := sleep(ctx, roomBackoff.delay(w.room)); err != nil {
		c.d.count(k.typ, evOverBound)
		return Result{}, done, errorf("%w: waited for room: %w", ErrTooManyPending, err)
	}
	w.room++
	return Result{}, again, nil
}

// sleep waits d, or returns ctx's error if it ends first.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
