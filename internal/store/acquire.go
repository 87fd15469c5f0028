package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
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

	// Direct: store Message, the new task, with a taken lock (the direct
	// path); false: the caller enqueues. A value rather than a pointer, so
	// that a caller's Acquire holding it stays on the caller's stack.
	Direct     bool
	Message    Message
	KeyForm    string // how the key was chosen (KeyForm), kept in a taken lock
	DueAt      int64  // for Message: unix seconds it is due; 0: pending now
	MaxPending int    // most keys of the type waiting in the queue; 0: no bound
	Payload    []byte // the new payload, for FoldReplace and a follow-up
	FollowID   string // ID of a follow-up created for a running holder (RunDefer)
	// Cooldown: once the task of a lock this call takes succeeds, the key
	// stays held until Cooldown after the take; 0: released at once.
	Cooldown time.Duration
	// DebounceDue: a fold into a scheduled holder moves its due time here
	// (unix seconds) and its lock's lifetime to TTL from now; 0: no move.
	DebounceDue int64
	// FailHold: once the task of a lock this call takes fails for good,
	// the key stays held this long; negative: until released by hand; 0:
	// released at once.
	FailHold time.Duration
	// Window: a period key's window, kept in a taken lock; zero: none.
	Window Window
	// CoolAlways: the cooldown of a lock this call takes follows any end
	// of its task that is not a final failure (a revoke too), not only a
	// success.
	CoolAlways bool

	staleFP string // the key a stale index of the caller-chosen ID names (learnt from a reply)
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
	State    string        // StatusReplaced, StatusMerge: Task's asynq state
	Payload  []byte        // StatusMerge: Task's payload
	Version  string        // StatusMerge: the version Coalesce compares
	Waiting  int64         // StatusOver: keys waiting
	Queued   int64         // StatusOver: tasks in the queue's pending list and scheduled set
	Cooling  time.Duration // StatusCooling: how long the key stays held; negative: until released
	Failed   bool          // StatusCooling: the holder failed for good (a failure hold), rather than succeeded
	Reason   string        // StatusBroken
	Lock     string        // the lock's key
	Stored   bool          // StatusTaken: the task (Acquire.Message) was stored with the lock
	// Sent: with an error, the failed call carried the task to store with
	// the lock (Acquire.Direct), so it may be stored (even if the last
	// answer was a refusal: go-redis retries calls that may have run).
	Sent bool
}

// ErrMoving reports a lock whose holder changed every time a script asked
// for its keys (see roles.go).
var ErrMoving = errors.New("dedup: lock kept changing hands while it was read")

// maxNeeds bounds the calls of one operation that are answered statusNeed.
const maxNeeds = 4

// Acquire runs the acquire script, calling it again with the keys it asks
// for.
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
	lock    string
	h       hint // the holder and follow-up the next call passes
	n       int  // calls answered statusNeed so far
	replace bool // the next call is the replace script (a Replace into the holder h names)
}

func (s *Store) newAcquireStep(a *Acquire) acquireStep {
	st := acquireStep{lock: s.keys.LockOf(&a.Ref)}
	st.h, _ = s.hints.get(st.lock)
	st.replace = a.replacesKnownHolder(&st.h)
	return st
}

// next returns a's next call: the script, its KEYS and ARGV.
func (st *acquireStep) next(s *Store, a *Acquire) (*redis.Script, []string, []any) {
	if st.replace {
		h := &st.h
		return s.sc.replace, []string{st.lock, h.holderTask}, []any{h.holder, payloadField(a.Payload), typeField(a.Ref.Type)}
	}
	if st.n > 0 {
		st.h.checked = 0 // a call asked for more keys verifies what it finds
	}
	keys, args := a.build(s, st.lock, &st.h, st.n > 0)
	return s.sc.acquire, keys, args
}

// read reads the reply v (or the failure err) of a's call. more reports
// that a needs another call: the replace script did not apply, the acquire
// script asked for more keys, or the ACL refused the queue's registry of
// prefixes.
func (st *acquireStep) read(s *Store, a *Acquire, v any, err error) (res AcquireResult, more bool, _ error) {
	if st.replace {
		st.replace = false
		return st.readReplace(v, err)
	}
	if err != nil && s.registryRefused(err, a.Ref.Queue) {
		return AcquireResult{}, true, nil // (not a statusNeed)
	}
	if err != nil {
		return AcquireResult{Sent: a.sendsMessage(&st.h) && !errors.Is(err, s.cfg.ErrCircuitOpen)}, false, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return AcquireResult{}, false, err
	}
	s.registered.Store(a.Ref.Queue, true) // (the script ran: it registered the prefix, if asked)
	if rep.status != statusNeed {
		return a.result(s, st.lock, &st.h, rep), false, nil
	}
	if st.n == maxNeeds {
		return AcquireResult{}, false, fmt.Errorf("%w: %s", ErrMoving, st.lock)
	}
	st.n++
	st.h = newHint(&a.Ref, rep.str(1), rep.str(2))
	st.h.read = true
	if fp := rep.str(3); IsFingerprint(fp) {
		a.staleFP = fp
	}
	return AcquireResult{}, true, nil
}

// readReplace reads the replace script's reply (lua/replace.lua): the
// payload was written into the holder, or the script did not apply and
// acquire must run.
func (st *acquireStep) readReplace(v any, err error) (AcquireResult, bool, error) {
	if err != nil {
		return AcquireResult{}, false, err
	}
	rep, err := parseReply(v)
	if err != nil || rep.status != StatusReplaced {
		return AcquireResult{}, err == nil, err
	}
	return AcquireResult{Status: StatusReplaced, Task: st.h.holderID, State: rep.str(0), Lock: st.lock}, false, nil
}

// registryRefused reports whether err is an ACL's refusal of a call that
// declared queue's registry of prefixes (PrefixesKey, a fixed name outside
// a custom prefix): the registration, best effort, is then given up for
// the queue, and the call is to be made again without it.
func (s *Store) registryRefused(err error, queue string) bool {
	if _, done := s.registered.Load(queue); done || !redis.HasErrorPrefix(err, "NOPERM") {
		return false
	}
	s.registered.Store(queue, true)
	s.cfg.Logger.Debug("dedup: the ACL refuses the queue's registry of prefixes; a server with another prefix will not find these locks", slog.String("queue", queue))
	return true
}

// replacesKnownHolder reports whether the call is a Replace into the
// holder a hint names, which the replace script does alone.
func (a *Acquire) replacesKnownHolder(h *hint) bool {
	return a.OnWaiting == FoldReplace && h.holder != "" && h.follow == "" && h.holderID != a.Ref.ID && a.DebounceDue == 0
}

// build returns the script's KEYS and ARGV, with the keys of h's holder and
// follow-up; all declares every key a slow path may need, as after a
// statusNeed reply.
func (a *Acquire) build(s *Store, lock string, h *hint, all bool) ([]string, []any) {
	r := &a.Ref
	kl := newKeyList(byte(a.OnWaiting), byte(a.OnRunning))
	sends := a.sendsMessage(h)
	if a.trusts(s, h) {
		kl.roles[0] = foldRejectTrusting
		h = &hint{} // the lock alone answers: no holder keys or arguments
	}
	kl.add(roleLock, lock)
	if _, done := s.registered.Load(r.Queue); !done {
		kl.add(rolePrefixes, PrefixesKey(r.Queue)) // (once per queue: the script adds the prefix)
	}
	if r.Indexed {
		kl.add(roleIndex, s.keys.Index(r.Queue, r.ID))
		// The ID's own record: whether the ID's task lives (an index may be
		// stale), and the task met when the ID holds the key itself.
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if a.staleFP != "" {
			kl.add(roleStaleLock, s.keys.Lock(r.Queue, a.staleFP))
		}
	}
	if a.DebounceDue != 0 {
		kl.add(roleScheduled, ScheduledKey(r.Queue))
	}
	if sends {
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if a.DueAt != 0 {
			kl.add(roleScheduled, ScheduledKey(r.Queue))
		} else {
			kl.add(rolePending, PendingKey(r.Queue))
		}
	}
	if a.MaxPending > 0 || all {
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
		kl.add(rolePending, PendingKey(r.Queue))
		kl.add(roleScheduled, ScheduledKey(r.Queue))
	}
	if a.FollowID != "" || all {
		kl.add(roleFollow, s.keys.Follow(r.Queue, r.FP))
		kl.add(roleScheduled, ScheduledKey(r.Queue))
		kl.add(rolePending, PendingKey(r.Queue))
	}
	if a.FollowID != "" {
		kl.add(roleNewFollow, TaskKey(r.Queue, a.FollowID))
	}
	if h.holder != "" && (all || a.folds() || h.read) {
		kl.add(roleHolder, h.holderTask)
		if all || a.DebounceDue != 0 {
			kl.add(roleHolderIndex, s.keys.Index(r.Queue, h.holderID))
		}
	}
	if h.holder != "" && a.FollowID != "" && a.OnWaiting == FoldReplace {
		kl.add(roleSuperseded, s.keys.Superseded(r.Queue, h.holderID))
	}
	if h.follow != "" {
		kl.add(roleFollowTask, h.followTask)
	}
	return kl.keys, a.args(s, kl, h, sends)
}

// DefaultRecheck bounds how long a process answers a plain rejection of a
// lock written with its task (field v) from the lock alone after it last
// read the owner's record (Config.Recheck): a hot key's rejections do not
// each pay for that read, and an owner that has gone frees the key within
// this time.
const DefaultRecheck = time.Second

// foldRejectTrusting is FoldReject for a call whose process read the
// holder's record less than recheckEvery ago: the script may answer from
// the lock alone even when the lock is marked v.
const foldRejectTrusting = 'X'

// trusts reports whether the call may be answered from the lock alone.
func (a *Acquire) trusts(s *Store, h *hint) bool {
	return a.OnWaiting == FoldReject && a.FollowID == "" && h.checked != 0 && a.Now.UnixNano()-h.checked < int64(s.cfg.Recheck)
}

// folds reports whether the call may fold into the task holding the key,
// and so read its record.
func (a *Acquire) folds() bool { return a.OnWaiting != FoldReject || a.FollowID != "" }

// sendsMessage reports whether the call sends the task to store with the
// lock: not when a hint says the key is held, since it would go unused
// (if the key turns out free, the lock is taken without it and the task is
// enqueued through asynq's client: AcquireResult.Stored is false).
func (a *Acquire) sendsMessage(h *hint) bool {
	return a.Direct && (h.holder == "" || a.Ref.Indexed) // a caller-chosen ID is checked against asynq's tasks
}

// args lays out ARGV; the optional arguments go only as far as the last
// one that differs from its default (a plain call sends 9).
func (a *Acquire) args(s *Store, kl *keyList, h *hint, sends bool) []any {
	r := &a.Ref
	var msg []byte
	if sends {
		msg = a.Message.Encode() // only now: a call expecting the key held never encodes it
	}
	args := make([]any, 9, 24)
	args[0], args[1], args[2], args[3] = kl.roleString(), r.ID, r.stored(), a.Now.UnixMilli()
	args[4], args[5], args[6], args[7], args[8] = s.graceSeconds(), ms(a.TTL), msg, r.Type, a.KeyForm
	n := 0
	switch {
	case a.CoolAlways:
		n = 15
	case !a.Window.Start.IsZero():
		n = 14
	case a.FailHold != 0:
		n = 13
	case a.DebounceDue != 0:
		n = 12
	case a.Cooldown > 0:
		n = 10
	case a.FollowID != "":
		n = 9
	case a.MaxPending > 0 || a.folds():
		n = 7
	case a.DueAt != 0 && msg != nil:
		n = 6
	case h.follow != "":
		n = 5
	case kl.has(roleWait) || kl.has(roleIndex):
		n = 3
	case h.holder != "":
		n = 2
	}
	if n == 0 {
		return args
	}
	var field []byte // the payload, which only a call that may fold uses
	if a.folds() {
		field = payloadField(a.Payload)
	}
	var cool int64
	if a.Cooldown > 0 {
		cool = ms(a.Cooldown)
	}
	opt := [...]any{field, h.holder, r.FP, h.follow, h.followStored, a.DueAt, a.MaxPending, a.FollowID, s.parkSeconds(), cool, a.DebounceDue, h.holderID, FailHold(a.FailHold), a.Window.arg(), flag(a.CoolAlways)}
	return append(args, opt[:n]...)
}

// result reads the reply and remembers the lock's holder for the next
// call; h is the hint the call passed.
func (a *Acquire) result(s *Store, lock string, h *hint, rep reply) AcquireResult {
	res := AcquireResult{Status: rep.status, Lock: lock}
	switch rep.status {
	case StatusTaken:
		res.Stored = a.sendsMessage(h)
		// Other calls learn the holder when they meet it: most keys are taken
		// once. (A rejection of a lock stored with its task reads the task's
		// record, so a process's first one costs a round trip more, to learn
		// the holder's ID: cheaper than remembering every accepted key.)
		if a.folds() {
			s.remember(lock, &a.Ref, h, a.Ref.stored(), "", false, 0)
		}
	case statusHeldYoung:
		res.Status, res.Task = StatusHeld, h.id(&a.Ref, rep.str(0))
		if !a.trusts(s, h) { // a trusting call keeps the hint it had, and its check time
			s.remember(lock, &a.Ref, h, rep.str(0), "", false, 0)
		}
	case StatusHeld:
		res.Task = h.id(&a.Ref, rep.str(0))
		res.FollowUp = rep.str(2) != "" && rep.str(0) == rep.str(2)
		var checked int64
		if rep.str(3) == "v" { // the owner's record was read: later rejections may trust the lock a while
			checked = a.Now.UnixNano()
		}
		s.remember(lock, &a.Ref, h, rep.str(1), rep.str(2), true, checked)
	case StatusReplaced, StatusMerge:
		res.Task, res.State = h.id(&a.Ref, rep.str(0)), rep.str(1)
		last := len(rep.strs) - 2
		if rep.status == StatusMerge {
			res.Payload, res.Version, res.State = []byte(rep.str(1)), rep.str(2), ""
		}
		s.remember(lock, &a.Ref, h, rep.str(last), rep.str(last+1), true, 0)
		res.FollowUp = rep.str(last+1) != "" && rep.str(0) == rep.str(last+1)
	case StatusDeferred:
		res.Task, res.FollowUp = rep.str(0), true
		s.remember(lock, &a.Ref, h, rep.str(1), rep.str(2), true, 0)
	case StatusReserved:
		res.Task = h.id(&a.Ref, rep.str(0))
		s.remember(lock, &a.Ref, h, rep.str(0), "", true, 0)
	case StatusOver:
		res.Waiting, _ = strconv.ParseInt(rep.str(0), 10, 64)
		res.Queued, _ = strconv.ParseInt(rep.str(1), 10, 64)
	case StatusCooling:
		res.Task = h.id(&a.Ref, rep.str(0))
		res.Cooling, res.Failed = parseMillis(rep.str(1)), rep.str(2) == CoolingFailed
	case StatusBroken:
		res.Reason = rep.str(0)
	}
	return res
}

// remember keeps the lock's holder and follow-up for the next call (read:
// this call had to read the holder's record; checked: when a reply read it
// and found it live, unix nanoseconds, 0 if this one did not), unless the
// hint passed came from the cache and already says so.
func (s *Store) remember(lock string, r *Ref, h *hint, holder, follow string, read bool, checked int64) {
	if h.cached && h.holder == holder && h.follow == follow && h.read == read && (checked == 0 || h.checked == checked) {
		return
	}
	nh := newHint(r, holder, follow)
	nh.read, nh.checked = read, checked
	s.hints.put(lock, nh)
}

// payloadField encodes a payload as TaskMessage field 2, as the scripts
// splice it ("" for an empty payload, which proto3 omits).
func payloadField(p []byte) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return appendPayloadField(make([]byte, 0, len(p)+6), p)
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
	// DebounceDue and TTL, as in Acquire: a scheduled holder merged into
	// becomes due then, and its lock lasts TTL from now.
	DebounceDue int64
	TTL         time.Duration
	Bounded     bool      // with DebounceDue: the type counts its waiting keys (MaxPending)
	Now         time.Time // with Bounded: the producer's clock
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
	args := []any{c.Target, PackOwner(c.Target, c.Ref.FP), follow, c.Version, payloadField(c.Payload)}
	if c.DebounceDue != 0 {
		keys = append(keys, ScheduledKey(c.Ref.Queue), s.keys.Index(c.Ref.Queue, c.Target))
		args = append(args, c.DebounceDue, ms(c.TTL), c.Ref.FP, c.Now.UnixMilli())
		if c.Bounded {
			keys = append(keys, s.keys.Wait(c.Ref.Queue, c.Ref.Type))
		}
	}
	v, err := s.run(ctx, s.sc.coalesce, keys, args...)
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
// task took if asynq refused to enqueue it; bounded says the lock may be
// counted in its type's waiting set (MaxPending). It reports whether it
// did.
func (s *Store) Unlock(ctx context.Context, r *Ref, bounded bool) (bool, error) {
	lock := s.keys.LockOf(r)
	kl := newKeyList()
	kl.add(roleLock, lock)
	if bounded {
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
	}
	if r.Indexed {
		kl.add(roleIndex, s.keys.Index(r.Queue, r.ID))
	}
	v, err := s.run(ctx, s.sc.unlock, kl.keys, kl.roleString(), r.stored(), r.FP, r.ID)
	if err != nil {
		return false, err
	}
	s.hints.forget(lock)
	return parseFlag(v)
}

// flag encodes a boolean script argument: "1" or "".
func flag(b bool) string {
	if b {
		return "1"
	}
	return ""
}
