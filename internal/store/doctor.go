package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Problems of a lock whose owner cannot run, as Diagnose names them.
const (
	ProblemGone     = "gone" // the owner's record is missing, completed or archived (and the lock is not cooling down)
	ProblemNotThere = "lost" // the owner's record names a state whose list or set does not hold it: asynq never runs it
)

// Diagnosis is what Diagnose found about one lock.
type Diagnosis struct {
	Lock    *Lock
	Problem string // ProblemGone, ProblemNotThere
	Detail  string
}

// Diagnose finds, among locks read by ReadLocks, those whose owner cannot
// run: its asynq record is gone (missing, completed, archived; a cooling
// lock is held on purpose), or its state names a list or set (pending,
// scheduled, retry, active) that does not hold it, as after a slot
// migration that dropped a list. A lock younger than grace whose owner is
// gone is left out unless it was written with its task: the task may not
// be stored yet. One pipelined round trip (per node on a cluster).
func Diagnose(ctx context.Context, c redis.Cmdable, ls []*Lock, grace time.Duration, now time.Time) ([]Diagnosis, error) {
	type check struct {
		l   *Lock
		cmd redis.Cmder
	}
	var out []Diagnosis
	var checks []check
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, l := range ls {
			switch {
			case l.State() == LockCooling:
			case l.TaskState == "missing" || Gone(l.TaskState):
				if l.Fields[FieldStored] != "" || now.Sub(time.Unix(l.Created, 0)) >= grace {
					out = append(out, Diagnosis{Lock: l, Problem: ProblemGone, Detail: "owner " + l.TaskState})
				}
			case l.TaskState == StatePending:
				checks = append(checks, check{l, p.LPos(ctx, PendingKey(l.Queue), l.Owner, redis.LPosArgs{})})
			case l.TaskState == StateActive:
				checks = append(checks, check{l, p.LPos(ctx, ActiveKey(l.Queue), l.Owner, redis.LPosArgs{})})
			case l.TaskState == StateScheduled:
				checks = append(checks, check{l, p.ZScore(ctx, ScheduledKey(l.Queue), l.Owner)})
			case l.TaskState == StateRetry:
				checks = append(checks, check{l, p.ZScore(ctx, RetryKey(l.Queue), l.Owner)})
			}
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("check the owners' lists: %w", err)
	}
	for _, ch := range checks {
		switch err := ch.cmd.Err(); {
		case errors.Is(err, redis.Nil):
			out = append(out, Diagnosis{Lock: ch.l, Problem: ProblemNotThere,
				Detail: fmt.Sprintf("owner %s but not in %s", ch.l.TaskState, ch.cmd.Args()[1])})
		case err != nil:
			return nil, fmt.Errorf("check %s: %w", ch.l.Key, err)
		}
	}
	return out, nil
}
