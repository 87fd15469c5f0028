package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts of a task's run, for the server middleware, each called only
// where the task's policy or history needs it: Start when an attempt must
// check its key, Extend while a handler runs long, Settle when an attempt
// whose policy acts at its end ends.

// Start is one call of the start script (lua/start.lua).
type Start struct {
	Ref   Ref           // with Lock
	TTL   time.Duration // a lock it takes lives this long; the task's own at least this long
	Allow bool          // RunningAllow: the key is freed as the task starts
	Token string        // the attempt's, in a lock taken as it starts (StartValue)
	Mode  []any         // the mode record of a lock it takes (a task that arrived without one); nil none
}

// StartResult is what start did.
type StartResult struct {
	Status     Status        // StatusTaken, StatusHeld, StatusCooling, StatusAllowed or StatusElsewhere
	Holder     string        // StatusHeld, StatusCooling: the task holding the key
	Cooling    time.Duration // StatusCooling: how long the key stays held; negative: until released
	Failed     bool          // StatusCooling: held after the holder failed for good (OnFailure)
	New        bool          // StatusTaken: the attempt took the free key; StatusAllowed: there was no lock to drop
	HolderRuns bool          // StatusHeld: the holder is running
	Value      string        // StatusTaken: the lock's value after the start (StartValue: this attempt's)
}

// Start runs the start script, calling it again with the keys it asks for.
func (s *Store) Start(ctx context.Context, st *Start) (StartResult, error) {
	r := &st.Ref
	var h hint
	for n := 0; ; n++ {
		kl := newKeyList()
		kl.add(roleLock, r.Lock)
		kl.add(roleMode, r.Mode())
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		kl.add(roleWait, WaitOf(r.Lock, r.Type))
		if h.holder != "" {
			kl.add(roleHolder, TaskKey(r.Queue, h.holder))
		}
		args := append([]any{kl.roleArg(), r.ID, ms(st.TTL), flag(st.Allow), r.FP, h.holder, s.graceSeconds(), st.Token}, st.Mode...)
		rep, err := s.runReply(ctx, s.sc.start, kl.keys, args)
		switch {
		case err != nil:
			return StartResult{}, err
		case rep.status == statusNeed && n < maxNeeds:
			h = hint{holder: rep.str(1)}
			continue
		case rep.status == statusNeed:
			return StartResult{}, fmt.Errorf("%w: %s", ErrMoving, r.Lock)
		}
		return startResult(rep), nil
	}
}

func startResult(rep reply) StartResult {
	res := StartResult{Status: rep.status}
	switch rep.status {
	case StatusHeld:
		res.Holder, res.HolderRuns = rep.str(0), rep.str(1) == "1"
	case StatusCooling:
		res.Holder, res.Cooling, res.Failed = rep.str(0), parseMillis(rep.str(1)), rep.str(2) == heldFailed
	case StatusTaken, StatusAllowed:
		res.New, res.Value = rep.str(0) == "1", rep.str(1)
	}
	return res
}

// addFollowKeys adds the keys that hand a key to its follow-up f.
func addFollowKeys(kl *keyList, queue, f string) {
	kl.add(roleFollowTask, TaskKey(queue, f))
	kl.add(roleScheduled, ScheduledKey(queue))
	kl.add(rolePending, PendingKey(queue))
	kl.add(roleRetry, RetryKey(queue))
}

// How an attempt ended, for Settle.
const (
	EndSuccess = "ok"     // the handler returned nil
	EndRevoke  = "revoke" // asynq.RevokeTask: asynq deletes the task
	EndFail    = "fail"   // a final failure: asynq archives the task
	EndRetry   = "retry"  // asynq runs the task again
	// EndNote: the handler of an attempt whose end was settled while it
	// ran on (asynq gave it up) returned: only its note (Settle.Note) goes.
	EndNote = "note"
)

// Settle is one call of the settle script (lua/settle.lua).
type Settle struct {
	Ref Ref
	End string // EndSuccess, EndRevoke, EndFail, EndRetry or EndNote
	// TTL: EndRetry, how long the key stays held at least; else the lock's
	// lifetime for a follow-up it goes to.
	TTL time.Duration
	Err string // EndFail: the handler's error
	// After a success or revoke the lock is released (asynq's done would
	// release a lock its record names moments later; Release: the record does
	// not name it), unless Loosen: the attempt's deadline was near and asynq
	// may yet retry the task, so the lock is left for asynq's record to
	// answer (a lock its record does not name, as taken at start: StartValue).
	Release bool
	Loosen  bool
	// Late: a success that ended with no call (the owed signal), settled
	// after it to hand the key to a follow-up made meanwhile. It acts only
	// once asynq's done has released the lock: while the lock still names
	// the task, that may be a later attempt, or a new task under the same
	// ID, that holds the key (Waits).
	Late bool

	Due time.Duration // EndRetry: when asynq runs the task again, from now
	// Note: the attempt's token, when asynq gave it up while its handler ran
	// and the key noted that handler (Extend.Note): the note goes now.
	Note string
	// Value: the lock's value as the attempt took it (StartValue), for an
	// end settled after asynq's done: the key is the attempt's only while
	// the lock holds exactly that (a later attempt's start rewrites it).
	Value string
}

// SettleResult is what settle did.
type SettleResult struct {
	Owned    bool   // the key was the task's
	Released bool   // deleted here (Settle.Release)
	Held     bool   // held for the retry
	Cooling  bool   // cooling down (Cooldown, Period)
	Failed   bool   // held after the final failure (OnFailure)
	Follow   string // the follow-up the key went to, now queued; Held: the follow-up the key owes; "" none
	Waits    bool   // Late: nothing done, the lock still names the task (call again later)
}

// Settle runs the settle script, calling it again with the keys it asks
// for.
func (s *Store) Settle(ctx context.Context, st *Settle) (SettleResult, error) {
	r := &st.Ref
	follow := ""
	for n := 0; ; n++ {
		kl := newKeyList()
		kl.add(roleLock, r.Lock)
		kl.add(roleMode, r.Mode())
		kl.add(roleTask, TaskKey(r.Queue, r.ID))
		if follow != "" {
			addFollowKeys(kl, r.Queue, follow)
		}
		rep, err := s.runReply(ctx, s.sc.settle, kl.keys, []any{kl.roleArg(), r.ID, st.End, ms(st.TTL), st.Err, st.releaseArg(), follow,
			int64(st.Due / time.Second), st.Note, st.Value})
		switch {
		case err != nil:
			return SettleResult{}, err
		case rep.status == statusNeed && n < maxNeeds:
			follow = rep.str(2)
			continue
		case rep.status == statusNeed:
			return SettleResult{}, fmt.Errorf("%w: %s", ErrMoving, r.Lock)
		case rep.status == statusWait:
			return SettleResult{Waits: true}, nil
		case rep.status != 1:
			return SettleResult{}, nil
		}
		what := rep.str(0)
		return SettleResult{Owned: true, Released: what == "released", Held: what == "held", Cooling: what == "cooling",
			Failed: what == "failed", Follow: rep.str(1)}, nil
	}
}

// releaseArg is settle.lua's ARGV[6].
func (st *Settle) releaseArg() string {
	switch {
	case st.Release:
		return "1"
	case st.Loosen:
		return string(HoldStart)
	case st.Late:
		return "q"
	}
	return ""
}

// runReply runs a script and checks its reply.
func (s *Store) runReply(ctx context.Context, sc *redis.Script, keys []string, args []any) (reply, error) {
	v, err := s.run(ctx, sc, keys, args...)
	if err != nil {
		return reply{}, err
	}
	return parseReply(v)
}

// Extend is one lock the heartbeat makes live longer (lua/extend.lua).
type Extend struct {
	Ref Ref
	TTL time.Duration // how long the key stays held from now at least
	// Outlived: asynq gave the attempt up while its handler still runs; the
	// key's mode record says so (FieldOutlived) for this long from now, or
	// until the handler's end (Settle): the heartbeat renews it while the
	// handler runs, so a worker that dies leaves a note that lapses.
	Outlived time.Duration
	Note     string // with Outlived: the attempt's token (FieldNoteBy); only its Settle clears the note
}

// ExtendResult is what one Extend found.
type ExtendResult struct {
	Owned bool // the key is still the task's
	Err   error
}

// extendConcurrency bounds the extend calls in flight at once; concurrent
// calls share pipelines (batch.go).
const extendConcurrency = 32

// ExtendAll extends the locks es and reports for each whether it is still
// its task's.
func (s *Store) ExtendAll(ctx context.Context, es []*Extend) []ExtendResult {
	out := make([]ExtendResult, len(es))
	var wg sync.WaitGroup
	slots := make(chan struct{}, extendConcurrency)
	for i, e := range es {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			r := &e.Ref
			note := int64(0) // (extend.lua's '0': no note; ms would round a zero up to 1)
			if e.Outlived > 0 {
				note = ms(e.Outlived)
			}
			v, err := s.run(ctx, s.sc.extend, []string{r.Lock, r.Mode(), ScheduledKey(r.Queue), TaskKey(r.Queue, r.ID)}, r.ID, ms(e.TTL), note, e.Note)
			if err == nil {
				out[i].Owned, err = parseFlag(v)
			}
			out[i].Err = err
		})
	}
	wg.Wait()
	return out
}

// LockOf reads the lock the stored task id of queue names as its unique
// key: "" when it names none (or has no record).
func (s *Store) LockOf(ctx context.Context, queue, id string) (string, error) {
	key := TaskKey(queue, id)
	v, err := s.Do(ctx, key, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.HGet(c, key, "unique_key").Result()
	})
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	lock, _ := v.(string)
	return lock, err
}

// Again stores a copy of the running task r.ID under copyID, due at due
// (lua/again.lua): a task that met its key busy on its last attempt. It
// reports false when the task's record is gone.
func (s *Store) Again(ctx context.Context, r *Ref, copyID string, due time.Time) (bool, error) {
	keys := []string{TaskKey(r.Queue, r.ID), TaskKey(r.Queue, copyID), ScheduledKey(r.Queue)}
	if r.Lock != "" {
		keys = append(keys, r.Mode())
	}
	rep, err := s.runReply(ctx, s.sc.again, keys, []any{copyID, due.Unix(), r.ID})
	switch {
	case err != nil:
		return false, err
	case rep.status == StatusBroken:
		return false, fmt.Errorf("%w: %s", ErrIncompatible, rep.str(0))
	}
	return rep.status == 1, nil
}

// ErrIncompatible reports an asynq record the scripts do not understand.
var ErrIncompatible = errors.New("asynq's task record is not what this version expects")
