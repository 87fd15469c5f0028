package dedup

import (
	"bytes"
	"context"
	"errors"
	"log/slog"

	"github.com/asynq-dedup/dedup/internal/asynqconn"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
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

	direct bool // next is an asynq client on the Dedup's Redis: accepted enqueues can take one round trip
	place  placement

	ownNext bool // next was made by NewClient, over the Dedup's Redis client
}

// WrapClient returns a Client that deduplicates before enqueueing through
// next (usually an *asynq.Client on the same Redis).
//
// Every accepted enqueue then costs two round trips: the lock script, and
// next's enqueue. NewClient saves one.
//
// next must store its tasks in the Dedup's Redis (or Cluster): locks are
// checked against asynq's record of their holder there. The first accepted
// enqueues check that their task is there (see placement.go); once one is
// found in another Redis, its task stays enqueued and locked, and every
// later deduplicated call fails with ErrTasksElsewhere.
func (d *Dedup) WrapClient(next Enqueuer) *Client {
	return &Client{d: d, next: next}
}

// NewClient returns a Client over an asynq client on the Dedup's own Redis
// client (as asynq.NewClientFromRedisClient makes one). Because the lock and the task
// live in the same Redis, an accepted enqueue of a task without asynq's
// own options in asynq.NewTask (this package's may be there) is stored by
// the lock script itself, in asynq
// v0.26.0's layout: one round trip instead of two, and no moment when the
// lock exists without its task. Other tasks go through the asynq client,
// as every task does when the linked asynq is not v0.26.0.
func (d *Dedup) NewClient() *Client {
	c := &Client{d: d, next: asynqconn.Client(d.rdb), direct: !d.cfg.noDirectEnqueue, ownNext: true}
	c.place.state.Store(placeHere)
	return c
}

// Close releases what the Client holds, as asynq.Client's Close does, so
// code written for *asynq.Client keeps compiling: it closes the Enqueuer
// given to WrapClient if that has a Close() error method (an
// *asynq.Client, say); a Client from NewClient holds nothing of its own
// (its asynq client shares the Dedup's Redis client, which stays open). It
// does not close the Dedup.
func (c *Client) Close() error {
	if c.ownNext {
		return nil
	}
	if cl, ok := c.next.(interface{ Close() error }); ok {
		return cl.Close()
	}
	return nil
}

// Ping checks that the Dedup's Redis answers and, if the wrapped Enqueuer
// has a Ping() error method (an *asynq.Client, say), that it does too; in
// all at most Config.LockTimeout. (A wrapped Ping still under way then goes
// on by itself; NewClient's asynq client uses the Redis pinged first.)
func (c *Client) Ping() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.d.cfg.LockTimeout)
	defer cancel()
	if _, err := c.d.store.Do(ctx, "", func(cc context.Context, rdb redis.Cmdable) (any, error) { return nil, rdb.Ping(cc).Err() }); err != nil {
		return unavailable("ping", err)
	}
	p, ok := c.next.(interface{ Ping() error })
	if !ok || c.ownNext {
		return nil
	}
	done := make(chan error, 1)
	go func() { done <- p.Ping() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return unavailable("ping", ctx.Err())
	}
}

// Enqueue is EnqueueContext with context.Background().
func (c *Client) Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return c.EnqueueContext(context.Background(), task, opts...)
}

// EnqueueContext fingerprints the task, takes its lock in one atomic script
// and enqueues it. opts may mix asynq's options with this package's; only
// asynq's reach asynq. This package's options given to asynq.NewTask apply
// to that task, under the call's (which override them, as asynq's own
// call options override NewTask's).
//
// On a duplicate it returns a *DuplicateTaskError naming the task that holds
// the key (matching ErrDuplicateTask and asynq.ErrDuplicateTask), and
// enqueues nothing — unless the type's or call's policy folds the payload
// into the holder (Replace, Merge) or into a follow-up of a running holder
// (RunningDefer): then it returns that task's TaskInfo (see Result.Info);
// use Submit to tell the cases apart. A payload the rule cannot fingerprint gives a
// *PayloadError; a bad option ErrInvalidOption; in both cases nothing is
// locked or enqueued. If asynq refuses the task, the lock is given back
// (holder-checked) — unless the task turns out to be stored after all, as when
// go-redis retried an enqueue that had landed: then its TaskInfo is returned.
//
// The lock lives in the queue the call names (asynq.Queue), else in the one
// given to asynq.NewTask, else in the queue tasks of this type last landed
// in, else "default". A task that lands elsewhere (an enqueuer that changes
// the queue) has its lock moved there.
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
	var k call // kept on the stack: a call is composed for every enqueue
	locks, err := c.begin(ctx, &k, task, opts)
	switch {
	case err != nil:
		return Result{}, err
	case !locks:
		return c.enqueueUnlocked(ctx, &k)
	}
	res, n, err := c.lock(ctx, &k)
	return c.complete(ctx, &k, res, n, err)
}

// begin composes the call and, if it is deduplicated (locks), prepares its
// lock: every step of an enqueue before its first acquire. It touches
// Redis only to register a queue new to this process, on the direct path.
func (c *Client) begin(ctx context.Context, k *call, task *asynq.Task, opts []asynq.Option) (locks bool, err error) {
	if err := c.compose(k, task, opts); err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil { // the caller gave up before the call began: not an outage
		return false, errorf("dedup: enqueue %q: %w", k.typ, err)
	}
	if !c.d.active(&k.rule) {
		return false, nil
	}
	if err := c.place.refused(); err != nil {
		return false, err
	}
	return true, c.prepare(ctx, k)
}

// complete ends a deduplicated call once its lock is settled (n, res and
// err from lock): it enqueues the task through asynq when the lock was
// taken without it (or fail-open), and fills in the result.
func (c *Client) complete(ctx context.Context, k *call, res Result, n next, err error) (Result, error) {
	if n == enqueue {
		res, err = c.enqueueLocked(ctx, k)
	}
	if err == nil {
		res.Fingerprint, res.Conflict, res.Running, res.FailOpen = k.ref.FP, k.rule.conflict, k.rule.running, !k.locked
		if (k.userHeaders && res.Outcome != Created) || k.headersDropped() {
			res.NotApplied = append(res.NotApplied, headersDesc) // the task it went into keeps its headers
		}
	}
	return res, err
}

// enqueueUnlocked enqueues a call without deduplication, marked so that the
// execution-time guard leaves it alone: in its ID, or for a caller-chosen
// ID in its header.
func (c *Client) enqueueUnlocked(ctx context.Context, k *call) (Result, error) {
	switch {
	case store.Reserved(k.callerID):
		return Result{}, reservedID(k.callerID)
	case !k.rule.skip:
		// OptIn and no rule: nothing here is deduplicated, so the task stays
		// as asynq makes it. (A server whose rules cover the type guards it
		// as any task that arrives without a lock.)
	case k.callerID == "":
		k.pass = append(k.pass, asynq.TaskID(store.NewOptOutID()))
	default:
		k.addHeaders(map[string]string{store.HeaderLock: store.OptedOut})
	}
	if err := k.applyHeaders(); err != nil {
		return Result{}, err
	}
	info, err := c.next.EnqueueContext(ctx, k.task, k.pass...)
	if err != nil {
		return Result{}, enqueueError(k.typ, err) // (the error contract holds for a call not deduplicated too)
	}
	res, _ := created(info, nil)
	if k.headersDropped() {
		res.NotApplied = append(res.NotApplied, headersDesc)
	}
	return res, nil
}

// enqueueLocked enqueues through asynq a task whose lock is taken (or
// fail-open), and settles the lock by what asynq did with the task.
func (c *Client) enqueueLocked(ctx context.Context, k *call) (Result, error) {
	d := c.d
	var probe placeProbe
	if k.locked {
		probe = c.place.before(ctx, d, k.queue)
	}
	info, err := c.next.EnqueueContext(ctx, k.task, k.pass...)
	if err != nil {
		err = enqueueError(k.typ, err)
		if !k.locked || k.self {
			return Result{}, err
		}
		return created(c.rollback(ctx, k, err))
	}
	if !k.explicitQueue && k.taskQueue == "" {
		d.queues.Store(k.typ, info.Queue) // the enqueuer's choice, as no queue was named
	}
	if !k.locked {
		return created(info, nil)
	}
	if info.Queue != k.queue {
		return c.relocate(ctx, k, info)
	}
	d.count(k.typ, evLocked)
	if k.processAt.IsZero() && info.State == asynq.TaskStateScheduled {
		c.coverDelay(ctx, k, info)
	}
	c.place.after(context.WithoutCancel(ctx), d, probe, info.Queue, info.ID)
	return created(info, nil)
}

// coverDelay lengthens the lock of a task scheduled through asynq.NewTask
// options (invisible before the enqueue) to cover the delay too.
func (c *Client) coverDelay(ctx context.Context, k *call, info *asynq.TaskInfo) {
	d := c.d
	ext := &store.Extend{Ref: k.ref, TTL: waitTTL(d.ttlOf(&k.rule), info.NextProcessAt)}
	if err := d.store.ExtendAll(context.WithoutCancel(ctx), []*store.Extend{ext})[0].Err; err != nil {
		d.count(k.typ, evRedisError)
		d.log.Warn("dedup: could not lengthen a scheduled task's lock", slog.String("type", k.typ), slog.String("task_id", k.ref.ID), slog.Any("error", err))
	}
}

func created(info *asynq.TaskInfo, err error) (Result, error) {
	if err != nil {
		return Result{}, err
	}
	return Result{Outcome: Created, TaskID: info.ID, Info: info}, nil
}

// rollback handles a refused enqueue after the lock was taken. If the task
// is stored (an enqueue that landed but reported an error, such as
// ErrTaskIDConflict for our own ID after a go-redis retry) the lock stays and
// the task is returned; if it is not, the lock is given back; if that cannot
// be told, the lock stays (it heals itself once its task is found missing)
// and the error matches ErrUnavailable.
func (c *Client) rollback(ctx context.Context, k *call, enqErr error) (*asynq.TaskInfo, error) {
	d := c.d
	ctx = context.WithoutCancel(ctx)
	ti, err := c.landed(ctx, k, enqErr)
	if ti != nil || err != nil {
		return ti, err
	}
	if _, err := d.store.Unlock(ctx, &k.ref, k.acquire.Value, k.acquire.MaxPending > 0); err != nil {
		d.count(k.typ, evRedisError)
		d.log.Warn("dedup: could not give back the lock of a refused enqueue; it heals itself", slog.String("type", k.typ), slog.Any("error", err))
	} else {
		d.count(k.typ, evRollback)
	}
	return nil, enqErr
}

// landed tells whether the call's task is stored after a call that failed
// with callErr may or may not have stored it: the task (nil if it is not
// stored), or an error matching ErrUnavailable if that cannot be told. It
// reads asynq's record with one single-key command, which Redis answers
// during a slot migration too; a refusal of the call itself (TRYAGAIN, ...)
// proves nothing, as go-redis may have retried a call that had run.
func (c *Client) landed(ctx context.Context, k *call, callErr error) (*asynq.TaskInfo, error) {
	d := c.d
	queue, id := k.queue, k.ref.ID
	typ, payload, state, found, err := d.store.StoredTask(context.WithoutCancel(ctx), queue, id)
	switch {
	case err != nil:
		d.count(k.typ, evRedisError)
		return nil, outcomeUnknown(id, callErr, err)
	case !found || typ != k.typ || !bytes.Equal(payload, k.task.Payload()):
		return nil, nil // not stored, or a different task has this (caller-chosen) ID: ours never landed
	}
	d.count(k.typ, evLocked)
	if ti, err := d.insp.GetTaskInfo(queue, id); err == nil {
		return ti, nil
	}
	return &asynq.TaskInfo{ID: id, Queue: queue, Type: typ, Payload: payload, State: parseState(state)}, nil
}

// enqueueError wraps an error from asynq's enqueue. asynq flattens Redis
// failures into text, so anything but its own refusals (a taken task ID, a
// Unique duplicate) is a failure to reach Redis: it matches ErrUnavailable.
func enqueueError(typ string, err error) error {
	if errors.Is(err, asynq.ErrTaskIDConflict) || errors.Is(err, asynq.ErrDuplicateTask) {
		return errorf("dedup: enqueue %q: %w", typ, err)
	}
	return errorf("%w: enqueue %q: %w", ErrUnavailable, typ, err)
}
