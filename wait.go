package dedup

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

var (
	// ErrResultUnavailable reports that a waited-for task is gone from asynq
	// without a result to read: it completed without asynq.Retention (asynq
	// deletes such a task at once), its retention ran out, it was deleted, or
	// its queue was removed. The error also matches the asynq error
	// (asynq.ErrTaskNotFound or asynq.ErrQueueNotFound).
	ErrResultUnavailable = errors.New("dedup: task result unavailable")

	// ErrTaskFailed reports that a waited-for task was archived: its retries
	// ran out, its handler returned asynq.SkipRetry, or someone archived it.
	// The error quotes the task's last error message.
	ErrTaskFailed = errors.New("dedup: task failed")
)

// waitBackoff spaces the polls of WaitResult: 25 ms doubling to 1 s, with
// full jitter so that many waiters of one task spread out.
var waitBackoff = backoff{Min: 25 * time.Millisecond, Max: time.Second}

// WaitResult waits until the task taskID of queue has run to its end, and
// returns its TaskInfo: for a completed task, info.Result holds what its
// handler wrote with the task's ResultWriter. It is meant for the caller of
// a rejected duplicate (see WaitHolder), which may want the winner's result
// instead of doing the work again.
//
// It ends with:
//
//   - the TaskInfo and nil when the task is completed;
//   - the TaskInfo and an error matching ErrTaskFailed, quoting the last
//     error, when the task is archived;
//   - an error matching ErrResultUnavailable (and asynq.ErrTaskNotFound or
//     asynq.ErrQueueNotFound) when the task is not in asynq;
//   - the context's error (ctx.Err(), wrapping the last Redis error if
//     there was one) when ctx is done first.
//
// Limits:
//
//   - Results need retention. A task enqueued without asynq.Retention is
//     deleted as soon as it succeeds, so waiting for it ends in
//     ErrResultUnavailable: the wait tells that it is over, not what it gave.
//     With retention, asynq keeps the completed task (and its result) for
//     that long; a wait that starts later finds nothing either.
//   - A task that is not in asynq is waited for only while this package's
//     lock still names it (the short gap between taking the lock and
//     asynq storing the task, bounded by the heal grace, a minute); otherwise the
//     wait ends at once. A deleted task or a removed queue ends it the same
//     way.
//   - It polls asynq's Inspector (a few Redis commands per poll): first at
//     once, then at growing intervals up to one second, with jitter. asynq's
//     Inspector takes no context, so one poll in flight is bounded by the
//     Redis client's own timeouts, not by ctx. Redis errors are retried
//     until ctx is done (give ctx a deadline), except a refused login or
//     permission (WRONGPASS, NOAUTH, NOPERM), which ends the wait at once
//     with an error matching ErrUnavailable.
//   - The task waited for is the one that held the key when the duplicate
//     was rejected. A retried task is the same task; a task that fails for
//     good gives ErrTaskFailed, and the caller decides whether to enqueue
//     again.
func (d *Dedup) WaitResult(ctx context.Context, queue, taskID string) (*asynq.TaskInfo, error) {
	return d.waitResult(ctx, queue, taskID, "", nil)
}

// WaitHolder is WaitResult for the task named by a duplicate's error:
//
//	var dup *dedup.DuplicateTaskError
//	if errors.As(err, &dup) {
//		info, err = d.WaitHolder(ctx, dup)
//	}
//
// It fails with ErrInvalidOption for a nil dup.
func (d *Dedup) WaitHolder(ctx context.Context, dup *DuplicateTaskError) (*asynq.TaskInfo, error) {
	if dup == nil {
		return nil, errorf("%w: WaitHolder: nil DuplicateTaskError", ErrInvalidOption)
	}
	return d.waitResult(ctx, dup.Queue, dup.Holder, dup.Key, nil)
}

// waitResult is WaitResult for the task holding the lock key ("" when not
// known); onPoll, if not nil, is told each state seen (0 for a task not
// found while it may still be stored), for tests.
func (d *Dedup) waitResult(ctx context.Context, queue, taskID, key string, onPoll func(asynq.TaskState)) (*asynq.TaskInfo, error) {
	if queue == "" || taskID == "" {
		return nil, errorf("%w: WaitResult needs a queue and a task ID", ErrInvalidOption)
	}
	var (
		lastErr  error
		missing  time.Time // since when the task has been missing while locked
		attempts int
	)
	for {
		if err := ctx.Err(); err != nil {
			return nil, waitCtxErr(taskID, err, lastErr)
		}
		info, err := d.pollTask(ctx, queue, taskID)
		switch {
		case err == nil && info != nil:
			lastErr, missing = nil, time.Time{}
			if onPoll != nil {
				onPoll(info.State)
			}
			switch info.State {
			case asynq.TaskStateCompleted:
				return info, nil
			case asynq.TaskStateArchived:
				return info, errorf("%w: task %s in queue %q was archived; last error: %s", ErrTaskFailed, taskID, queue, info.LastErr)
			}
		case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
			locked, lerr := d.lockNames(ctx, key, taskID)
			if lerr != nil {
				if ctx.Err() == nil {
					lastErr = lerr
				}
				break
			}
			if missing.IsZero() {
				missing = time.Now()
			}
			if !locked || time.Since(missing) > d.cfg.healGrace || (key == "" && time.Since(missing) > unknownGrace) {
				return nil, errorf("%w: task %s in queue %q: %w", ErrResultUnavailable, taskID, queue, err)
			}
			if onPoll != nil {
				onPoll(0)
			}
		case refusalOf(err) != nil: // no later poll would be let in either
			return nil, errorf("wait for task %s: %w", taskID, unavailable("wait", err))
		default:
			if ctx.Err() == nil { // not just the wait ending mid-poll
				lastErr = err
			}
			d.log.Debug("dedup: WaitResult poll failed", slog.String("task_id", taskID), slog.Any("error", err))
		}
		if err := sleep(ctx, waitBackoff.delay(attempts)); err != nil {
			return nil, waitCtxErr(taskID, err, lastErr)
		}
		attempts++
	}
}

// pollTask reads asynq's record of a waited-for task through the breaker;
// asynq's answer that it or its queue does not exist comes back as its
// error, but counts as a success for the breaker: Redis answered.
func (d *Dedup) pollTask(ctx context.Context, queue, taskID string) (*asynq.TaskInfo, error) {
	type notFound struct{ err error }
	v, err := d.store.Foreign(ctx, store.TaskKey(queue, taskID), func() (any, error) {
		info, err := d.insp.GetTaskInfo(queue, taskID)
		if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return notFound{err}, nil
		}
		return info, err
	})
	if nf, ok := v.(notFound); ok {
		return nil, nf.err
	}
	info, _ := v.(*asynq.TaskInfo)
	return info, err
}

func waitCtxErr(taskID string, ctxErr, lastErr error) error {
	if lastErr != nil {
		return errorf("dedup: wait for task %s: %w (last error: %w)", taskID, ctxErr, unavailable("wait", lastErr))
	}
	return errorf("dedup: wait for task %s: %w", taskID, ctxErr)
}

// unknownGrace is how long WaitResult waits for a missing task whose lock
// it does not know: long enough for a producer one round trip from storing
// it (asynq's client, after the lock).
const unknownGrace = time.Second

// lockNames reports whether the lock at key ("" unknown: maybe) names
// taskID as a holder whose task its producer has yet to store (a lock
// taken before asynq's client stores the task): then asynq is about to
// store it.
func (d *Dedup) lockNames(ctx context.Context, key, taskID string) (bool, error) {
	if key == "" {
		return true, nil
	}
	v, err := d.store.Do(ctx, key, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.Get(c, key).Result()
	})
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	s, _ := v.(string)
	p := store.ParseValue(s)
	return err == nil && p.Holder == taskID && p.Kind == store.HoldWrap, err
}
