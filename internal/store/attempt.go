package store

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts of a task's run, for the server middleware: Start when an
// attempt begins, Extend while it runs (the heartbeat), Finish when it
// ends.

// Start is one call of the start script (lua/start.lua): make an attempt
// the running owner of its task's lock.
type Start struct {
	Ref     Ref
	Token   string        // the attempt's random token
	Lease   time.Duration // the running lock's lifetime
	Running Running       // running policy, recorded if Start creates the lock
	KeyForm string        // how the key was chosen (KeyForm), recorded if Start creates the lock; "": unknown
	// Cooldown, recorded if Start creates the lock (as Acquire.Cooldown,
	// from now).
	Cooldown time.Duration
	// FailHold, recorded if Start creates the lock (as Acquire.FailHold).
	FailHold time.Duration
	// Window, recorded if Start creates the lock (as Acquire.Window).
	Window Window
}

// StartResult is what start did.
type StartResult struct {
	Status  Status        // StatusTaken, StatusHeld, StatusCooling, StatusAllowed or StatusSuperseded
	Holder  string        // StatusHeld, StatusCooling: the task holding the key; StatusSuperseded: the follow-up that replaces it
	Follow  string        // StatusTaken, StatusHeld: the follow-up the lock owes, "" for none
	Cooling time.Duration // StatusCooling: how long the key stays held; negative: until released
	Failed  bool          // StatusCooling: held after the holder failed for good (OnFailure)
	Cools   bool          // StatusTaken: the lock has a cooldown (Cooldown, Period), perhaps the producer's alone
	New     bool          // StatusTaken: there was no lock, the attempt made it; StatusAllowed: there was no lock to drop
	// Released: StatusHeld, and an operator released this task's lock
	// (Release, dedupctl release) before the holder, a task of its type,
	// took the key: the holder's payload is the newer; StatusCooling, and
	// an operator released this task's lock.
	Released bool
	// HolderRuns: StatusHeld, and an attempt of the holder runs now.
	HolderRuns bool
	// Begun: StatusTaken by the begin script: the lock held nothing but
	// its owner (Finish.Begun).
	Begun bool
}

// Start makes the attempt its lock's owner: by the begin script where the
// lock is the one the wrapper wrote with its task and holds nothing else to
// settle (the common case, one small script, shared with the attempts that
// begin at the same moment: begin.go), else, or if begin finds otherwise,
// by the start script, called again with the keys it asks for.
func (s *Store) Start(ctx context.Context, st *Start) (StartResult, error) {
	r := &st.Ref
	lock := s.keys.LockOf(r)
	if r.direct() && st.Cooldown == 0 && st.Running != RunAllow { // (a lock of such a rule declines)
		ok, err := s.bg.begin(ctx, r, lock, s.keys.Follow(r.Queue, r.FP), st.Token, st.Lease)
		if ok || err != nil {
			return StartResult{Status: StatusTaken, Begun: ok}, err
		}
	}
	return s.start(ctx, st)
}

// start runs the start script, calling it again with the keys it asks for.
func (s *Store) start(ctx context.Context, st *Start) (StartResult, error) {
	r := &st.Ref
	lock := s.keys.LockOf(r)
	holder := ""
	for n := 0; ; n++ {
		kl := newKeyList()
		kl.add(roleLock, lock)
		kl.add(roleWait, s.keys.Wait(r.Queue, r.Type))
		kl.add(roleFollow, s.keys.Follow(r.Queue, r.FP))
		kl.add(roleSuperseded, s.keys.Superseded(r.Queue, r.ID))
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if r.Indexed {
			kl.add(roleIndex, s.keys.Index(r.Queue, r.ID))
		}
		if holder != "" {
			id := UnpackOwner(holder, r.FP)
			kl.add(roleHolder, TaskKey(r.Queue, id))
			kl.add(roleHolderIndex, s.keys.Index(r.Queue, id))
		}
		var cool int64
		if st.Cooldown > 0 {
			cool = ms(st.Cooldown)
		}
		v, err := s.run(ctx, s.sc.start, kl.keys, kl.roleString(), r.ID, r.stored(), st.Token,
			ms(st.Lease), s.graceSeconds(), string(st.Running), r.FP, holder, cool, r.Type, st.KeyForm, FailHold(st.FailHold), st.Window.arg())
		if err != nil {
			return StartResult{}, err
		}
		rep, err := parseReply(v)
		if err != nil {
			return StartResult{}, err
		}
		switch {
		case rep.status == StatusHeld:
			return StartResult{Status: StatusHeld, Holder: UnpackOwner(rep.str(0), r.FP), Follow: rep.str(1), Released: rep.str(2) == "r",
				HolderRuns: rep.str(3) == "run"}, nil
		case rep.status == StatusCooling:
			return StartResult{Status: StatusCooling, Holder: UnpackOwner(rep.str(0), r.FP), Cooling: parseMillis(rep.str(1)), Released: rep.str(2) == "r",
				Failed: rep.str(3) == CoolingFailed}, nil
		case rep.status == StatusSuperseded:
			return StartResult{Status: rep.status, Holder: rep.str(0)}, nil
		case rep.status != statusNeed:
			return StartResult{Status: rep.status, Follow: rep.str(0), New: rep.str(1) == "1", Cools: rep.str(2) == "1"}, nil
		case n == maxNeeds:
			return StartResult{}, fmt.Errorf("%w: %s", ErrMoving, lock)
		}
		holder = rep.str(1)
	}
}

// Extend is one call of the extend script (lua/extend.lua): renew a lock
// if its owner (task and attempt) still holds it.
type Extend struct {
	Ref   Ref
	Token string        // the running attempt's token; "" renews a waiting lock
	TTL   time.Duration // the new lifetime
}

func (e *Extend) keysArgs(s *Store) ([]string, []any) {
	r := &e.Ref
	keys := []string{s.keys.LockOf(r), ScheduledKey(r.Queue), s.keys.Follow(r.Queue, r.FP)}
	if r.Indexed {
		keys = append(keys, s.keys.Index(r.Queue, r.ID))
	}
	return keys, []any{r.stored(), e.Token, ms(e.TTL), s.parkSeconds(), r.ID}
}

// Extend runs the extend script. It reports whether the lock was renewed
// (false: it is gone or another task's or attempt's).
func (s *Store) Extend(ctx context.Context, e *Extend) (bool, error) {
	keys, args := e.keysArgs(s)
	v, err := s.run(ctx, s.sc.extend, keys, args...)
	if err != nil {
		return false, err
	}
	return parseFlag(v)
}

// ExtendResult is the outcome of one Extend of ExtendAll.
type ExtendResult struct {
	Renewed bool
	Err     error
}

// ExtendAll renews many locks: the heartbeat of every running attempt of a
// process. It sends one pipeline per node (on Redis Cluster, one per
// master, concurrently, each through that master's breaker, so a failing
// master delays only its own renewals), bounded by LockTimeout. Scripts
// missing from the server's cache are sent again whole.
func (s *Store) ExtendAll(ctx context.Context, es []*Extend) []ExtendResult {
	out := make([]ExtendResult, len(es))
	groups := map[*shard][]int{}
	for i, e := range es {
		sh := s.sh.forKey(ctx, s.keys.LockOf(&e.Ref))
		groups[sh] = append(groups[sh], i)
	}
	eachGroup(groups, func(idx []int) { s.extendGroup(ctx, es, idx, out) })
	return out
}

// eachGroup calls do for every group, concurrently when there are several
// (so that one node's slow call delays only its own group), and returns
// when all are done.
func eachGroup[K comparable](groups map[K][]int, do func(idx []int)) {
	if len(groups) == 1 {
		for _, idx := range groups {
			do(idx)
		}
		return
	}
	var wg sync.WaitGroup
	for _, idx := range groups {
		wg.Go(func() { do(idx) })
	}
	wg.Wait()
}

// extendGroup renews the locks es[idx] of one node in one pipeline and
// writes their results to out[idx].
func (s *Store) extendGroup(ctx context.Context, all []*Extend, idx []int, out []ExtendResult) {
	es := make([]*Extend, len(idx))
	for j, i := range idx {
		es[j] = all[i]
	}
	route := s.keys.LockOf(&es[0].Ref)
	cmds, err := s.extendPipeline(ctx, route, es, true)
	for _, c := range cmds {
		if c.Err() != nil && redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
			cmds, err = s.extendPipeline(ctx, route, es, false) // scripts flushed (restart, failover)
			break
		}
	}
	for j, i := range idx {
		if cmds == nil {
			out[i].Err = err // the pipeline did not complete
			continue
		}
		c, ok := cmds[j].(*redis.Cmd)
		if !ok {
			out[i].Err = fmt.Errorf("dedup: unexpected pipeline reply %T", cmds[j])
			continue
		}
		v, err := c.Result()
		if err != nil {
			out[i].Err = err
			continue
		}
		out[i].Renewed, out[i].Err = parseFlag(v)
	}
}

func (s *Store) extendPipeline(ctx context.Context, route string, es []*Extend, sha bool) ([]redis.Cmder, error) {
	return s.Pipelined(ctx, route, func(p redis.Pipeliner) {
		for _, e := range es {
			keys, args := e.keysArgs(s)
			if sha {
				s.sc.extend.EvalSha(ctx, p, keys, args...)
			} else {
				s.sc.extend.Eval(ctx, p, keys, args...)
			}
		}
	})
}

// Finish is one call of the finish script (lua/finish.lua): an attempt
// ended; release its lock (to the follow-up it owes, if any) or hold it
// for the retry.
type Finish struct {
	Ref       Ref
	Token     string        // the attempt's; "" for a lock no attempt runs under (a check after a guess)
	Release   bool          // release; false: hold for a retry
	Hold      time.Duration // for a hold: the lock's lifetime
	FollowTTL time.Duration // a released follow-up's lock lifetime
	Follow    string        // the follow-up the lock owes, if known (StartResult.Follow)
	// GivenUp: asynq gave the attempt up (its context ended), so the
	// handler's result does not count. The task's own record decides once
	// asynq has moved it on (waiting: hold; archived, completed or gone:
	// release); Release is the guess for while it still reads active.
	GivenUp bool
	// Succeeded: the handler returned nil. Once the attempt is released as
	// a success (not given up, or given up and asynq's record says
	// completed or deleted, not archived), a lock with a cooldown stays
	// until the cooldown's end.
	Succeeded bool
	// Watch: check a lock held for the task's retry (no Token) that owes a
	// follow-up: released to the follow-up once the task's record says it
	// will not run again (an operator deleted or archived it); else
	// untouched (FinishResult.Held).
	Watch bool
	// Failure: the handler's error, when a release ends the task for good
	// (asynq archives it): a lock recording a failure hold then stays, with
	// this error, on a guess until asynq's record says archived; "" for
	// success or a revoke.
	Failure string
	// Begun: the attempt started by the begin script (StartResult.Begun):
	// a release tries the done script first, which settles the common case
	// in one small call.
	Begun bool
}

// FinishResult is what finish did.
type FinishResult struct {
	Owned bool // the attempt still owned the lock; false: nothing done
	Held  bool // held for the task's next run; else released
	// Guessed: held on Finish.Release's guess, as asynq had not moved the
	// task on yet (GivenUp); Finish again later with no Token to check.
	Guessed bool
	Follow  string // the follow-up the lock was released to, "" for none
	Cooling bool   // kept, the task done, until the end of its cooldown
	Failed  bool   // kept, the task archived, for its failure hold
	Owes    string // Held: the follow-up the lock owes, "" for none (to Watch)
}

// Finish settles the attempt: by the done script for a release of an
// attempt begin started whose lock still holds nothing else (one small
// call), else, or if done finds otherwise, by the finish script, called
// again with the follow-up's record if the lock owes one it was not told
// of.
func (s *Store) Finish(ctx context.Context, f *Finish) (FinishResult, error) {
	r := &f.Ref
	mode := "hold"
	switch {
	case f.Watch:
		mode = "watch"
	case f.Release:
		mode = "release"
	}
	if mode == "release" && f.Begun && !f.GivenUp && f.Follow == "" && f.Failure == "" && f.Token != "" && r.direct() {
		if res, settled, err := s.done(ctx, f); settled || err != nil {
			return res, err
		}
	}
	hintF := f.Follow
	for n := 0; ; n++ {
		kl, args := s.finishCall(f, mode, hintF)
		v, err := s.run(ctx, s.sc.finish, kl.keys, args...)
		if err != nil {
			return FinishResult{}, err
		}
		rep, err := parseReply(v)
		if err != nil {
			return FinishResult{}, err
		}
		switch {
		case rep.status != statusNeed:
			held := rep.str(1) == "held"
			res := FinishResult{Owned: rep.status == StatusTaken, Follow: rep.str(0), Held: held, Guessed: held && rep.str(2) == "guess", Cooling: rep.str(1) == "cooling", Failed: rep.str(1) == "failed"}
			if held {
				res.Owes = rep.str(3)
			}
			return res, nil
		case n == maxNeeds:
			return FinishResult{}, fmt.Errorf("%w: %s", ErrMoving, kl.keys[0])
		}
		hintF = rep.str(1)
	}
}

// finishCall lays out the finish script's KEYS and ARGV for f in mode,
// with the follow-up hintF's record if one is owed.
func (s *Store) finishCall(f *Finish, mode, hintF string) (*keyList, []any) {
	r := &f.Ref
	kl := newKeyList()
	kl.add(roleLock, s.keys.LockOf(r))
	kl.add(roleScheduled, ScheduledKey(r.Queue))
	kl.add(rolePending, PendingKey(r.Queue))
	kl.add(roleFollow, s.keys.Follow(r.Queue, r.FP))
	if r.Indexed {
		kl.add(roleIndex, s.keys.Index(r.Queue, r.ID))
	}
	stored := ""
	if hintF != "" {
		kl.add(roleFollowTask, TaskKey(r.Queue, hintF))
		kl.add(roleSuperseded, s.keys.Superseded(r.Queue, r.ID))
		stored = PackOwner(hintF, r.FP)
	}
	if f.GivenUp || f.Watch || (f.Release && f.Failure != "") {
		kl.add(roleOwner, TaskKey(r.Queue, r.ID))
	}
	args := []any{kl.roleString(), r.stored(), f.Token, mode, ms(f.Hold), ms(f.FollowTTL), s.parkSeconds(), hintF, stored, r.ID}
	switch ok := ""; {
	case f.Failure != "":
		if f.Succeeded {
			ok = "1" // (given up: asynq's record decides which counts)
		}
		args = append(args, ok, r.Type, f.Failure)
	case f.Succeeded:
		args = append(args, "1", r.Type)
	}
	return kl, args
}

// Again stores a copy of the running task of r under a new ID, due at a
// later time (lua/again.lua): for a task asynq would archive on its last
// attempt for a reason that is no failure of its own. A task that is the
// follow-up r's lock owes hands that place to its copy. It reports false if
// the task's record is gone.
func (s *Store) Again(ctx context.Context, r *Ref, newID string, due time.Time) (bool, error) {
	keys := []string{TaskKey(r.Queue, r.ID), TaskKey(r.Queue, newID), ScheduledKey(r.Queue), s.keys.LockOf(r), s.keys.Follow(r.Queue, r.FP)}
	v, err := s.run(ctx, s.sc.again, keys, newID, due.Unix(), r.ID)
	if err != nil {
		return false, err
	}
	rep, err := parseReply(v)
	if err != nil {
		return false, err
	}
	if rep.status == StatusBroken {
		return false, fmt.Errorf("dedup: task %s: %s", r.ID, rep.str(0))
	}
	return rep.status == StatusTaken, nil
}
