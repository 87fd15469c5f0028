package dedup

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Relocation. The lock is taken in the queue the call names, else the one
// given to asynq.NewTask, else the one tasks of the type last landed in
// (call.go); an Enqueuer may still put the task elsewhere (a decorator
// that routes by type, say). Then the call is made again in the queue the
// task landed in, with its own policy, as if it had named that queue: the
// task keeps the key there if it is free; if the key's task there takes
// the payload (Replace, Merge, Defer), or the key is held (a duplicate) or
// the type's MaxPending keys already wait there, the landed task is taken
// back out and the call answers as that fold or refusal. The lock taken in
// the first queue is given back either way.

// relocate makes the call k again in the queue its task landed in.
func (c *Client) relocate(ctx context.Context, k *call, info *asynq.TaskInfo) (Result, error) {
	d := c.d
	m := k.movedTo(d, info)
	res, n, err := c.lock(ctx, m)
	ctx = context.WithoutCancel(ctx) // what follows cleans up after a task that is stored
	if _, uerr := d.store.Unlock(ctx, &k.ref, k.acquire.MaxPending > 0); uerr != nil {
		d.count(k.typ, evRedisError)
	}
	switch {
	case n == enqueue: // the key is the task's there (or fail-open: the guard locks it)
		if m.locked {
			d.count(k.typ, evLocked)
		}
		return created(info, nil)
	case err == nil: // folded into the key's task there
		return c.takeBack(ctx, k, info, res, nil)
	case errors.Is(err, ErrDuplicateTask) || errors.Is(err, ErrTooManyPending):
		return c.takeBack(ctx, k, info, res, err)
	}
	d.count(k.typ, evRedisError)
	d.log.Warn("dedup: could not move a lock to the queue the task landed in; the execution-time guard will lock it", slog.String("type", k.typ), slog.String("task_id", info.ID), slog.Any("error", err))
	return created(info, nil)
}

// movedTo is the call k as made in the queue its task landed in: a lock
// call only (the task is stored already).
func (k *call) movedTo(d *Dedup, info *asynq.TaskInfo) *call {
	m := *k
	m.queue, m.explicitQueue = info.Queue, true
	m.ref.Queue = info.Queue
	m.acquire.Ref = m.ref
	m.acquire.Direct, m.acquire.DueAt = false, 0
	m.acquire.TTL = waitTTL(d.ttlOf(&k.rule), info.NextProcessAt)
	m.acquire.Now = time.Now()
	m.locked, m.self = true, false
	m.rule.waitForRoom = false // (its task waits there already: over the bound it is taken back out)
	return &m
}

// takeBack deletes the task the enqueuer stored where the call is folded or
// refused, and answers the call so (res and err, from its lock in that
// queue). A task a worker took first runs behind the key's holder (the
// execution-time guard retries it), so the call created it after all;
// except at a cooling key, where the guard drops it: a duplicate still.
func (c *Client) takeBack(ctx context.Context, k *call, info *asynq.TaskInfo, res Result, err error) (Result, error) {
	d := c.d
	_, derr := d.store.Foreign(ctx, store.TaskKey(info.Queue, info.ID), func() (any, error) { return nil, d.insp.DeleteTask(info.Queue, info.ID) })
	var dup *DuplicateTaskError
	if derr != nil && !(errors.As(err, &dup) && dup.CoolingDown) {
		d.log.Warn("dedup: a task the enqueuer put in another queue could not be taken back out; it runs when its key is free", slog.String("type", k.typ), slog.String("task_id", info.ID), slog.Any("error", derr))
		return created(info, nil)
	}
	return res, err
}
