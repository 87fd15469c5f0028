package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Fold is what an enqueue does when the key is held by a task still waiting
// to run.
type Fold byte

// Fold policies, as the acquire script spells them.
const (
	FoldReject  Fold = 'x' // name the holder
	FoldReplace Fold = 'r' // write the new payload into the holder
	FoldMerge   Fold = 'm' // return the holder's payload for the caller to merge (Merge)
)

// Acquire is one enqueue's lock: take the free key for a new task
// (lua/take.lua), or meet the task holding it (lua/acquire.lua): name it,
// fold the new payload into it, make a follow-up of it, or heal the lock
// of a holder that is gone and take the key.
type Acquire struct {
	Ref       Ref           // with Ref.Lock
	OnWaiting Fold          // policy for a waiting holder
	Defers    bool          // the call defers behind a running holder (RunningDefer): FollowID set
	TTL       time.Duration // the lock's lifetime while its task waits
	Now       time.Time     // the producer's clock
	Value     string        // the lock's value for the new task (Value, WrapValue, FiringValue)

	// Direct: store Message, the new task, with a taken lock (the direct
	// path); false: the caller enqueues it. A value rather than a pointer, so
	// that a caller's Acquire holding it stays on the caller's stack.
	Direct  bool
	Message Message
	DueAt   int64 // for Message: unix seconds it is due; 0: pending now
	// Unique: the task's record names the lock as its unique key (Message
	// has UniqueKey), so that asynq's scripts release it.
	Unique     bool
	Caller     bool   // the task ID is the caller's: refused if a task has it
	MaxPending int    // most keys of the type waiting in the queue; 0: no bound
	Payload    []byte // the new payload, for FoldReplace and a follow-up
	FollowID   string // ID of a follow-up made for a running holder (with Defers)
	// DebounceDue: a fold into a scheduled holder moves its due time here
	// (unix seconds) and its lock's lifetime to TTL from now; 0: no move.
	DebounceDue int64
	// Mode is the mode record of a lock the call takes, as field, value
	// pairs (FieldHolder first); nil for a key of no mode.
	Mode []any
}

// AcquireResult is what acquire did.
type AcquireResult struct {
	Status Status
	// Task is the task the status is about: the holder (StatusHeld,
	// StatusReserved, StatusCooling), the task written into or to merge
	// into (StatusReplaced, StatusMerge), the new follow-up
	// (StatusDeferred).
	Task string
	// FollowUp reports that Task is the follow-up of a running holder.
	FollowUp bool
	State    string        // StatusReplaced: Task's asynq state
	Payload  []byte        // StatusMerge: Task's payload
	Version  string        // StatusMerge: the version Merge compares
	Waiting  int64         // StatusOver: keys waiting
	Queued   int64         // StatusOver: tasks in the queue's pending list and scheduled set
	Cooling  time.Duration // StatusCooling: how long the key stays held; negative: until released
	Failed   bool          // StatusCooling: the holder failed for good (a fail hold), rather than succeeded
	Reason   string        // StatusBroken
	Lock     string        // the lock's key
	Stored   bool          // StatusTaken: the task (Message) was stored with the lock
	// Sent: with an error, the failed call carried the task to store with
	// the lock (Direct), so it may be stored (even if the last answer was a
	// refusal: go-redis retries calls that may have run). Not for a call
	// that never reached Redis (Unreached) or that the breaker refused.
	Sent bool
}

// ErrMoving reports a lock whose holder changed every time a script asked
// for its keys (see roles.go).
var ErrMoving = errors.New("dedup: lock kept changing hands while it was read")

// maxNeeds bounds the calls of one operation that are answered statusNeed.
const maxNeeds = 4

// Acquire runs the scripts until one answers for good.
func (s *Store) Acquire(ctx context.Context, a *Acquire) (AcquireResult, error) {
	st := s.newAcquireStep(a)
	for {
		sc, keys, args := st.next(s, a)
		v, err := s.run(ctx, sc, keys, args...)
		res, more, err := st.read(s, a, v, err)
		if !more {
			return res, err
		}
	}
}

// acquireStep is where one Acquire is on its way, call after call:
// Acquire makes them one at a time, AcquireAll many in a pipeline. (The
// Acquire is passed to each method rather than kept, so that a caller's
// stays on its stack.)
type acquireStep struct {
	h       hint // the holder and follow-up the next call passes
	n       int  // calls answered statusNeed so far
	general bool // the next call is acquire.lua (else take.lua)
	fold    bool // the next call is fold.lua (before acquire.lua: a Replace into the hint's holder)
	sends   bool // the next take carries the task (Direct)
	frees   int  // calls answered statusFree so far

	hints  *hintShard // where the lock's hint is kept (hashed once per Acquire)
	missed bool       // the cache held no hint for the lock at the start
}

func (s *Store) newAcquireStep(a *Acquire) acquireStep {
	st := acquireStep{hints: s.hints.shard(a.Ref.Lock)}
	var found bool
	st.h, found = st.hints.get(a.Ref.Lock)
	st.missed = !found
	// A key last seen held: a fold goes straight to acquire, and a take
	// leaves the task out (it answers statusFree if the key turns out free).
	st.general = st.h.holder != "" && (a.OnWaiting != FoldReject || a.Defers)
	st.sends = a.Direct && (st.h.holder == "" || a.Caller)
	// The common Replace, into a waiting holder this process has met: the
	// small fold.lua first, acquire.lua if it finds anything else.
	st.fold = st.general && a.OnWaiting == FoldReplace && !a.Defers && a.DebounceDue == 0 && !a.Caller &&
		KindOf(st.h.holder) != IDOther
	return st
}

// next returns a's next call: the script, its KEYS and ARGV.
func (st *acquireStep) next(s *Store, a *Acquire) (*redis.Script, []string, []any) {
	if st.fold {
		r := &a.Ref
		return s.sc.fold, []string{r.Lock, r.Mode(), TaskKey(r.Queue, st.h.holder)},
			[]any{st.h.holder, payloadField(a.Payload), typeField(r.Type)}
	}
	if st.general {
		keys, args := a.general(s, &st.h, st.n > 0)
		return s.sc.acquire, keys, args
	}
	keys, args := a.take(s, &st.h, st.sends)
	return s.sc.take, keys, args
}

// read reads the reply v (or the failure err) of a's call. more reports
// that a needs another call.
func (st *acquireStep) read(s *Store, a *Acquire, v any, err error) (res AcquireResult, more bool, _ error) {
	if err != nil {
		sent := !st.general && st.sends && !errors.Is(err, s.cfg.ErrCircuitOpen) && !Unreached(err)
		return AcquireResult{Sent: sent}, false, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return AcquireResult{}, false, err
	}
	if st.fold { // fold.lua: written, or acquire.lua next
		st.fold = false
		if rep.status != StatusReplaced {
			return AcquireResult{}, true, nil
		}
	}
	switch rep.status {
	case statusFree: // free (healed, or freed since the hint): take it, with the task
		if st.frees++; st.frees > maxNeeds {
			return AcquireResult{}, false, fmt.Errorf("%w: %s", ErrMoving, a.Ref.Lock)
		}
		st.general, st.sends, st.h = false, a.Direct, hint{}
		return AcquireResult{}, true, nil
	case statusNeed:
		return st.needs(a, rep)
	}
	return a.result(s, st, rep), false, nil
}

// needs moves a to acquire.lua with the keys a reply asked for.
func (st *acquireStep) needs(a *Acquire, rep reply) (AcquireResult, bool, error) {
	if !st.general { // take: held, acquire decides
		st.general, st.h = true, hint{holder: rep.str(0)}
		return AcquireResult{}, true, nil
	}
	if st.n == maxNeeds {
		return AcquireResult{}, false, fmt.Errorf("%w: %s", ErrMoving, a.Ref.Lock)
	}
	st.n++
	st.h = hint{holder: rep.str(1), follow: rep.str(2)}
	return AcquireResult{}, true, nil
}

// take returns take.lua's KEYS and ARGV.
func (a *Acquire) take(s *Store, h *hint, sends bool) ([]string, []any) {
	r := &a.Ref
	kl := newKeyList()
	kl.add(roleLock, r.Lock)
	var msg any = ""
	switch {
	case sends:
		msg = a.Message.Encode() // (as bytes: a string of it would be a copy)
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if a.DueAt != 0 {
			kl.add(roleScheduled, ScheduledKey(r.Queue))
		} else {
			kl.add(rolePending, PendingKey(r.Queue))
		}
	case a.Direct:
		msg = "-" // held, most likely: a free key is answered statusFree, and taken with the task next
	}
	if a.Caller {
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
	}
	if a.MaxPending > 0 {
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
		kl.add(rolePending, PendingKey(r.Queue))
		kl.add(roleScheduled, ScheduledKey(r.Queue))
	}
	if a.Defers || a.Mode != nil {
		kl.add(roleMode, r.Mode())
	}
	trust := a.trusts(s, h)
	if h.holder != "" && !trust {
		kl.add(roleHolder, TaskKey(r.Queue, h.holder))
	}
	args := make([]any, 0, 15+len(a.Mode))
	args = append(args, kl.roleArg(), r.ID, a.Value, msg, a.DueAt, a.Now.UnixMilli(), ms(a.TTL), flag(a.Unique),
		h.holder, flag(trust), flag(a.Caller), a.MaxPending, r.FP, flag(a.Defers))
	return kl.keys, append(args, a.Mode...)
}

// general returns acquire.lua's KEYS and ARGV, with the keys of h's holder
// and follow-up; all declares every key a slow path may need, as after a
// statusNeed reply.
func (a *Acquire) general(s *Store, h *hint, all bool) ([]string, []any) {
	r := &a.Ref
	running := byte(RunReject)
	if a.Defers {
		running = byte(RunDefer)
	}
	kl := newKeyList(byte(a.OnWaiting), running)
	kl.add(roleLock, r.Lock)
	kl.add(roleMode, r.Mode())
	if h.holder != "" {
		kl.add(roleHolder, TaskKey(r.Queue, h.holder))
	}
	if h.follow != "" {
		kl.add(roleFollowTask, TaskKey(r.Queue, h.follow))
	}
	if a.Caller {
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
	}
	if a.Defers || a.DebounceDue != 0 || all {
		kl.add(roleScheduled, ScheduledKey(r.Queue))
		kl.add(rolePending, PendingKey(r.Queue))
		kl.add(roleRetry, RetryKey(r.Queue))
	}
	if a.Defers && h.holder != "" {
		kl.add(roleNewFollow, TaskKey(r.Queue, a.FollowID))
	}
	if a.MaxPending > 0 || all {
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
	}
	var field []byte // the payload, which only a call that may fold uses
	if a.OnWaiting == FoldReplace || a.Defers {
		field = payloadField(a.Payload)
	}
	park := max(int64((a.TTL+time.Second-1)/time.Second), 1)
	return kl.keys, []any{kl.roleArg(), r.ID, a.Now.UnixMilli(), ms(a.TTL), r.Type, field, h.holder, h.follow,
		a.FollowID, a.MaxPending, r.FP, a.DebounceDue, s.graceSeconds(), park, flag(a.Caller), OwedOf(r.Lock)}
}

// trusts reports whether a plain rejection may be answered from the lock
// alone: this process read the holder's record and found it live less than
// Recheck ago.
func (a *Acquire) trusts(s *Store, h *hint) bool {
	return a.OnWaiting == FoldReject && !a.Defers && h.checked != 0 && a.Now.UnixNano()-h.checked < int64(s.cfg.Recheck)
}

// result reads a final reply and remembers the lock's holder for the next
// call.
func (a *Acquire) result(s *Store, st *acquireStep, rep reply) AcquireResult {
	lock := a.Ref.Lock
	res := AcquireResult{Status: rep.status, Lock: lock}
	switch rep.status {
	case StatusTaken:
		res.Stored = st.sends
		// The key's next enqueue, often this process's own (the same work
		// asked for again), then reads its holder's record in the same
		// call. (Not trusted: the task may fail and free the key at once.)
		st.remember(lock, a.Ref.ID, "", 0)
	case StatusHeld:
		res.Task = rep.str(0)
		f := rep.str(1)
		res.FollowUp = f != "" && res.Task == f
		checked := int64(0)
		if !st.general { // take read the holder's record (or trusted a recent read)
			checked = a.Now.UnixNano()
			if a.trusts(s, &st.h) {
				checked = st.h.checked
			}
		}
		st.remember(lock, res.Task, f, checked)
	case StatusReplaced, StatusMerge:
		res.Task, res.State = rep.str(0), rep.str(1)
		f := rep.str(2)
		if rep.status == StatusMerge {
			res.Payload, res.Version, res.State, f = []byte(rep.str(1)), rep.str(2), "", rep.str(3)
		}
		res.FollowUp = f != "" && res.Task == f
		holder := res.Task
		if res.FollowUp {
			holder = st.h.holder
		}
		st.remember(lock, holder, f, 0)
	case StatusDeferred:
		res.Task, res.FollowUp = rep.str(0), true
		st.remember(lock, st.h.holder, res.Task, 0)
	case StatusReserved:
		res.Task = rep.str(0)
		st.remember(lock, res.Task, "", 0)
	case StatusOver:
		res.Waiting, _ = strconv.ParseInt(rep.str(0), 10, 64)
		res.Queued, _ = strconv.ParseInt(rep.str(1), 10, 64)
	case StatusCooling:
		res.Task = rep.str(0)
		res.Cooling, res.Failed = parseMillis(rep.str(1)), rep.str(2) == heldFailed
	case StatusBroken:
		res.Reason = rep.str(0)
	}
	return res
}

// remember keeps the lock's holder and follow-up for the next call
// (checked: when a reply found the holder's record live, unix nanoseconds,
// 0 if none did), unless the hint passed came from the cache and already
// says so.
func (st *acquireStep) remember(lock string, holder, follow string, checked int64) {
	if h := &st.h; h.cached && h.holder == holder && h.follow == follow && (checked == 0 || h.checked == checked) {
		return
	}
	st.hints.put(lock, hint{holder: holder, follow: follow, checked: checked}, st.missed)
}

// payloadField encodes a payload as TaskMessage field 2, as the scripts
// splice it ("" for an empty payload, which proto3 omits).
func payloadField(p []byte) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return appendPayloadField(make([]byte, 0, len(p)+6), p)
}

// graceSeconds is HealGrace in whole seconds, at least 1.
func (s *Store) graceSeconds() int64 { return max(int64(s.cfg.HealGrace/time.Second), 1) }

// ms is d in integer milliseconds, at least 1 (PX 0 is an error in Redis).
func ms(d time.Duration) int64 {
	return max(d.Milliseconds(), 1)
}
