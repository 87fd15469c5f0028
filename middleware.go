package dedup

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup/internal/attempt"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// errPanicked stands for a handler that panicked while its lock's fate is
// decided; the panic itself goes on to asynq unchanged.
var errPanicked = errors.New("dedup: handler panicked")

// Middleware returns the server middleware: mux.Use(d.Middleware()).
//
// A task's lock is what asynq's record of the task says: a task locked at
// enqueue by NewClient names its lock as its unique key, and asynq's own
// scripts release it when the task succeeds, is revoked or deleted, in the
// same step that marks the task done. So for a task whose key's policy acts
// only at enqueue (Reject, Replace, Merge with RunningReject, Debounce, a
// Scheduler firing) the middleware makes no Redis call at all. It calls
// Redis only where a task needs it, and only on that path:
//
//	the attempt starts        RunningAllow (free the key), MaxPending (the key
//	                          waits no more), a follow-up, a task asynq runs
//	                          again (a retry, a run by hand) or one that lost
//	                          its key while it waited: check the key is its own
//	success                   Cooldown, Period: hold the key until the window ends
//	a final failure           OnFailure: hold the key (else it heals at the
//	                          key's next enqueue, asynq's record saying archived)
//	any end                   RunningDefer: hand the key to the follow-up it owes
//	a failure, retries left   hold the key for the retry delay
//	a long run                extend the key's lifetime (heartbeat.go)
//
// Those holds are written before the handler's result reaches asynq, so no
// shutdown or deadline can lose or stretch them.
//
// Once the attempt's context has ended (Timeout or Deadline, CancelProcessing,
// a lost lease), asynq ignores what the handler returns and retries or
// archives the task by its own rule; the middleware follows that rule.
//
// A task that arrives without a lock (asynq.Scheduler, another service, the
// CLI) takes one when it starts, keyed by its type's rule, and gives it
// back when it ends; if another live task holds that key it does not run
// now: it returns a *BusyError (retried later; see IsFailure) or, with
// Config.SkipBusy, nil. On its last attempt, where asynq would archive it,
// a copy of it (same message, new ID) is scheduled instead and the attempt
// returns nil.
func (d *Dedup) Middleware() asynq.MiddlewareFunc {
	d.hb.run()
	d.owed.run()
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return d.process(ctx, t, next)
		})
	}
}

func (d *Dedup) process(ctx context.Context, t *asynq.Task, next asynq.Handler) error {
	id, ok1 := asynq.GetTaskID(ctx)
	queue, ok2 := asynq.GetQueueName(ctx)
	if !ok1 || !ok2 {
		return next.ProcessTask(ctx, t) // not run by an asynq server
	}
	rec := attempt.Of(ctx) // nil unless a wrapper asked (attempt.With)
	l := d.attemptFor(ctx, queue, id, t)
	if l == nil {
		rec.Set(attempt.NotLocked)
		return next.ProcessTask(ctx, t)
	}
	l.rec = rec
	d.storedMarks(ctx, l)
	if l.lost == store.LostEnded {
		// An earlier attempt ended and settled the key (a success or revoke),
		// and asynq put the task back before it recorded that (a shutdown):
		// it is done.
		rec.Set(attempt.Released)
		d.log.Info("dedup: not run again: an attempt of the task already ended and settled its key", slog.String("type", t.Type()), slog.String("task_id", id))
		return nil
	}
	if !d.storedHere(ctx, queue, id) {
		rec.Set(attempt.Refused)
		return d.elsewhere(t, id)
	}
	rule := d.ruleFor(t.Type())
	if l.mustStart() {
		if done, err := d.start(ctx, t, next, &rule, l); done {
			return err
		}
	}
	if !l.mustStart() {
		rec.Locked(l.ref.FP, l.arrived)
	}
	d.count(t.Type(), evStarted)
	return d.run(ctx, t, next, &rule, l)
}

// start makes the checks of an attempt that must see its key before it
// runs (mustStart); done reports that the attempt is answered (err), else
// it runs.
func (d *Dedup) start(ctx context.Context, t *asynq.Task, next asynq.Handler, rule *resolved, l *lease) (done bool, err error) {
	switch found, err := d.lockOf(ctx, l); {
	case err != nil:
		return true, d.unlocked(ctx, "start", t, next, err)
	case !found:
		return false, nil // (a plain task whose record names no lock: a Scheduler firing's)
	}
	l.rec.Locked(l.ref.FP, l.arrived)
	st, err := d.store.Start(ctx, &store.Start{Ref: l.ref, TTL: d.ttlOf(rule), Allow: l.allows(rule), Token: l.token, Mode: l.mode})
	switch {
	case err != nil:
		return true, d.unlocked(ctx, "start", t, next, err)
	case st.Status == store.StatusElsewhere:
		l.rec.Set(attempt.Refused)
		return true, d.elsewhere(t, l.ref.ID)
	case st.Status == store.StatusAllowed:
		if !st.New {
			d.count(t.Type(), evReleased) // RunningAllow: the key was freed as the task started
		}
		return true, d.runAllowed(ctx, t, next, l.rec)
	case st.Status == store.StatusHeld && l.allows(rule) && !l.arrived && !st.HolderRuns && l.lost != store.LostReleased:
		// A task accepted at enqueue of a type that runs beside a waiting
		// task of its key: its first attempt freed the key, and another task
		// has taken it since and waits. It runs, as RunningAllow runs.
		return true, d.runAllowed(ctx, t, next, l.rec)
	case st.Status == store.StatusCooling && st.Holder == l.ref.ID:
		// It succeeded already, after asynq had given that attempt up: its
		// key cools down, and the task is not run again.
		l.rec.Set(attempt.Cooling)
		d.count(t.Type(), evCooling)
		return true, nil
	case st.Status == store.StatusCooling && l.arrived:
		l.rec.Other(attempt.BusyDropped, st.Holder)
		return true, d.cooling(t, &l.ref, st.Holder, st.Cooling, st.Failed)
	case st.Status != store.StatusTaken:
		return true, d.busy(ctx, t, rule, l, &st)
	}
	l.held = st.Value
	return false, nil
}

// storedMarks reads, for a task whose ID carries its mark (an asynq without
// task headers), the mark its stored message got while it waited
// (store.HeaderLost: written there as a header, which that asynq does not
// hand the handler): one Redis call. An error leaves it unread; the start
// check that follows meets the same Redis.
func (d *Dedup) storedMarks(ctx context.Context, l *lease) {
	if l.kind != store.IDMarked || l.lost != "" {
		return
	}
	key := store.TaskKey(l.ref.Queue, l.ref.ID)
	v, err := d.store.Do(ctx, key, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.HGet(c, key, "msg").Result()
	})
	if msg, ok := v.(string); err == nil && ok {
		l.lost = store.MessageHeaders([]byte(msg))[store.HeaderLost]
	}
}

// storedHere reports whether asynq stores queue's tasks in the Dedup's
// Redis, where their locks are: checked once per queue, with the first
// locked task the middleware runs from it (whose record exists while it
// runs). A Redis error answers yes: the check waits for the next task.
func (d *Dedup) storedHere(ctx context.Context, queue, id string) bool {
	if _, ok := d.here.Load(queue); ok {
		return true
	}
	key := store.TaskKey(queue, id)
	v, err := d.store.Do(ctx, key, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.Exists(c, key).Result()
	})
	switch n, _ := v.(int64); {
	case err != nil:
		return true
	case n == 1:
		d.here.Store(queue, true)
		return true
	}
	return false
}

// findLock learns the lock key of a plain task (its record's unique key),
// reporting false when it names none or cannot be read.
func (d *Dedup) findLock(ctx context.Context, l *lease) bool {
	found, _ := d.lockOf(ctx, l)
	return found
}

// lockOf is findLock with the read's error. It may run on the heartbeat's
// goroutine and the attempt's at once: refMu orders them (the lock, once
// known, never changes).
func (d *Dedup) lockOf(ctx context.Context, l *lease) (bool, error) {
	l.refMu.Lock()
	defer l.refMu.Unlock()
	if l.ref.Lock != "" {
		return true, nil
	}
	lock, err := d.store.LockOf(ctx, l.ref.Queue, l.ref.ID)
	if err != nil || lock == "" {
		return false, err
	}
	l.ref.Lock = lock
	_, _, l.ref.FP, _ = store.ParseLockKey(lock)
	return true, nil
}

// runAllowed runs an attempt of a RunningAllow type, which holds no lock
// while it runs; it is counted as started and processed as any other.
func (d *Dedup) runAllowed(ctx context.Context, t *asynq.Task, next asynq.Handler, rec *attempt.Attempt) error {
	rec.Set(attempt.Allowed)
	d.count(t.Type(), evStarted)
	defer d.count(t.Type(), evProcessed) // (a panic too, as run counts it)
	return next.ProcessTask(ctx, t)
}

// elsewhere refuses a task whose asynq record is not in the Dedup's Redis:
// the server runs on another Redis, where no lock could follow its tasks.
func (d *Dedup) elsewhere(t *asynq.Task, id string) error {
	if d.warnedElsewhere.CompareAndSwap(false, true) {
		d.log.Error("dedup: the asynq server running the middleware stores its tasks in another Redis than the Dedup's; its tasks are refused (ErrTasksElsewhere)", slog.String("type", t.Type()), slog.String("task_id", id))
	}
	return errorf("%w: task %s is not stored in the Dedup's Redis; run the server and the Dedup on one Redis (or one Cluster)", ErrTasksElsewhere, id)
}

// unlocked runs the handler without a lock after a Redis error, if
// fail-open allows it.
func (d *Dedup) unlocked(ctx context.Context, op string, t *asynq.Task, next asynq.Handler, err error) error {
	rec := attempt.Of(ctx)
	if d.onRedisError(ctx, op, t.Type(), err) {
		rec.Set(attempt.FailOpen)
		return next.ProcessTask(ctx, t)
	}
	rec.Set(attempt.Refused)
	return unavailable(op, err)
}

// run runs the handler under the heartbeat and settles the lock after it,
// even if it panics (the panic goes on to asynq).
func (d *Dedup) run(ctx context.Context, t *asynq.Task, next asynq.Handler, rule *resolved, l *lease) (err error) {
	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	l.cancel, l.ttl = cancel, d.ttlOf(rule)
	d.hb.add(l)
	if d.owed.watches(l) {
		d.owed.begin(l)
	}
	nctx, ncancel := d.noteBefore(ctx)
	stops := []func() bool{context.AfterFunc(nctx, func() { d.outlived(ctx, l) })}
	if d.lastAtDeadline(ctx) {
		stops = append(stops, context.AfterFunc(ctx, func() { d.archivedAtDeadline(ctx, t, rule, l) }))
	}
	panicked := true
	defer func() {
		l.ended(stops...)
		ncancel()
		live := d.hb.remove(l)
		herr := err
		if panicked {
			herr = errPanicked
		}
		d.settle(ctx, t, rule, l, herr, live)
	}()
	err = next.ProcessTask(hctx, t)
	panicked = false
	return err
}

// settle ends an attempt's hold on its key, by asynq's rule for what
// follows the attempt, making a Redis call only where the task's policy
// acts at that end (Settle). Its errors never fail the task.
func (d *Dedup) settle(ctx context.Context, t *asynq.Task, r *resolved, l *lease, err error, live bool) {
	typ := t.Type()
	d.count(typ, evProcessed)
	if l.settledEarly { // (written under mu, before ended: failNow is over)
		d.endNote(ctx, l)
		return
	}
	s := d.settleOf(ctx, t, r, l, err)
	if l.releasedTogether(s) {
		if x := d.releases.release(l, s.TTL); x != nil {
			l.rec.Settled(x.res, x.err)
			return
		}
	}
	quiet := l.watched && d.owed.end(l, l.quietable(s)) // (a RunningDefer success that owes no follow-up)
	if quiet || !l.calls(s) && !l.outlivedMark.Load() {
		// asynq's scripts release the key (success, revoke) or keep it for
		// the key's next enqueue to heal (a final failure, archived); a kept
		// key cools down after a success, as asynq's record of it says.
		if s.End == store.EndSuccess && l.flags.Has(store.FlagKept) {
			d.count(typ, evCooling)
			l.rec.Set(attempt.Cooling)
			return
		}
		d.count(typ, evReleased)
		l.rec.Set(attempt.Released)
		return
	}
	if !d.findLock(context.WithoutCancel(ctx), l) { // (asynq may have ended ctx: the settle still follows)
		l.rec.Set(attempt.Released)
		return
	}
	s.Ref, s.Note = l.ref, l.note // (l.note: written under l.mu, before l.ended)
	res, serr := d.store.Settle(context.WithoutCancel(ctx), s)
	d.report(typ, l, res, serr, live, s.Due)
	l.rec.Settled(res, serr)
}

// settleOf describes the end of an attempt as asynq sees it (processor.go):
// a revoked task is done; a SkipRetry or an error on the last retry
// archives it; any other error means a retry. Once the attempt's context
// has ended, asynq has given the attempt up (deadline, CancelProcessing, a
// lost lease) and ignores what the handler returns: it archives the task
// on its last retry, else retries it.
func (d *Dedup) settleOf(ctx context.Context, t *asynq.Task, r *resolved, l *lease, err error) *store.Settle {
	n, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	if cerr := ctx.Err(); cerr != nil {
		err = cerr
		if n >= maxRetry && errors.Is(cerr, context.DeadlineExceeded) {
			// Archived by asynq's rule; a follow-up it owes takes the key for the key's lifetime.
			return &store.Settle{End: store.EndFail, TTL: d.ttlOf(r), Err: failureText(err)}
		}
	}
	release, near := l.flags.Has(store.FlagRelease), d.nearDeadline(ctx)
	s := &store.Settle{End: store.EndSuccess, TTL: d.ttlOf(r), Release: release && !near, Loosen: near}
	switch {
	case errors.Is(err, context.Canceled) && ctx.Err() != nil && n >= maxRetry && l.calls(&store.Settle{End: store.EndFail}) && d.archived(ctx, &l.ref):
		// CancelProcessing or a lost lease on the last retry: asynq archives
		// the task; its fail hold is written, its follow-up queued.
		s.End, s.Err = store.EndFail, failureText(err)
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		// Cancelled (a shutdown that requeues the task, CancelProcessing, a
		// lost lease): asynq runs it again, or archives it without the
		// task having failed; the key is held for it either way.
		delay := d.cfg.RetryDelayFunc(n, err, t)
		s.End, s.TTL, s.Due = store.EndRetry, addLifetimes(delay, d.ttlOf(r)), lifetime(delay)
	case err == nil:
	case isRevoke(err) && ctx.Err() == nil:
		s.End = store.EndRevoke
	case n >= maxRetry || (errors.Is(err, asynq.SkipRetry) && ctx.Err() == nil):
		s.End, s.Err = store.EndFail, failureText(err)
	default:
		delay := d.cfg.RetryDelayFunc(n, err, t)
		s.End, s.TTL, s.Due = store.EndRetry, addLifetimes(delay, d.ttlOf(r)), lifetime(delay)
	}
	return s
}

// archived reports whether asynq archives a task whose handler's context
// was cancelled on its last retry, as it does after CancelProcessing or a
// lost lease, rather than putting it back: a shutdown requeues the task
// before it cancels the context, so its record is pending by then. asynq
// archives at the moment it cancels, so the record is read until it says
// either, within LockTimeout; else (unread, or active again on another
// worker) the key is held as for a retry, and the heartbeat settles it.
func (d *Dedup) archived(ctx context.Context, ref *store.Ref) bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.LockTimeout)
	defer cancel()
	for i := 0; ; i++ {
		_, _, state, found, err := d.store.StoredTask(ctx, ref.Queue, ref.ID)
		switch {
		case err == nil && found && state == store.StateArchived:
			return true
		case err != nil || !found || state != store.StateActive:
			return false
		}
		t := time.NewTimer(archiveBackoff.delay(i))
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// archiveBackoff paces archived's reads of a record asynq is archiving.
var archiveBackoff = backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}

// nearDeadline reports whether the attempt's deadline comes before a
// settle call could finish: asynq may then take the attempt as given up and
// retry it whatever the handler returned, so a release at its success is
// left to the key's next enqueue, which frees the key once asynq's record
// of the task says it is done (the lock is left as taken at start, which
// heals at once when that record is gone).
func (d *Dedup) nearDeadline(ctx context.Context) bool {
	dl, ok := ctx.Deadline()
	return ok && time.Until(dl) < d.cfg.LockTimeout
}

// report counts and logs how an attempt's key was settled.
func (d *Dedup) report(typ string, l *lease, res store.SettleResult, err error, live bool, due time.Duration) {
	id := l.ref.ID
	switch {
	case err != nil:
		d.count(typ, evRedisError)
		d.log.Warn("dedup: could not settle the lock at the end of an attempt", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", err))
	case !res.Owned:
		if live { // else the heartbeat already reported it
			d.count(typ, evLockLost)
		}
		d.log.Warn("dedup: lock was no longer this task's at the end", slog.String("type", typ), slog.String("task_id", id))
	case res.Cooling:
		d.count(typ, evCooling)
	case res.Failed:
		d.count(typ, evFailHeld)
	case res.Held:
		d.count(typ, evHeld)
		if res.Follow != "" {
			d.hb.watch(l.ref, res.Follow, due) // queued should the task not run again
		}
	default:
		d.count(typ, evReleased)
		if res.Follow != "" {
			d.log.Debug("dedup: follow-up queued", slog.String("type", typ), slog.String("task_id", res.Follow))
		}
	}
}

// attemptFor is what the middleware knows of an attempt's lock from the
// task alone, with no Redis call: nil for a task nothing locks.
func (d *Dedup) attemptFor(ctx context.Context, queue, id string, t *asynq.Task) *lease {
	typ, h := t.Type(), taskHeaders(t)
	n, _ := asynq.GetRetryCount(ctx)
	l := &lease{ref: store.Ref{Queue: queue, ID: id, Type: typ}, kind: store.KindOf(id), lost: h[store.HeaderLost], again: n > 0}
	if v, ok := h[store.HeaderLock]; ok {
		flags, lock, optedOut, valid := store.ParseLockHeader(v)
		switch {
		case optedOut:
			return nil
		case valid:
			l.flags, l.ref.Lock = flags, lock
			_, _, l.ref.FP, _ = store.ParseLockKey(lock)
			if here := store.LockIn(lock, queue); here != lock {
				// An enqueuer put the task in another queue than its lock's,
				// and a worker took it before the call could move it: it
				// meets its key in the queue it runs in, as it starts, and
				// gives it back at its end (relocate.go).
				// Its modes' terms were written in the other queue's slot:
				// the key here takes its type's rule's (a per-call option's
				// are lost), from now.
				l.ref.Lock = here
				l.flags += store.Flags([]byte{store.FlagStart, store.FlagRelease})
				l.mode = d.ruleTerms(typ, id).mode
			}
			return l
		}
		d.log.Warn("dedup: task carries a malformed lock header; treated as arriving without a lock", slog.String("type", typ), slog.String("task_id", id))
	}
	switch l.kind {
	case store.IDOptOut:
		return nil
	case store.IDMarked: // (asynq without task headers) its ID says what its header would
		flags, fp, _ := store.ParseMarkedID(id)
		l.flags, l.ref.FP, l.ref.Lock = flags, fp, d.store.Keys().Lock(queue, fp)
		return l
	case store.IDPlain, store.IDKept: // its record names its lock (LockOf)
		return l
	case store.IDFollow:
		// A follow-up of a holder that arrived without a lock carries no
		// lock header: its record names its lock (LockOf), its message does
		// not (asynq's scripts do not release it), and its type's rule gives
		// its terms.
		tm := d.ruleTerms(typ, id)
		l.flags, l.mode = tm.flags, tm.mode
		return l
	case store.IDAgain: // a busy arrival's copy: the key its original met
		fp, _ := store.ParseAgainID(id)
		l.ref.FP, l.ref.Lock = fp, d.store.Keys().Lock(queue, fp)
		return d.arrival(l, t)
	}
	return d.guard(l, t)
}

// guard keys a task that arrives without a lock by its type's rule (the
// execution-time guard), or returns nil.
func (d *Dedup) guard(l *lease, t *asynq.Task) *lease {
	typ := t.Type()
	r := d.ruleFor(typ)
	if d.cfg.NoExecutionGuard || !d.active(&r) || store.Reserved(l.ref.ID) {
		return nil
	}
	fp, err := d.fingerprintHex(typ, t.Payload(), &r)
	if err != nil {
		d.log.Warn("dedup: cannot key task at execution; running it unguarded", slog.String("type", typ), slog.String("task_id", l.ref.ID), slog.Any("error", err))
		d.count(typ, evUnguarded)
		return nil
	}
	l.ref.FP, l.ref.Lock = fp, d.store.Keys().Lock(l.ref.Queue, fp)
	return d.arrival(l, t)
}

// arrival completes the lease of a task that arrived without a lock: it
// takes one at start by its type's rule, which its end gives back.
func (d *Dedup) arrival(l *lease, t *asynq.Task) *lease {
	tm := d.ruleTerms(t.Type(), l.ref.ID)
	l.arrived, l.flags, l.mode, l.token = true, tm.flags, tm.mode, strconv.FormatUint(uint64(mrand.Uint32()), 36)
	return l
}

// ruleTerms are the terms of a key task id takes now, at the server, by
// its type's rule alone; its record does not name the lock, so its end
// releases it.
func (d *Dedup) ruleTerms(typ, id string) terms {
	r := d.ruleFor(typ)
	return termsOf(&r, typ, id, time.Now(), true, false)
}

// noteBefore returns ctx ending LockTimeout before ctx's deadline, when
// the outlived note must be written: asynq archives or retries the task at
// its deadline without waiting for the handler, and an enqueue landing
// between that and a note written only then would heal the key under a
// handler that still runs, or before its failure's hold is written.
func (d *Dedup) noteBefore(ctx context.Context) (context.Context, context.CancelFunc) {
	if dl, ok := ctx.Deadline(); ok {
		return context.WithDeadline(ctx, dl.Add(-d.cfg.LockTimeout))
	}
	return ctx, func() {}
}

// outlived notes in the key's mode record that asynq may give the attempt
// up (its deadline comes within LockTimeout) or gave it up (its context
// ended) while its handler still runs: asynq may archive or retry the task
// meanwhile, and the key must not heal under the handler (lua/extend.lua).
// Called at most once, from context.AfterFunc.
func (d *Dedup) outlived(ctx context.Context, l *lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.returned {
		return
	}
	bg := context.WithoutCancel(ctx)
	if !d.findLock(bg, l) {
		return
	}
	l.note = rand.Text()
	r := d.store.ExtendAll(bg, []*store.Extend{{Ref: l.ref, TTL: l.ttl, Outlived: d.hb.noteLife(), Note: l.note}})[0]
	if r.Err != nil {
		d.count(l.ref.Type, evRedisError)
		d.log.Warn("dedup: could not note a handler asynq gave up; its key may heal while it runs", slog.String("task_id", l.ref.ID), slog.Any("error", r.Err))
		return
	}
	l.outlivedMark.Store(r.Owned)
}

// lastAtDeadline reports whether asynq archives the attempt should its
// deadline pass while the handler runs: its last retry, with a deadline.
func (d *Dedup) lastAtDeadline(ctx context.Context) bool {
	n, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	_, ok := ctx.Deadline()
	return ok && n >= maxRetry
}

// archivedAtDeadline acts as asynq archives a last retry at its deadline
// while its handler runs on (called once, from context.AfterFunc): a fail
// hold is written (failNow); and asynq's archive writes the task's record
// anew, without the mark the note put there, so it is marked again as soon
// as asynq has archived it (not at the next beat): a run of it by hand
// meets its key busy behind the handler rather than running beside it.
func (d *Dedup) archivedAtDeadline(ctx context.Context, t *asynq.Task, r *resolved, l *lease) {
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return
	}
	if l.flags.Has(store.FlagFail) && !l.flags.Has(store.FlagDefer) { // (a follow-up owed waits for the handler)
		d.failNow(ctx, t, r, l)
	}
	if l.outlivedMark.Load() && d.archived(ctx, &l.ref) {
		d.hb.check(l, d.hb.renewNote(context.WithoutCancel(ctx), l))
	}
}

// failNow writes the final failure of an attempt that asynq gave up at its
// deadline on its last retry while its handler still runs (once, from
// archivedAtDeadline): asynq archives the task then without waiting
// for the handler, and a hold written only at its return would be lost if
// the worker stopped meanwhile (a stuck handler, then a kill). It acts only
// under the note that the handler runs on (outlived), which its return
// ends (endNote); the heartbeat then renews that note without lengthening
// the hold.
func (d *Dedup) failNow(ctx context.Context, t *asynq.Task, r *resolved, l *lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.returned || !l.outlivedMark.Load() {
		return
	}
	s := d.settleOf(ctx, t, r, l, ctx.Err())
	s.Ref = l.ref // (no Note: it stays while the handler runs)
	res, err := d.store.Settle(context.WithoutCancel(ctx), s)
	d.report(t.Type(), l, res, err, true, s.Due)
	l.rec.Settled(res, err)
	l.settledEarly = err == nil
}

// endNote ends the note of an attempt whose end failNow settled, now that
// its handler returned.
func (d *Dedup) endNote(ctx context.Context, l *lease) {
	_, err := d.store.Settle(context.WithoutCancel(ctx), &store.Settle{Ref: l.ref, End: store.EndNote, Note: l.note})
	if err != nil {
		d.count(l.ref.Type, evRedisError)
		d.log.Warn("dedup: could not end the note that a handler asynq gave up runs on; it lapses", slog.String("task_id", l.ref.ID), slog.Any("error", err))
	}
}

// ended records that the attempt's handler returned, after an outlived
// note (or a failNow) that was under way.
func (l *lease) ended(stops ...func() bool) {
	for _, stop := range stops {
		stop()
	}
	l.mu.Lock()
	l.returned = true
	l.mu.Unlock()
}

// lease is one attempt the middleware runs under a lock.
type lease struct {
	ref     store.Ref // Lock "" for a plain task until findLock reads it
	kind    store.IDKind
	flags   store.Flags // what the task's policy does at start and end (modes.go)
	mode    []any       // a task that arrived without a lock: the mode record of the key it takes
	arrived bool        // arrived without a lock: the execution-time guard keyed it
	token   string      // an arrival's: in the lock it takes as it starts (store.StartValue)
	held    string      // the lock's value after the start call (its start made one)
	again   bool        // asynq runs the task again (retried before)
	lost    string      // the task lost its key while it waited (store.HeaderLost)
	ttl     time.Duration
	cancel  context.CancelCauseFunc
	rec     *attempt.Attempt // what the middleware did, for a wrapper (attempt.With); nil: not asked

	refMu        sync.Mutex  // orders lockOf's write of ref.Lock and ref.FP
	mu           sync.Mutex  // guards returned and settledEarly (outlived and failNow run on goroutines of their own)
	returned     bool        // the handler returned
	settledEarly bool        // failNow settled the attempt's end while its handler ran on (guarded by mu)
	note         string      // the attempt's token in the key's note that its handler outlived it (written by outlived; read once returned)
	outlivedMark atomic.Bool // the mode record notes the handler outlived its attempt (the heartbeat renews it): its end clears it

	watched  bool   // the owed signal watches it (owed.go): its success may make no call
	owedSure bool   // the owed subscription was up as the handler started
	owedGen  uint64 // its generation then
}

// mustStart reports whether the attempt checks its key before it runs.
func (l *lease) mustStart() bool {
	return l.arrived || l.again || l.lost != "" || l.kind == store.IDFollow || l.kind == store.IDKept ||
		l.flags.Has(store.FlagStart) || l.flags.Has(store.FlagAllow)
}

// allows reports whether the task runs without its lock (RunningAllow):
// the producer's flag, or the server's rule for a task that arrived
// without a lock.
func (l *lease) allows(r *resolved) bool {
	return l.flags.Has(store.FlagAllow) || (l.arrived && r.running == RunningAllow)
}

// calls reports whether an attempt that ended so settles its key with a
// Redis call: only where the task's policy acts at that end, or for a
// retry (the key is held for it).
func (l *lease) calls(s *store.Settle) bool {
	f := l.flags
	switch s.End {
	case store.EndSuccess:
		return f.Has(store.FlagCool) || f.Has(store.FlagDefer) || f.Has(store.FlagRelease)
	case store.EndRevoke: // (a kept key: released now; asynq's done would leave it to heal at the next enqueue)
		return f.Has(store.FlagDefer) || f.Has(store.FlagRelease) || f.Has(store.FlagKept)
	case store.EndFail:
		return f.Has(store.FlagFail) || f.Has(store.FlagDefer)
	}
	return true
}

// quietable reports whether an attempt that ended so calls only to learn
// whether it owes a follow-up (RunningDefer), which the owed signal may
// answer: a success not near its deadline, whose handler asynq did not
// give up.
func (l *lease) quietable(s *store.Settle) bool {
	return s.End == store.EndSuccess && !s.Loosen && !s.Release && !l.outlivedMark.Load()
}

func (l *lease) String() string { return fmt.Sprintf("%s@%s:%s", l.ref.ID, l.ref.Queue, l.ref.FP) }
