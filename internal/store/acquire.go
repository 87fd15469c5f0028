package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Fold is what acquire does when the key is held by a task still waiting to
// run.
type Fold byte

// Fold policies, as the acquire script spells them.
const (
	FoldReject  Fold = 'x' // name the holder
	FoldReplace Fold = 'r' // write the new payload into the holder
	FoldMerge   Fold = 'm' // return the holder's payload for the caller to merge (Coalesce)
)

// Acquire is one call of the acquire script (lua/acquire.lua): at enqueue,
// take a key's lock for a new task, fold the new payload into the task
// that holds the key, or name the holder.
type Acquire struct {
	Ref       Ref
	OnWaiting Fold          // policy for a waiting holder
	OnRunning Running       // policy for a running holder, recorded in a taken lock
	TTL       time.Duration // the lock's lifetime while its task waits
	Now       time.Time     // the producer's clock

	Message    []byte // asynq's record of the new task, stored with a taken lock (the direct path); nil: the caller enqueues
	DueAt      int64  // for Message: unix seconds it is due; 0: pending now
	MaxPending int    // most keys of the type waiting in the queue; 0: no bound
	Payload    []byte // the new payload, for FoldReplace and a follow-up
	FollowID   string // ID of a follow-up created for a running holder (RunDefer)
}

// AcquireResult is what acquire did.
type AcquireResult struct {
	Status Status
	// Task is the task the status is about: the holder (StatusHeld,
	// StatusReserved), the task written into or to merge into
	// (StatusReplaced, StatusMerge), the new follow-up (StatusDeferred).
	Task string
	// FollowUp reports that Task is the follow-up of a running holder.
	FollowUp bool
	State    string // StatusReplaced, StatusMerge: Task's asynq state
	Payload  []byte // StatusMerge: Task's payload
	Version  string // StatusMerge: the version Coalesce compares
	Waiting  int64  // StatusOver: keys waiting
	Reason   string // StatusBroken
}

// ErrMoving reports a lock whose holder changed every time a script asked
// for its keys (see roles.go).
var ErrMoving = errors.New("dedup: lock kept changing hands while it was read")

// maxNeeds bounds the calls of one operation that are answered statusNeed.
const maxNeeds = 4

// Acquire runs the acquire script, calling it again with the keys it asks
// for.
func (s *Store) Acquire(ctx context.Context, a *Acquire) (AcquireResult, error) {
	lock := s.keys.LockOf(&a.Ref)
	h, _ := s.hints.get(lock)
	for n := 0; ; n++ {
		keys, args := a.build(s, lock, h, n > 0)
		v, err := s.run(ctx, s.sc.acquire, keys, args...)
		if err != nil {
			return AcquireResult{}, err
		}
		rep, err := parseReply(v)
		if err != nil {
			return AcquireResult{}, err
		}
		if rep.status != statusNeed {
			return a.result(s, lock, rep), nil
		}
		if n == maxNeeds {
			return AcquireResult{}, fmt.Errorf("%w: %s", ErrMoving, lock)
		}
		h = hint{holder: rep.str(1), follow: rep.str(2)}
	}
}

// build returns the script's KEYS and ARGV; all declares every key a slow
// path may need, as after a statusNeed reply.
func (a *Acquire) build(s *Store, lock string, h hint, all bool) ([]string, []any) {
	r := &a.Ref
	kl := newKeyList(string([]byte{byte(a.OnWaiting), byte(a.OnRunning)}), 8)
	kl.add(roleLock, lock)
	if r.Indexed {
		kl.add(roleIndex, s.keys.Index(r.Queue, r.ID))
	}
	if a.Message != nil {
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if a.DueAt != 0 {
			kl.add(roleScheduled, ScheduledKey(r.Queue))
		} else {
			kl.add(rolePending, PendingKey(r.Queue))
		}
	}
	if a.MaxPending > 0 || all {
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
	}
	if a.FollowID != "" || all {
		kl.add(roleFollow, s.keys.Follow(r.Queue, r.FP))
		kl.add(roleScheduled, ScheduledKey(r.Queue))
		kl.add(rolePending, PendingKey(r.Queue))
	}
	if a.FollowID != "" {
		kl.add(roleNewFollow, TaskKey(r.Queue, a.FollowID))
	}
	var passed hint // the holder and follow-up whose keys are passed
	if h.holder != "" && (all || a.mayReadHolder(s, h)) {
		passed.holder = h.holder
		holder := UnpackOwner(h.holder, r.FP)
		kl.add(roleHolder, TaskKey(r.Queue, holder))
		if all {
			kl.add(roleHolderIndex, s.keys.Index(r.Queue, holder))
		}
	}
	if h.follow != "" {
		passed.follow = h.follow
		kl.add(roleFollowTask, TaskKey(r.Queue, h.follow))
	}
	return kl.keys, a.args(s, kl, passed)
}

// mayReadHolder reports whether the script may need the holder's record:
// when it may fold into it, or the lock may be older than the heal grace.
// Without it a plain rejection of a young lock sends one key and no hint.
func (a *Acquire) mayReadHolder(s *Store, h hint) bool {
	if a.OnWaiting != FoldReject || a.FollowID != "" || h.follow != "" || h.since == 0 {
		return true
	}
	return a.Now.Unix()-h.since >= s.graceSeconds()/2 // a margin for producers' clocks
}

// args lays out ARGV; the optional arguments go only as far as the last
// one that differs from its default (a plain call sends 8).
func (a *Acquire) args(s *Store, kl *keyList, h hint) []any {
	r := &a.Ref
	follow := h.follow
	args := make([]any, 8, 16)
	args[0], args[1], args[2], args[3] = string(kl.roles), r.ID, r.stored(), r.FP
	args[4], args[5], args[6], args[7] = a.Now.UnixMilli(), s.graceSeconds(), ms(a.TTL), a.Message
	followStored := ""
	if follow != "" {
		followStored = PackOwner(follow, r.FP)
	}
	opt := [...]any{payloadField(a.Payload), h.holder, follow, followStored, a.DueAt, a.MaxPending, a.FollowID, s.parkSeconds()}
	n := 0
	switch {
	case a.FollowID != "":
		n = 8
	case a.MaxPending > 0:
		n = 6
	case a.DueAt != 0:
		n = 5
	case follow != "":
		n = 4
	case h.holder != "":
		n = 2
	case len(a.Payload) > 0 && a.OnWaiting == FoldReplace:
		n = 1
	}
	return append(args, opt[:n]...)
}

// result reads the reply and remembers the lock's holder for the next call.
func (a *Acquire) result(s *Store, lock string, rep reply) AcquireResult {
	fp := a.Ref.FP
	res := AcquireResult{Status: rep.status}
	switch rep.status {
	case StatusTaken:
		s.hints.put(lock, hint{holder: a.Ref.stored(), since: a.Now.Unix()})
	case statusHeldYoung:
		res.Status, res.Task = StatusHeld, UnpackOwner(rep.str(0), fp)
		since, _ := strconv.ParseInt(rep.str(1), 10, 64)
		s.hints.put(lock, hint{holder: rep.str(0), since: since})
	case StatusHeld:
		s.hints.put(lock, hint{holder: rep.str(1), follow: rep.str(2)})
		res.Task = UnpackOwner(rep.str(0), fp)
	case StatusReplaced, StatusMerge:
		res.Task, res.State = UnpackOwner(rep.str(0), fp), rep.str(1)
		last := len(rep.strs) - 2
		if rep.status == StatusMerge {
			res.Payload, res.Version, res.State = []byte(rep.str(1)), rep.str(2), ""
		}
		s.hints.put(lock, hint{holder: rep.str(last), follow: rep.str(last + 1)})
		res.FollowUp = rep.str(last+1) != "" && rep.str(0) == rep.str(last+1)
	case StatusDeferred:
		res.Task, res.FollowUp = rep.str(0), true
		s.hints.put(lock, hint{holder: rep.str(1), follow: rep.str(2)})
	case StatusReserved:
		res.Task = UnpackOwner(rep.str(0), fp)
		s.hints.put(lock, hint{holder: rep.str(0)})
	case StatusOver:
		res.Waiting, _ = strconv.ParseInt(rep.str(0), 10, 64)
	case StatusBroken:
		res.Reason = rep.str(0)
	}
	return res
}

// payloadField encodes a payload as TaskMessage field 2, as the scripts
// splice it ("" for an empty payload, which proto3 omits).
func payloadField(p []byte) string {
	if len(p) == 0 {
		return ""
	}
	return string(appendPayloadField(make([]byte, 0, len(p)+6), p))
}

// Coalesce is one call of the coalesce script (lua/coalesce.lua): write a
// merged payload into the task acquire returned with StatusMerge, if the
// lock has not changed since.
type Coalesce struct {
	Ref     Ref
	Target  string // AcquireResult.Task
	Follow  bool   // AcquireResult.FollowUp
	Version string // AcquireResult.Version
	Payload []byte // the merged payload
}

// CoalesceResult is what coalesce did.
type CoalesceResult struct {
	Written bool   // the merged payload was written
	State   string // Written: the target's asynq state
	Broken  string // asynq's record is not what the script expects: why
}

// Coalesce runs the coalesce script.
func (s *Store) Coalesce(ctx context.Context, c *Coalesce) (CoalesceResult, error) {
	follow := ""
	if c.Follow {
		follow = "1"
	}
	keys := []string{s.keys.LockOf(&c.Ref), TaskKey(c.Ref.Queue, c.Target)}
	v, err := s.run(ctx, s.sc.coalesce, keys, c.Target, PackOwner(c.Target, c.Ref.FP), follow, c.Version, payloadField(c.Payload))
	if err != nil {
		return CoalesceResult{}, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return CoalesceResult{}, err
	}
	if rep.status == StatusBroken {
		return CoalesceResult{Broken: rep.str(0)}, nil
	}
	return CoalesceResult{Written: rep.status == 1, State: rep.str(0)}, nil
}

// Unlock runs the unlock script (lua/unlock.lua): give back the lock r's
// task took if asynq refused to enqueue it. It reports whether it did.
func (s *Store) Unlock(ctx context.Context, r *Ref) (bool, error) {
	lock := s.keys.LockOf(r)
	keys := []string{lock, s.keys.Wait(r.Queue, r.Type)}
	if r.Indexed {
		keys = append(keys, s.keys.Index(r.Queue, r.ID))
	}
	v, err := s.run(ctx, s.sc.unlock, keys, r.stored(), r.FP, r.ID)
	if err != nil {
		return false, err
	}
	s.hints.forget(lock)
	return parseFlag(v)
}
