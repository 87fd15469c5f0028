package dedup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// errPanicked stands for a handler that panicked while its lock's fate is
// decided; the panic itself goes on to asynq unchanged.
var errPanicked = errors.New("dedup: handler panicked")

// Middleware returns the server middleware: mux.Use(d.Middleware()).
//
// For every attempt it finds the task's lock from the task ID (or, for a
// caller-chosen ID, from the index the wrapper wrote), makes the attempt its
// running owner under a fresh token, renews it every Lease/3 while the
// handler runs, and then:
//
//	success, asynq.RevokeTask          release
//	asynq.SkipRetry, retries exhausted release (the task is archived)
//	any other error, a panic           hold for RetryDelayFunc(n) + TTL
//
// A task that arrives without a lock (asynq.Scheduler, another service, the
// CLI) takes one when it starts, keyed by its type's rule; if another live
// task holds that key it does not run now: it returns a *BusyError (retried
// later; see IsFailure) or, with Config.SkipBusy, nil.
//
// Release happens just before asynq marks the task done: if that last step
// fails, asynq runs the task again while a duplicate may have been accepted.
func (d *Dedup) Middleware() asynq.MiddlewareFunc {
	d.hb.run()
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return d.process(ctx, t, next)
		})
	}
}

func (d *Dedup) process(ctx context.Context, t *asynq.Task, next asynq.Handler) (err error) {
	id, ok1 := asynq.GetTaskID(ctx)
	queue, ok2 := asynq.GetQueueName(ctx)
	if !ok1 || !ok2 {
		return next.ProcessTask(ctx, t) // not run by an asynq server
	}
	ref, err := d.resolve(ctx, queue, id, t)
	if err != nil {
		if d.onRedisError(ctx, "resolve", t.Type(), err) {
			return next.ProcessTask(ctx, t)
		}
		return unavailable("resolve", err)
	}
	if ref == nil {
		return next.ProcessTask(ctx, t)
	}
	token := newToken()
	rule := d.ruleFor(t.Type())
	st, holder, err := d.start(ctx, ref, token, rule.running)
	if err != nil {
		if d.onRedisError(ctx, "start", t.Type(), err) {
			return next.ProcessTask(ctx, t)
		}
		return unavailable("start", err)
	}
	if st == statusAllowed {
		return next.ProcessTask(ctx, t) // RunningAllow: the key was freed as the task started
	}
	if st != statusTaken {
		d.count(t.Type(), evBusy)
		if d.cfg.SkipBusy {
			d.log.Info("dedup: skipped task, key held by another task", slog.String("type", t.Type()), slog.String("task_id", id), slog.String("holder", holder))
			return nil
		}
		return &BusyError{TaskID: id, Holder: holder, Key: ref.key}
	}
	d.count(t.Type(), evStarted)

	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	l := &lease{ref: ref, token: token, cancel: cancel}
	d.hb.add(l)
	panicked := true
	defer func() {
		live := d.hb.remove(l)
		herr := err
		if panicked {
			herr = errPanicked // the panic propagates after this returns
		}
		d.settle(ctx, t, &rule, ref, token, herr, live)
	}()
	err = next.ProcessTask(hctx, t)
	panicked = false
	return err
}

// settle releases the lock or holds it for the retry, by asynq's rules for
// what follows the attempt. Its errors never fail the task.
func (d *Dedup) settle(ctx context.Context, t *asynq.Task, r *resolved, ref *lockRef, token string, err error, live bool) {
	release := true
	var hold time.Duration
	if err != nil && !errors.Is(err, asynq.RevokeTask) && !errors.Is(err, asynq.SkipRetry) {
		n, _ := asynq.GetRetryCount(ctx)
		max, _ := asynq.GetMaxRetry(ctx)
		// A context cancelled before its deadline means asynq gave the task up
		// (shutdown puts it back in the queue, retries unchanged) or expired its
		// lease: it may run again even if this was the last retry, so hold.
		if n < max || errors.Is(ctx.Err(), context.Canceled) {
			release = false
			hold = d.cfg.RetryDelayFunc(n, err, t) + d.ttlOf(r)
		}
	}
	d.count(t.Type(), evProcessed)
	ok, follow, ferr := d.finish(context.WithoutCancel(ctx), ref, token, release, hold, d.ttlOf(r))
	switch {
	case ferr != nil:
		d.count(t.Type(), evRedisError)
		d.log.Warn("dedup: could not settle lock; it expires within one lease", slog.String("type", t.Type()), slog.String("task_id", ref.id), slog.Any("error", ferr))
	case !ok:
		if live { // else the heartbeat already reported it
			d.count(t.Type(), evLockLost)
		}
		d.log.Warn("dedup: lock was no longer this attempt's at the end", slog.String("type", t.Type()), slog.String("task_id", ref.id))
	case release:
		d.count(t.Type(), evReleased)
		if follow != "" {
			d.log.Debug("dedup: follow-up released", slog.String("type", t.Type()), slog.String("task_id", follow))
		}
	default:
		d.count(t.Type(), evHeld)
	}
}

// resolve finds the lock of the task being run, or nil for none.
func (d *Dedup) resolve(ctx context.Context, queue, id string, t *asynq.Task) (*lockRef, error) {
	typ := t.Type()
	if fpHex, ok := parseLockedID(id); ok {
		return &lockRef{queue: queue, key: lockKeyHex(d.cfg.Prefix, queue, fpHex), fpHex: fpHex, id: id, typ: typ}, nil
	}
	if strings.HasPrefix(id, optOutIDPrefix) {
		return nil, nil
	}
	// A caller-chosen ID: the wrapper left an index to its lock.
	fpHex, err := d.get(ctx, indexKey(d.cfg.Prefix, queue, id))
	switch {
	case err == nil && fpHex == optOutMark:
		return nil, nil // enqueued with Skip under a caller-chosen ID
	case err == nil:
		return &lockRef{queue: queue, key: lockKeyHex(d.cfg.Prefix, queue, fpHex), idx: indexKey(d.cfg.Prefix, queue, id), fpHex: fpHex, id: id, typ: typ}, nil
	case !errors.Is(err, redis.Nil):
		return nil, err
	}
	// No lock was taken at enqueue: the execution-time guard takes one now.
	r := d.ruleFor(typ)
	if d.cfg.NoExecutionGuard || !d.active(&r) {
		return nil, nil
	}
	fp, ferr := d.fingerprintHex(typ, t.Payload(), &r)
	if ferr != nil {
		d.log.Warn("dedup: cannot key task at execution; running it unguarded", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", ferr))
		d.count(t.Type(), evUnguarded)
		return nil, nil
	}
	return d.newRef(queue, fp, id, typ, false), nil
}

func newToken() string {
	var b [16]byte
	randomHex(b[:])
	return string(b[:])
}

// lease is one running attempt registered with the heartbeat.
type lease struct {
	ref    *lockRef
	token  string
	cancel context.CancelCauseFunc
}

func (l *lease) String() string { return fmt.Sprintf("%s@%s", l.ref.id, l.ref.key) }
