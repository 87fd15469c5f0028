package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
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
}

// WrapClient returns a Client that deduplicates before enqueueing through
// next (usually an *asynq.Client on the same Redis).
func (d *Dedup) WrapClient(next Enqueuer) *Client {
	return &Client{d: d, next: next}
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
// enqueues nothing. A payload the rule cannot fingerprint gives a
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
	if task == nil {
		return nil, fmt.Errorf("%w: nil task", ErrInvalidOption)
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
	)
	for _, o := range opts {
		if o == nil {
			continue
		}
		if ov, ok := o.(option); ok {
			if err := ov.apply(&r); err != nil {
				return nil, err
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
		pass = append(pass, o)
	}
	if !d.active(&r) {
		if callerID == "" {
			// Mark the task so the execution-time guard leaves it alone.
			pass = append(pass, asynq.TaskID(newOptOutID()))
		}
		return c.next.EnqueueContext(ctx, task, pass...)
	}
	if conflicting != "" {
		return nil, fmt.Errorf("%w: %s cannot be combined with deduplication (use dedup.Skip() to enqueue this call without it)", ErrInvalidOption, conflicting)
	}
	if explicitQueue {
		if strings.TrimSpace(queue) == "" {
			return nil, fmt.Errorf("%w: blank queue name", ErrInvalidOption)
		}
	} else if q, ok := d.queues.Load(typ); ok {
		queue = q.(string)
	} else {
		queue = "default"
	}
	if callerID != "" && strings.TrimSpace(callerID) == "" {
		return nil, fmt.Errorf("%w: blank task ID", ErrInvalidOption)
	}
	fp, err := fingerprint(typ, task.Payload(), &r)
	if err != nil {
		return nil, err
	}
	id := callerID
	if id == "" {
		id = newLockedID(fp)
		pass = append(pass, asynq.TaskID(id))
	}
	ref := d.newRef(queue, fp, id, typ, callerID != "")

	locked := true
	st, holder, err := d.acquire(ctx, ref, waitTTL(d.ttlOf(&r), processAt))
	switch {
	case err != nil:
		if !d.onRedisError(ctx, "acquire", typ, err) {
			return nil, unavailable("acquire", err)
		}
		locked = false // fail-open: the execution-time guard still locks it
	case st == statusHeld:
		d.count(task.Type(), evDuplicate)
		return nil, &DuplicateTaskError{TaskID: holder, Queue: queue, Type: typ, Key: ref.key}
	}

	info, err := c.next.EnqueueContext(ctx, task, pass...)
	if err != nil {
		if !locked {
			return nil, err
		}
		return c.rollback(ctx, task, ref, err)
	}
	if !explicitQueue {
		d.queues.Store(typ, info.Queue)
	}
	if !locked {
		return info, nil
	}
	d.count(task.Type(), evLocked)
	if info.Queue != queue {
		return c.relocate(ctx, task, ref, info, waitTTL(d.ttlOf(&r), info.NextProcessAt))
	}
	if processAt.IsZero() && info.State == asynq.TaskStateScheduled {
		// Scheduled through asynq.NewTask options: cover the delay too.
		if _, err := d.extend(context.WithoutCancel(ctx), ref, "", waitTTL(d.ttlOf(&r), info.NextProcessAt)); err != nil {
			d.count(task.Type(), evRedisError)
			d.log.Warn("dedup: could not lengthen a scheduled task's lock", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", err))
		}
	}
	return info, nil
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
		return nil, fmt.Errorf("dedup: enqueue %q: %w", task.Type(), enqErr)
	}
	if _, err := d.unlock(ctx, ref); err != nil {
		d.count(task.Type(), evRedisError)
		d.log.Warn("dedup: could not give back the lock of a refused enqueue; it heals itself", slog.String("type", task.Type()), slog.Any("error", err))
	} else {
		d.count(task.Type(), evRollback)
	}
	return nil, fmt.Errorf("dedup: enqueue %q: %w", task.Type(), enqErr)
}

// relocate moves the lock to the queue the task actually landed in.
func (c *Client) relocate(ctx context.Context, task *asynq.Task, old *lockRef, info *asynq.TaskInfo, ttl time.Duration) (*asynq.TaskInfo, error) {
	d := c.d
	ctx = context.WithoutCancel(ctx)
	fp := *old
	nr := &fp
	nr.queue = info.Queue
	nr.key = lockKeyHex(d.cfg.Prefix, info.Queue, old.fpHex)
	if old.idx != "" {
		nr.idx = indexKey(d.cfg.Prefix, info.Queue, old.id)
	}
	st, holder, err := d.acquire(ctx, nr, ttl)
	if _, uerr := d.unlock(ctx, old); uerr != nil {
		d.count(task.Type(), evRedisError)
	}
	switch {
	case err != nil:
		d.count(task.Type(), evRedisError)
		d.log.Warn("dedup: could not move a lock to the task's queue; the execution-time guard will lock it", slog.String("type", task.Type()), slog.Any("error", err))
		return info, nil
	case st == statusHeld:
		// Our task duplicates one already in that queue: take it back out.
		if derr := d.insp.DeleteTask(info.Queue, info.ID); derr != nil {
			d.log.Warn("dedup: duplicate landed in another queue and could not be removed; the execution-time guard will hold it back", slog.String("type", task.Type()), slog.String("task_id", info.ID), slog.Any("error", derr))
			return info, nil
		}
		d.count(task.Type(), evDuplicate)
		return nil, &DuplicateTaskError{TaskID: holder, Queue: info.Queue, Type: task.Type(), Key: nr.key}
	}
	return info, nil
}
