package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Problems of a lock no task and no policy keeps, as Diagnose names them.
const (
	ProblemGone     = "gone" // the holder's record is missing, completed or archived
	ProblemNotThere = "lost" // the holder's record names a state whose list or set does not hold it: asynq never runs it
)

// Diagnosis is what Diagnose found about one lock.
type Diagnosis struct {
	Lock    *Lock
	Problem string // ProblemGone, ProblemNotThere
	Detail  string
}

// Diagnose finds, among locks read by ReadLocks, those that no task and no
// policy keeps: a lock held on purpose (cooling, a fail hold, a
// firing's) never is one; else its holder's asynq record is gone (missing, completed,
// archived), or its state names a list or set (pending, scheduled, retry,
// active) that does not hold it, as after a slot migration that dropped a
// list. Each holder's state and place are read together, in one MULTI, so
// a task asynq moves meanwhile is never taken for lost. A lock taken
// before its task was stored, younger than grace, whose holder has no
// record is not found but young: the task may not be stored yet. One
// round trip per lock checked.
func Diagnose(ctx context.Context, c redis.UniversalClient, ls []*Lock, grace time.Duration, now time.Time) (found, young []Diagnosis, err error) {
	type read struct {
		state        *redis.StringCmd
		pending, act *redis.IntCmd
		sched, retry *redis.FloatCmd
		checked      bool
	}
	reads := make([]read, len(ls))
	for i, l := range ls {
		if l.HeldOnPurpose() || l.outlived() { // (or a handler asynq gave up still runs)
			continue
		}
		q, id, r := l.Queue, l.Owner, &reads[i]
		_, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
			r.state = p.HGet(ctx, TaskKey(q, id), "state")
			r.pending = p.LPos(ctx, PendingKey(q), id, redis.LPosArgs{})
			r.act = p.LPos(ctx, ActiveKey(q), id, redis.LPosArgs{})
			r.sched = p.ZScore(ctx, ScheduledKey(q), id)
			r.retry = p.ZScore(ctx, RetryKey(q), id)
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, nil, fmt.Errorf("check %s: %w", l.Key, err)
		}
		r.checked = true
	}
	for i, r := range reads {
		if !r.checked {
			continue
		}
		state := r.state.Val()
		there := true // (a state that names no list or set: completed, archived, aggregating)
		switch state {
		case StatePending:
			there = r.pending.Err() == nil
		case StateActive:
			there = r.act.Err() == nil
		case StateScheduled:
			there = r.sched.Err() == nil
		case StateRetry:
			there = r.retry.Err() == nil
		}
		switch d, bad := diagnosis(ls[i], state, there, grace, now); {
		case bad:
			found = append(found, d)
		case d.Lock != nil:
			young = append(young, d)
		}
	}
	return found, young, nil
}

// diagnosis judges one lock from its holder's state and whether that
// state's list or set holds it: bad, or (not bad, with its Lock set) a lock
// younger than grace whose task may not be stored yet.
func diagnosis(l *Lock, state string, there bool, grace time.Duration, now time.Time) (Diagnosis, bool) {
	switch {
	case l.Kind == HoldKept && state == StateCompleted && now.Before(l.Until):
		return Diagnosis{}, false // cooling down: asynq's record of its success keeps it
	case state == "" || Gone(state):
		if state == "" {
			state = "missing"
		}
		young := l.Kind == HoldWrap && state == "missing" && now.Sub(time.Unix(l.Taken, 0)) < grace
		return Diagnosis{Lock: l, Problem: ProblemGone, Detail: "holder " + state}, !young
	case !there:
		return Diagnosis{Lock: l, Problem: ProblemNotThere, Detail: fmt.Sprintf("holder %s but not in asynq's %s list or set", state, state)}, true
	}
	return Diagnosis{}, false
}
