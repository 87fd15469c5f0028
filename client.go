package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
)

// Enqueuer is what both *asynq.Client and *Client offer, so code can take
// either.
type Enqueuer interface {
	Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error)
	EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error)
}

var (
	_ Enqueuer = (*asynq.Client)(nil)
	_ Enqueuer = (*Client)(nil)
)

// Client deduplicates enqueues through an asynq client. It is safe for
// concurrent use.
type Client struct {
	d    *Dedup
	next Enqueuer

	direct    bool     // next is an asynq client on the Dedup's Redis: accepted enqueues can take one round trip
	published sync.Map // queues registered in asynq:queues by the direct path
}

// WrapClient returns a Client that deduplicates before enqueueing through
// next (usually an *asynq.Client on the same Redis).
//
// Every accepted enqueue then costs two round trips: the lock script, and
// next's enqueue. NewClient saves one.
func (d *Dedup) WrapClient(next Enqueuer) *Client {
	return &Client{d: d, next: next}
}

// NewClient returns a Client over an asynq client on the Dedup's own Redis
// client (asynq.NewClientFromRedisClient). Because the lock and the task
// live in the same Redis, an accepted enqueue of a task without
// asynq.NewTask options is stored by the lock script itself, in asynq
// v0.26.0's layout: one round trip instead of two, and no moment when the
// lock exists without its task. Other tasks go through the asynq client.
// Config.NoDirectEnqueue turns this off.
func (d *Dedup) NewClient() *Client {
	return &Client{d: d, next: asynq.NewClientFromRedisClient(d.rdb), direct: !d.cfg.NoDirectEnqueue}
}

// Enqueue is EnqueueContext with context.Background().
func (c *Client) Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return c.EnqueueContext(context.Background(), task, opts...)
}

// EnqueueContext fingerprints the task, takes its lock in one atomic script
// and enqueues it. opts may mix asynq's options with this package's; only
// asynq's reach asynq.
//
// On a duplicate it returns a *DuplicateTaskError naming the task that holds
// the key (matching ErrDuplicateTask and asynq.ErrDuplicateTask), and
// enqueues nothing — unless the type's or call's policy folds the payload
// into the holder (Replace, Merge) or into a follow-up of a running holder
// (RunningDefer): then it returns that task's TaskInfo (see Result.Info);
// use Submit to tell the cases apart. A payload the rule cannot fingerprint gives a
// *PayloadError; a bad option ErrInvalidOption; in both cases nothing is
// locked or enqueued. If asynq refuses the task, the lock is given back
// (owner-checked) — unless the task turns out to be stored after all, as when
// go-redis retried an enqueue that had landed: then its TaskInfo is returned.
//
// The lock lives in the queue the call names (asynq.Queue), else in the
// queue tasks of this type last landed in, else "default". A task that lands
// elsewhere (its queue came from asynq.NewTask) has its lock moved there.
//
// asynq.Unique and asynq.Group are refused while deduplication is on for the
// call (they would lock twice, or lose the owning task when grouped). An
// asynq.TaskID given to EnqueueContext is honoured; one given to
// asynq.NewTask is replaced by the wrapper's own ID.
func (c *Client) EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	res, err := c.Submit(ctx, task, opts...)
	if err != nil {
		return nil, err
	}
	return res.Info, nil
}

// Submit is EnqueueContext that also says what happened: whether the call
// created a task, was folded into a waiting one (Replace, Merge) or into the
// follow-up of a running one (Defer), and which task carries its payload.
// A rejected call returns a *DuplicateTaskError, as EnqueueContext does.
func (c *Client) Submit(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (Result, error) {
	if task == nil {
		return Result{}, fmt.Errorf("%w: nil task", ErrInvalidOption)
	}
	d := c.d
	typ := task.Type()
	r := d.ruleFor(typ)
	pass := make([]asynq.Option, 0, len(opts)+1)
	var (
		queue         string
		explicitQueue bool
		callerID      string
		processAt     time.Time
		conflicting   string
		dc            = directCall{msg: directMsg{retry: asynqDefaultMaxRetry}}
	)
	for _, o := range opts {
		if o == nil {
			continue
		}
		if ov, ok := o.(option); ok {
			if err := ov.apply(&r); err != nil {
				return Result{}, err
			}
			continue
		}
		switch o.Type() {
		case asynq.QueueOpt:
			if s, ok := o.Value().(string); ok {
				queue, explicitQueue = s, true
			}
		case asynq.TaskIDOpt:
			if s, ok := o.Value().(string); ok {
				callerID = s
			}
		case asynq.ProcessAtOpt:
			if t, ok := o.Value().(time.Time); ok {
				processAt = t
			}
		case asynq.ProcessInOpt:
			if dl, ok := o.Value().(time.Duration); ok {
				processAt = time.Now().Add(dl)
			}
		case asynq.UniqueOpt, asynq.GroupOpt:
			conflicting = o.String()
		}
		dc.option(o)
		pass = append(pass, o)
	}
	if explicitQueue {
		if strings.TrimSpace(queue) == "" {
			return Result{}, fmt.Errorf("%w: blank queue name", ErrInvalidOption)
		}
	} else if q, ok := d.queues.Load(typ); ok {
		queue = q.(string)
	} else {
		queue = "default"
	}
	if callerID != "" && strings.TrimSpace(callerID) == "" {
		return Result{}, fmt.Errorf("%w: blank task ID", ErrInvalidOption)
	}
	if !d.active(&r) {
		// Mark the task so the execution-time guard leaves it alone: in its ID,
		// or for a caller-chosen ID with an opt-out mark where the middleware
		// looks for its lock.
		if callerID == "" {
			pass = append(pass, asynq.TaskID(newOptOutID()))
		} else if err := c.markOptOut(ctx, queue, callerID, typ, &r, processAt); err != nil {
			return Result{}, err
		}
		return created(c.next.EnqueueContext(ctx, task, pass...))
	}
	if conflicting != "" {
		return Result{}, fmt.Errorf("%w: %s cannot be combined with deduplication (use dedup.Skip() to enqueue this call without it)", ErrInvalidOption, conflicting)
	}
	fp, err := d.fingerprintHex(typ, task.Payload(), &r)
	if err != nil {
		return Result{}, err
	}
	id := callerID
	if id == "" {
		id = newLockedID(fp)
		pass = append(pass, asynq.TaskID(id))
	}
	ref := d.newRef(queue, fp, id, typ, callerID != "")

	args := acquireArgs{ttl: waitTTL(d.ttlOf(&r), processAt), conflict: r.conflict, running: r.running, max: r.maxPending}
	if r.conflict == Replace || r.running == RunningDefer {
		args.payload = task.Payload()
	}
	if r.running == RunningDefer {
		args.followID = newLockedID(fp)
	}
	if msg, ok := c.prepareDirect(&dc, task, id, queue, explicitQueue, processAt); ok && c.publishQueue(ctx, queue) == nil {
		args.msg = msg
		if dc.msg.scheduled() {
			args.scheduleAt = processAt.Unix()
		}
	}
	locked, self := true, false
	var backoff, reserved int
	for merges := 0; ; {
		rep, err := d.acquire(ctx, ref, args)
		if err != nil {
			if !d.onRedisError(ctx, "acquire", typ, err) {
				return Result{}, unavailable("acquire", err)
			}
			locked = false // fail-open: the execution-time guard still locks it
			break
		}
		switch rep.status {
		case statusTaken:
			if args.msg != nil { // the script stored the task too: done in one round trip
				d.count(typ, evLocked)
				return Result{Outcome: Created, TaskID: id, Info: dc.msg.info()}, nil
			}
		case statusConflict:
			return Result{}, fmt.Errorf("dedup: enqueue %q: %w", typ, asynq.ErrTaskIDConflict)
		case statusSelf:
			self = true // the caller's ID already holds the key: not this call's lock to give back
		case statusHeld:
			d.count(typ, evDuplicate)
			return Result{}, &DuplicateTaskError{TaskID: rep.str(0), Queue: queue, Type: typ, Key: ref.key}
		case statusReplaced:
			d.count(typ, evCoalesced)
			d.noteCoalesced(typ, ref.fpHex, r.key)
			return folded(Replaced, rep.str(0), queue, task, task.Payload(), rep.str(1)), nil
		case statusDeferred:
			d.count(typ, evDeferred)
			d.noteCoalesced(typ, ref.fpHex, r.key)
			return folded(Deferred, rep.str(0), queue, task, task.Payload(), "scheduled"), nil
		case statusMerge:
			target, old, ver := rep.str(0), rep.str(1), rep.str(2)
			merged, err := r.merge([]byte(old), task.Payload())
			if err != nil {
				return Result{}, fmt.Errorf("dedup: merge %q into task %s: %w", typ, target, err)
			}
			if mfp, err := d.fingerprintHex(typ, merged, &r); err != nil || mfp != fp {
				return Result{}, fmt.Errorf("%w: merge function changed the key of %q (or broke its payload)", ErrInvalidPayload, typ)
			}
			ok, state, err := d.coalesce(ctx, ref, target, ver, merged)
			if err != nil {
				if errors.Is(err, ErrIncompatible) {
					return Result{}, err
				}
				d.count(typ, evRedisError)
				return Result{}, unavailable("coalesce", err)
			}
			if ok {
				d.count(typ, evMerged)
				d.noteCoalesced(typ, ref.fpHex, r.key)
				return folded(Merged, target, queue, task, merged, state), nil
			}
			if merges++; merges >= maxMergeAttempts {
				return Result{}, fmt.Errorf("%w: %q into task %s after %d attempts", ErrContention, typ, target, merges)
			}
			continue // lost the race: read the new state and merge again
		case statusReserved:
			// The holder's producer took the lock but asynq has not stored
			// the task yet (one round trip away): fold into it once it has.
			if reserved++; reserved > maxReservedWaits {
				d.count(typ, evDuplicate)
				return Result{}, &DuplicateTaskError{TaskID: rep.str(0), Queue: queue, Type: typ, Key: ref.key}
			}
			t := time.NewTimer(reservedBackoff.Delay(reserved))
			select {
			case <-ctx.Done():
				t.Stop()
				return Result{}, fmt.Errorf("dedup: waiting for task %s to be stored: %w", rep.str(0), ctx.Err())
			case <-t.C:
			}
			continue
		case statusOver:
			if !r.waitForRoom {
				d.count(typ, evOverBound)
				return Result{}, fmt.Errorf("%w: %s keys of %q already waiting in queue %q", ErrTooManyPending, rep.str(0), typ, queue)
			}
			t := time.NewTimer(roomBackoff.Delay(backoff))
			backoff++
			select {
			case <-ctx.Done():
				t.Stop()
				d.count(typ, evOverBound)
				return Result{}, fmt.Errorf("%w: waited for room: %w", ErrTooManyPending, ctx.Err())
			case <-t.C:
			}
			continue
		case statusBroken:
			return Result{}, fmt.Errorf("%w: %s", ErrIncompatible, rep.str(0))
		default:
			return Result{}, fmt.Errorf("dedup: unexpected acquire status %d", rep.status)
		}
		break
	}

	info, err := c.next.EnqueueContext(ctx, task, pass...)
	if err != nil {
		err = enqueueError(typ, err)
		if !locked || self {
			return Result{}, err
		}
		return created(c.rollback(ctx, task, ref, err))
	}
	if !explicitQueue {
		d.queues.Store(typ, info.Queue)
	}
	if !locked {
		return created(info, nil)
	}
	if info.Queue != queue {
		// Relocation only moves this task's lock: no policy folds into others.
		return created(c.relocate(ctx, task, ref, info, acquireArgs{ttl: waitTTL(d.ttlOf(&r), info.NextProcessAt), running: r.running}))
	}
	d.count(typ, evLocked)
	if processAt.IsZero() && info.State == asynq.TaskStateScheduled {
		// Scheduled through asynq.NewTask options: cover the delay too.
		if _, err := d.extend(context.WithoutCancel(ctx), ref, "", waitTTL(d.ttlOf(&r), info.NextProcessAt)); err != nil {
			d.count(typ, evRedisError)
			d.log.Warn("dedup: could not lengthen a scheduled task's lock", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", err))
		}
	}
	return created(info, nil)
}

// maxMergeAttempts bounds the compare-and-set retries of one Merge.
const maxMergeAttempts = 32

// A holder whose producer has not stored it yet is waited for, briefly.
const maxReservedWaits = 20

var reservedBackoff = Backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}

// roomBackoff spaces the polls of WaitForRoom.
var roomBackoff = Backoff{Min: 10 * time.Millisecond, Max: time.Second}

func created(info *asynq.TaskInfo, err error) (Result, error) {
	if err != nil {
		return Result{}, err
	}
	return Result{Outcome: Created, TaskID: info.ID, Info: info}, nil
}

// folded describes the task a call was folded into, from what the lock
// script saw.
func folded(o Outcome, id, queue string, task *asynq.Task, payload []byte, state string) Result {
	return Result{Outcome: o, TaskID: id, Info: &asynq.TaskInfo{
		ID: id, Queue: queue, Type: task.Type(), Payload: payload, State: parseState(state),
	}}
}

func parseState(s string) asynq.TaskState {
	switch s {
	case "pending":
		return asynq.TaskStatePending
	case "scheduled":
		return asynq.TaskStateScheduled
	case "retry":
		return asynq.TaskStateRetry
	case "active":
		return asynq.TaskStateActive
	}
	return 0
}

// rollback handles a refused enqueue after the lock was taken. If the task
// is stored (an enqueue that landed but reported an error, such as
// ErrTaskIDConflict for our own ID after a go-redis retry) the lock stays and
// the task is returned; if it is not, the lock is given back; if that cannot
// be told, the lock stays and heals itself once its task is found missing.
func (c *Client) rollback(ctx context.Context, task *asynq.Task, ref *lockRef, enqErr error) (*asynq.TaskInfo, error) {
	d := c.d
	ctx = context.WithoutCancel(ctx)
	ti, err := d.insp.GetTaskInfo(ref.queue, ref.id)
	switch {
	case err == nil:
		if ti.Type == task.Type() && bytes.Equal(ti.Payload, task.Payload()) {
			d.count(task.Type(), evLocked)
			return ti, nil
		}
		// A different task has this (caller-chosen) ID: ours never landed.
	case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
	default:
		d.count(task.Type(), evRedisError)
		return nil, enqErr
	}
	if _, err := d.unlock(ctx, ref); err != nil {
		d.count(task.Type(), evRedisError)
		d.log.Warn("dedup: could not give back the lock of a refused enqueue; it heals itself", slog.String("type", task.Type()), slog.Any("error", err))
	} else {
		d.count(task.Type(), evRollback)
	}
	return nil, enqErr
}

// enqueueError wraps an error from asynq's enqueue. asynq flattens Redis
// failures into text, so anything but its own refusals (a taken task ID, a
// Unique duplicate) is a failure to reach Redis: it matches ErrUnavailable.
func enqueueError(typ string, err error) error {
	if errors.Is(err, asynq.ErrTaskIDConflict) || errors.Is(err, asynq.ErrDuplicateTask) {
		return fmt.Errorf("dedup: enqueue %q: %w", typ, err)
	}
	return fmt.Errorf("%w: enqueue %q: %w", ErrUnavailable, typ, err)
}

// relocate moves the lock to the queue the task actually landed in.
func (c *Client) relocate(ctx context.Context, task *asynq.Task, old *lockRef, info *asynq.TaskInfo, args acquireArgs) (*asynq.TaskInfo, error) {
	d := c.d
	ctx = context.WithoutCancel(ctx)
	fp := *old
	nr := &fp
	nr.queue = info.Queue
	nr.key = lockKeyHex(d.cfg.Prefix, info.Queue, old.fpHex)
	if old.idx != "" {
		nr.idx = indexKey(d.cfg.Prefix, info.Queue, old.id)
	}
	rep, err := d.acquire(ctx, nr, args) // Reject policy, no follow-up ID: it takes or names a holder
	st, holder := rep.status, rep.str(0)
	if _, uerr := d.unlock(ctx, old); uerr != nil {
		d.count(task.Type(), evRedisError)
	}
	switch {
	case err != nil:
		d.count(task.Type(), evRedisError)
		d.log.Warn("dedup: could not move a lock to the task's queue; the execution-time guard will lock it", slog.String("type", task.Type()), slog.Any("error", err))
	case st == statusTaken || st == statusSelf:
		d.count(task.Type(), evLocked)
	case st == statusHeld || st == statusReserved:
		// Our task duplicates one already in that queue: take it back out.
		if derr := d.insp.DeleteTask(info.Queue, info.ID); derr != nil {
			d.log.Warn("dedup: duplicate landed in another queue and could not be removed; the execution-time guard will hold it back", slog.String("type", task.Type()), slog.String("task_id", info.ID), slog.Any("error", derr))
			return info, nil
		}
		d.count(task.Type(), evDuplicate)
		return nil, &DuplicateTaskError{TaskID: holder, Queue: info.Queue, Type: task.Type(), Key: nr.key}
	default:
		d.log.Warn("dedup: unexpected reply moving a lock; the execution-time guard will lock the task", slog.String("type", task.Type()), slog.Int64("status", st))
	}
	return info, nil
}

// optOutMark is the index value that marks a caller-chosen task ID as opted
// out (fingerprints are hex, so it cannot be one).
const optOutMark = "-"

// optOutMarkTTL is how long that mark lasts at least: tasks that wait longer
// than it are treated as arriving without a lock.
const optOutMarkTTL = 24 * time.Hour

// markOptOut records that the caller-chosen task ID opted out, so the
// middleware does not lock it at execution.
func (c *Client) markOptOut(ctx context.Context, queue, id, typ string, r *resolved, processAt time.Time) error {
	d := c.d
	ttl := waitTTL(max(d.ttlOf(r), optOutMarkTTL), processAt)
	_, err := d.call(ctx, func(cctx context.Context) (any, error) {
		return nil, d.rdb.Set(cctx, indexKey(d.cfg.Prefix, queue, id), optOutMark, ttl).Err()
	})
	if err != nil {
		d.count(typ, evRedisError)
		if d.cfg.FailOpen {
			return nil // the guard may lock it at execution: the safe side
		}
		return unavailable("opt-out mark", err)
	}
	return nil
}
