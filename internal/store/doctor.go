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

// ProblemOwed is a key with no lock whose mode record names a follow-up its
// holder owed (RunningDefer), which still waits, while the holder cannot
// run: the owed signal missed it, and it waits until its parking time.
const ProblemOwed = "owed"

// Owing is a key found by DiagnoseOwed: no lock, a holder that cannot run,
// and a follow-up that waits. Its Lock is what ReleaseStuck needs: the key,
// its queue, the holder, its type and mode record (Lock.WaitType).
type Owing struct {
	Lock   *Lock // Owner: the mode record's holder; TaskState: its state
	Follow string
	Detail string
}

// DiagnoseOwed reads the mode records at modes (keys of k's prefix; others
// are left out) and finds the keys whose lock is gone but whose mode record
// names a follow-up (FieldFollow) that still waits (pending, scheduled,
// retry) while its holder (FieldHolder) cannot run: its record is missing
// (or is another key's task now), completed or archived, and neither a
// fail hold's error nor a handler asynq gave up keeps it (as
// lua/release.lua's 'stuck' judges). Two pipelined round trips.
func DiagnoseOwed(ctx context.Context, c redis.Cmdable, k Keys, modes []string) ([]Owing, error) {
	cands, err := readOwing(ctx, c, k, modes)
	if err != nil || len(cands) == 0 {
		return nil, err
	}
	holders := make([]*redis.SliceCmd, len(cands))
	follows := make([]*redis.SliceCmd, len(cands))
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, l := range cands {
			holders[i] = p.HMGet(ctx, TaskKey(l.Queue, l.Owner), "state", "msg", "unique_key")
			follows[i] = p.HMGet(ctx, TaskKey(l.Queue, l.Follow), "state", "msg")
		}
		return nil
	})
	var out []Owing
	for i, l := range cands {
		h, err1 := holders[i].Result()
		g, err2 := follows[i].Result()
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("read asynq tasks of %s: %w", l.Key, err)
		}
		if o, ok := owing(l, h, g); ok {
			out = append(out, o)
		}
	}
	return out, nil
}

// owing judges one candidate from its holder's record (state, msg,
// unique_key) and its follow-up's (state, msg).
func owing(l *Lock, h, g []any) (Owing, bool) {
	state, _ := h[0].(string)
	msg, _ := h[1].(string)
	uk, _ := h[2].(string)
	if state != "" && !l.belongs(uk, msg) {
		state = "" // another key's task under a caller-chosen ID used again
	}
	gone := Gone(state)
	if state == "" {
		state = "missing"
	}
	l.TaskState = state
	fstate, _ := g[0].(string)
	if !gone || !Waiting(fstate) || l.Failed() || l.outlived() {
		return Owing{}, false // the holder can run (and hands the key on at its end), or nothing waits
	}
	if l.Type == "" {
		fmsg, _ := g[1].(string)
		l.Type = MessageType(fmsg)
	}
	if l.Type == "" {
		l.Type = MessageType(msg)
	}
	detail := fmt.Sprintf("holder %s; follow-up %s (%s) is owed, but the key has no lock: it waits until its parking time", state, l.Follow, fstate)
	return Owing{Lock: l, Follow: l.Follow, Detail: detail}, true
}

// readOwing reads, in one round trip, the mode records at modes and whether
// their locks exist, and returns those with no lock that name a holder and
// a follow-up, as Locks (Fields: the mode record).
func readOwing(ctx context.Context, c redis.Cmdable, k Keys, modes []string) ([]*Lock, error) {
	type read struct {
		l    *Lock
		lock *redis.IntCmd
		mode *redis.MapStringStringCmd
	}
	var reads []read
	for _, m := range modes {
		if q, fp, ok := k.ParseLock(LockOfMode(m)); ok {
			reads = append(reads, read{l: &Lock{Key: k.Lock(q, fp), Queue: q, FP: fp}})
		}
	}
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range reads {
			reads[i].lock = p.Exists(ctx, reads[i].l.Key)
			reads[i].mode = p.HGetAll(ctx, ModeOf(reads[i].l.Key))
		}
		return nil
	})
	var out []*Lock
	for _, r := range reads {
		n, err := r.lock.Result()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.l.Key, err)
		}
		mode, err := r.mode.Result()
		switch {
		case err != nil && redis.HasErrorPrefix(err, "WRONGTYPE"):
			continue // not a hash: something else whose name looks like a mode record
		case err != nil:
			return nil, fmt.Errorf("read %s: %w", ModeOf(r.l.Key), err)
		case n > 0 || mode[FieldHolder] == "" || mode[FieldFollow] == "":
			continue // a lock (Diagnose's), or nothing owed
		}
		l := r.l
		l.Owner, l.Fields, l.Type, l.Follow = mode[FieldHolder], mode, mode[FieldType], mode[FieldFollow]
		l.KeyForm, l.TTL = mode[FieldKeyForm], -1
		out = append(out, l)
	}
	return out, nil
}
