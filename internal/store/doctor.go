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
// migration that dropped a list. Each owner's state and place are read
// together, atomically (lua/diagnose.lua), so a task asynq moves meanwhile
// is never taken for lost. A lock younger than grace whose owner is gone
// is not found but young, unless it was written with its task: the task
// may not be stored yet. One pipelined round trip (per node on a cluster).
func Diagnose(ctx context.Context, c redis.Cmdable, ls []*Lock, grace time.Duration, now time.Time) (found, young []Diagnosis, err error) {
	sc := scripts().diagnose
	cmds := make([]*redis.Cmd, len(ls))
	_, err = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, l := range ls {
			if l.State() == LockCooling {
				continue
			}
			q := l.Queue
			keys := []string{TaskKey(q, l.Owner), PendingKey(q), ActiveKey(q), ScheduledKey(q), RetryKey(q)}
			cmds[i] = sc.Eval(ctx, p, keys, l.Owner)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, nil, fmt.Errorf("check the owners: %w", err)
	}
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		v, err := cmd.Result()
		if err != nil {
			return nil, nil, fmt.Errorf("check %s: %w", ls[i].Key, err)
		}
		rep, err := parseReply(v)
		if err != nil {
			return nil, nil, fmt.Errorf("check %s: %w", ls[i].Key, err)
		}
		switch d, bad := diagnosis(ls[i], rep.str(0), rep.str(1) == "1", grace, now); {
		case bad:
			found = append(found, d)
		case d.Lock != nil:
			young = append(young, d)
		}
	}
	return found, young, nil
}

// diagnosis judges one lock from its owner's state and whether that
// state's list or set holds it: bad, or (not bad, with its Lock set) an
// orphan younger than grace.
func diagnosis(l *Lock, state string, there bool, grace time.Duration, now time.Time) (Diagnosis, bool) {
	switch {
	case state == "" || Gone(state):
		if state == "" {
			state = "missing"
		}
		young := l.Fields[FieldStored] == "" && now.Sub(time.Unix(l.Created, 0)) < grace
		return Diagnosis{Lock: l, Problem: ProblemGone, Detail: "owner " + state}, !young
	case !there:
		return Diagnosis{Lock: l, Problem: ProblemNotThere, Detail: fmt.Sprintf("owner %s but not in asynq's %s list or set", state, state)}, true
	}
	return Diagnosis{}, false
}
