package dedup

import (
	"context"
	"log/slog"
	"maps"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Relocation. The lock is taken in the queue the call names, else the one
// given to asynq.NewTask, else the one tasks of the type last landed in
// (call.go); an Enqueuer may still put the task elsewhere (a decorator
// that routes by type, say). Then the task is taken back out, before any
// worker can take it, and the call is made again in the queue the task
// landed in, with its own policy, as if it had named that queue: it takes
// the key there and is enqueued again, or is folded into the key's task
// there (Replace, Merge, Defer), or refused (a duplicate, MaxPending). A
// task a worker took first is left to meet its key when it starts (the
// execution-time guard). The lock taken in the first queue is given back
// either way.

// relocate makes the call k again in the queue its task landed in.
func (c *Client) relocate(ctx context.Context, k *call, info *asynq.TaskInfo) (Result, error) {
	d := c.d
	defer c.unlockMoved(context.WithoutCancel(ctx), k)
	if k.relocated { // the enqueuer moved it again: it meets its key when it starts
		d.log.Warn("dedup: the enqueuer puts a task in another queue than the one it was asked for, twice; the execution-time guard locks it", slog.String("type", k.typ), slog.String("task_id", info.ID), slog.String("queue", info.Queue))
		return created(info, nil)
	}
	gone, err := d.store.Withdraw(context.WithoutCancel(ctx), info.Queue, info.ID)
	if err != nil || !gone {
		if err != nil {
			d.count(k.typ, evRedisError)
		}
		d.log.Warn("dedup: a task the enqueuer put in another queue could not be taken back out; it meets its key when it starts", slog.String("type", k.typ), slog.String("task_id", info.ID), slog.Any("error", err))
		return created(info, nil)
	}
	m := k.movedTo(d, info)
	if err := m.markTask(); err != nil {
		return Result{}, err
	}
	res, n, err := c.lock(ctx, m)
	if n != enqueue {
		return res, err
	}
	return c.enqueueLocked(ctx, m)
}

// movedTo is the call k made again in the queue its task landed in.
func (k *call) movedTo(d *Dedup, info *asynq.TaskInfo) *call {
	m := *k
	m.queue, m.explicitQueue, m.relocated = info.Queue, true, true
	m.pass = append(k.pass[:len(k.pass):len(k.pass)], asynq.Queue(info.Queue))
	m.ref.Queue = info.Queue
	m.ref.Lock = d.store.Keys().Lock(info.Queue, k.ref.FP)
	m.acquire.Ref = m.ref
	m.acquire.Direct, m.acquire.DueAt, m.acquire.Unique = false, 0, false
	m.acquire.Value = store.WrapValue(m.ref.ID, time.Now())
	m.acquire.TTL = waitTTL(d.ttlOf(&k.rule), info.NextProcessAt)
	m.acquire.Now = time.Now()
	m.locked, m.self = true, false
	// asynq's client stores it again: its record will not name the lock.
	m.terms = termsOf(&m.rule, m.typ, m.ref.ID, m.acquire.Now, true, false)
	m.acquire.Mode = m.terms.mode
	m.headers = maps.Clone(k.headers)
	return &m
}

// unlockMoved gives back the lock the call took in the queue it asked for.
func (c *Client) unlockMoved(ctx context.Context, k *call) {
	if _, err := c.d.store.Unlock(ctx, &k.ref, k.acquire.Value, k.acquire.MaxPending > 0); err != nil {
		c.d.count(k.typ, evRedisError)
	}
}
