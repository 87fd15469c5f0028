package dedup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// errPanicked stands for a handler that panicked while its lock's fate is
// decided; the panic itself goes on to asynq unchanged.
var errPanicked = errors.New("dedup: handler panicked")

// Middleware returns the server middleware: mux.Use(d.Middleware()).
//
// For every attempt it finds the task's lock from the task ID (or, for a
// caller-chosen ID, from the index the wrapper wrote), makes the attempt its
// running owner under a fresh token, renews it every Lease/3 while the
// handler runs, and then:
//
//	success, asynq.RevokeTask          release
//	asynq.SkipRetry, retries exhausted release (the task is archived)
//	any other error, a panic           hold for RetryDelayFunc(n) + TTL
//
// Once the attempt's context has ended (Timeout or Deadline, CancelProcessing,
// a lost lease, shutdown), asynq ignores what the handler returns and moves
// the task on by itself; the lock then follows the task's record: held
// while asynq will run it again (retry, requeued), released when it is
// archived, and, while asynq has not written its decision yet, settled by
// asynq's rule for that error.
//
// A task of a RunningAllow type holds no lock while it runs: once accepted
// at enqueue, it runs beside a task that took its key since (a retry,
// after its first attempt freed the key) while that task waits; behind a
// running one it is retried. A task locked at enqueue is never dropped for
// a cooling key: it is retried until the cooldown ends.
//
// A task that arrives without a lock (asynq.Scheduler, another service, the
// CLI) takes one when it starts, keyed by its type's rule; if another live
// task holds that key it does not run now: it returns a *BusyError (retried
// later; see IsFailure) or, with Config.SkipBusy, nil. On its last attempt,
// where asynq would archive it, a copy of it (same message, new ID) is
// scheduled one Lease later instead and the attempt returns nil.
//
// A release goes out just after the handler returns, with the others of
// that moment (within a few milliseconds: releaser.go); until it
// lands the key reads as held by a task asynq completed, which the next
// enqueue takes over at once. If asynq's own last step fails, asynq runs
// the task again while a duplicate may have been accepted.
func (d *Dedup) Middleware() asynq.MiddlewareFunc {
	d.hb.run()
	d.rel.run()
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return d.process(ctx, t, next)
		})
	}
}

func (d *Dedup) process(ctx context.Context, t *asynq.Task, next asynq.Handler) (err error) {
	id, ok1 := asynq.GetTaskID(ctx)
	queue, ok2 := asynq.GetQueueName(ctx)
	if !ok1 || !ok2 {
		return next.ProcessTask(ctx, t) // not run by an asynq server
	}
	ref, rst, guarded, err := d.resolve(ctx, queue, id, t)
	if err != nil {
		return d.unlocked(ctx, "resolve", t, next, err)
	}
	rec := attemptOf(ctx) // nil unless a wrapper asked (WithAttempt)
	if ref == nil {
		rec.set(AttemptNotLocked)
		return next.ProcessTask(ctx, t)
	}
	rule := d.ruleFor(t.Type())
	l := &lease{ref: *ref, st: rst, token: store.NewToken(), arrived: guarded, rec: rec}
	rec.locked(l)
	st, err := d.startAttempt(ctx, l, &rule)
	switch {
	case err != nil:
		d.startUnknown(ctx, t, &rule, l, err)
		return d.unlocked(ctx, "start", t, next, err)
	case st.Status == store.StatusElsewhere:
		rec.set(AttemptRefused)
		return d.elsewhere(t, id)
	case st.Status == store.StatusAllowed:
		if !st.New {
			d.count(t.Type(), evReleased) // RunningAllow: the key was freed as the task started
		}
		return d.runAllowed(ctx, t, next, rec)
	case rule.running == RunningAllow && !guarded && st.Status == store.StatusHeld && !st.HolderRuns && !st.Released:
		// A task accepted at enqueue of a type that runs beside a waiting
		// task of its key: its first attempt freed the key (or its lock
		// lapsed while it waited), and another task has taken it since and
		// waits. It runs, as RunningAllow runs, without the lock.
		return d.runAllowed(ctx, t, next, rec)
	case st.Status == store.StatusCooling && guarded:
		rec.other(AttemptBusyDropped, st.Holder)
		return d.cooling(t, &l.ref, st.Holder, st.Cooling, st.Failed)
	case st.Status == store.StatusSuperseded:
		rec.other(AttemptSuperseded, st.Holder)
		d.count(t.Type(), evSuperseded)
		d.log.Info("dedup: not run: the task lost its lock and its follow-up carries a newer payload", slog.String("type", t.Type()), slog.String("task_id", id), slog.String("follow_up", st.Holder))
		return nil
	case st.Status != store.StatusTaken:
		return d.busy(ctx, t, &rule, l, &st)
	}
	d.count(t.Type(), evStarted)
	l.follow, l.begun, l.cools = st.Follow, st.Begun, st.Cools
	return d.run(ctx, t, next, &rule, l)
}

// runAllowed runs an attempt of a RunningAllow type, which holds no lock
// while it runs; it is counted as started and processed as any other.
func (d *Dedup) runAllowed(ctx context.Context, t *asynq.Task, next asynq.Handler, rec *Attempt) error {
	rec.set(AttemptAllowed)
	d.count(t.Type(), evStarted)
	defer d.count(t.Type(), evProcessed) // (a panic too, as run counts it)
	return next.ProcessTask(ctx, t)
}

// startAttempt makes the attempt its lock's running owner. A task the wrapper
// locked at enqueue whose lock is not there under the Dedup's prefix may
// have been locked under another (prefix.go): the lock the attempt just
// made is given back, and the attempt takes the producer's.
func (d *Dedup) startAttempt(ctx context.Context, l *lease, rule *resolved) (store.StartResult, error) {
	cool, window := rule.lockTerms(time.Now())
	s := &store.Start{Ref: l.ref, Token: l.token, Lease: d.cfg.Lease, Running: rule.running.code(), Cooldown: cool, FailHold: rule.failHold, Window: window}
	if l.arrived {
		s.KeyForm = keyForm(rule) // the key is the server's rule's; else the producer's, of a form unknown here
	}
	res, err := l.st.Start(ctx, s)
	if err != nil || res.Status != store.StatusTaken || !res.New || l.st != d.store {
		return res, err
	}
	if _, locked := store.ParseLockedID(l.ref.ID); !locked {
		return res, nil
	}
	other, _ := d.foreignStore(ctx, &l.ref)
	if other == nil {
		return res, nil
	}
	if _, err := l.st.Finish(ctx, &store.Finish{Ref: l.ref, Token: l.token, Release: true}); err != nil {
		d.log.Warn("dedup: could not give back a lock made under the server's own prefix; it expires within one lease", slog.String("task_id", l.ref.ID), slog.Any("error", err))
	}
	l.st = other
	return other.Start(ctx, s)
}

// startUnknown settles, at the next heartbeats, an attempt whose start
// failed: its call may still have landed (a stalled Redis, the attempt's
// context ended while it was out), leaving the lock under the attempt's
// token with one Lease to live. Settled as given up, the task's record
// decides: held for asynq's retry, released if asynq archived it (a token
// that never landed matches nothing).
func (d *Dedup) startUnknown(ctx context.Context, t *asynq.Task, r *resolved, l *lease, err error) {
	f := d.finishOf(ctx, t, r, l, err)
	f.GivenUp = true
	d.hb.retry(l.st, f)
}

// elsewhere refuses a task whose asynq record is not in the Dedup's Redis:
// the server runs on another Redis, where no lock could follow its tasks.
func (d *Dedup) elsewhere(t *asynq.Task, id string) error {
	if d.warnedElsewhere.CompareAndSwap(false, true) {
		d.log.Error("dedup: the asynq server running the middleware stores its tasks in another Redis than the Dedup's; its tasks are refused (ErrTasksElsewhere)", slog.String("type", t.Type()), slog.String("task_id", id))
	}
	return fmt.Errorf("%w: task %s is not stored in the Dedup's Redis; run the server and the Dedup on one Redis (or one Cluster)", ErrTasksElsewhere, id)
}

// unlocked runs the handler without a lock after a Redis error, if
// fail-open allows it.
func (d *Dedup) unlocked(ctx context.Context, op string, t *asynq.Task, next asynq.Handler, err error) error {
	rec := attemptOf(ctx)
	if d.onRedisError(ctx, op, t.Type(), err) {
		rec.set(AttemptFailOpen)
		return next.ProcessTask(ctx, t)
	}
	rec.set(AttemptRefused)
	return unavailable(op, err)
}

// run runs the handler under the heartbeat and settles the lock after it,
// even if it panics (the panic goes on to asynq).
func (d *Dedup) run(ctx context.Context, t *asynq.Task, next asynq.Handler, rule *resolved, l *lease) (err error) {
	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	l.cancel = cancel
	d.hb.add(l)
	panicked := true
	defer func() {
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

// settle releases the lock or holds it for the task's next run, by asynq's
// rules for what follows the attempt. Its errors never fail the task.
func (d *Dedup) settle(ctx context.Context, t *asynq.Task, r *resolved, l *lease, err error, live bool) {
	d.count(t.Type(), evProcessed)
	f := d.finishOf(ctx, t, r, l, err)
	// A release is batched off the handler's path, unless a wrapper asked
	// what became of the lock (WithAttempt): a follow-up queued by the
	// release is known only once it has landed.
	if f.Release && !f.GivenUp && f.Follow == "" && f.Failure == "" && !l.cools && !l.ref.Indexed && l.st == d.store && l.rec == nil {
		d.rel.add(release{f: *f, live: live}) // off the handler's path (releaser.go)
		return
	}
	res, ferr := l.st.Finish(context.WithoutCancel(ctx), f)
	d.report(l.st, f, res, ferr, live)
	l.rec.settled(res, ferr)
}

// report counts and logs how an attempt's lock was settled (f, by st),
// and queues what the heartbeat must check again.
func (d *Dedup) report(st *store.Store, f *store.Finish, res store.FinishResult, ferr error, live bool) {
	typ, id := f.Ref.Type, f.Ref.ID
	switch {
	case ferr != nil:
		d.count(typ, evRedisError)
		d.hb.retry(st, f)
		d.log.Warn("dedup: could not settle lock; tried again at the next heartbeats, else it expires within one lease", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", ferr))
	case !res.Owned:
		if live { // else the heartbeat already reported it
			d.count(typ, evLockLost)
		}
		d.log.Warn("dedup: lock was no longer this attempt's at the end", slog.String("type", typ), slog.String("task_id", id))
	case res.Cooling:
		d.count(typ, evCooling)
	case res.Failed:
		d.count(typ, evFailureHeld)
	case res.Held:
		if !res.Guessed || !f.Release || f.Failure == "" || f.GivenUp {
			d.count(typ, evHeld) // (a final failure held on a guess is counted once its recheck knows)
		}
		switch {
		case res.Guessed:
			d.hb.recheck(st, f) // asynq had not decided yet: read its record again shortly
		case res.Owes != "":
			d.hb.watch(st, f, res.Owes) // queue the follow-up at once should the task never run again
		}
	default:
		d.count(typ, evReleased)
		if res.Follow != "" {
			d.log.Debug("dedup: follow-up released", slog.String("type", typ), slog.String("task_id", res.Follow))
		}
	}
}

// finishOf describes the end of an attempt as asynq sees it (processor.go):
// a revoked task is done; a SkipRetry or an error on the last retry
// archives it; any other error means a retry. Once the attempt's context
// has ended, asynq has given the attempt up (deadline, CancelProcessing, a
// lost lease, shutdown) and ignores what the handler returns: it retries,
// archives or requeues the task by itself, and its record decides.
//
// A deadline closer than LockTimeout may pass while the settle call is on
// its way, before asynq hears the handler's result; asynq then takes the
// deadline instead. Such an attempt is settled as given up too: at worst a
// task that did complete keeps its key until the next heartbeat finds it
// completed (and then cools down if it has a Cooldown: Succeeded says the
// handler returned nil), never a retried task without its lock.
func (d *Dedup) finishOf(ctx context.Context, t *asynq.Task, r *resolved, l *lease, err error) *store.Finish {
	f := &store.Finish{Ref: l.ref, Token: l.token, Release: true, FollowTTL: d.ttlOf(r), Follow: l.follow, Succeeded: err == nil, Begun: l.begun}
	if cerr := ctx.Err(); cerr != nil {
		f.GivenUp = true
		err = cerr
	} else if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d.cfg.LockTimeout {
		f.GivenUp = true
		err = context.DeadlineExceeded
	}
	if err == nil || errors.Is(err, asynq.RevokeTask) {
		return f
	}
	n, _ := asynq.GetRetryCount(ctx)
	max, _ := asynq.GetMaxRetry(ctx)
	// The hold is needed for a retry, for a task shutdown put back
	// (finish learns that from the record, whatever the count), and for a
	// final failure whose lock holds the key until asynq's record says so.
	f.Hold = addLifetimes(d.cfg.RetryDelayFunc(n, err, t), d.ttlOf(r))
	f.Release = n >= max || errors.Is(err, asynq.SkipRetry)
	f.Failure = failureText(err) // (used by a release: asynq archives the task)
	return f
}

// resolve finds the lock of the task being run, and the Store of the
// prefix it is under; nil for none. guarded reports a task that arrived
// without a lock (the execution-time guard keys it by its type's rule), or
// a copy of one that met a busy key on its last attempt (the copy of a
// task locked at enqueue keeps that standing).
func (d *Dedup) resolve(ctx context.Context, queue, id string, t *asynq.Task) (ref *store.Ref, st *store.Store, guarded bool, err error) {
	typ := t.Type()
	if fp, ok := store.ParseLockedID(id); ok {
		return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ}, d.store, false, nil
	}
	if fp, ok := store.ParseAgainID(id); ok { // a busy arrival's copy: the key its original met
		return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ}, d.store, true, nil
	}
	if fp, ok := store.ParseKeptID(id); ok { // the copy of a busy task locked at enqueue
		return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ}, d.store, false, nil
	}
	if store.IsOptOutID(id) {
		return nil, nil, false, nil
	}
	// A caller-chosen ID: the wrapper left an index to its lock.
	fp, found, err := d.store.IndexOf(ctx, queue, id)
	switch {
	case err != nil:
		return nil, nil, false, err
	case found && fp == store.OptOutMark:
		return nil, nil, false, nil // enqueued with Skip under a caller-chosen ID
	case found:
		return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ, Indexed: true}, d.store, false, nil
	}
	ref = &store.Ref{Queue: queue, ID: id, Type: typ, Indexed: true}
	switch other, optOut := d.foreignStore(ctx, ref); { // indexed under a producer's other prefix
	case optOut:
		return nil, nil, false, nil
	case other != nil:
		return ref, other, false, nil
	}
	return d.guardRef(queue, id, t), d.store, true, nil
}

// guardRef is the lock the execution-time guard takes for a task that
// arrives without one (asynq.Scheduler, other services), or nil.
func (d *Dedup) guardRef(queue, id string, t *asynq.Task) *store.Ref {
	typ := t.Type()
	r := d.ruleFor(typ)
	if d.cfg.NoExecutionGuard || !d.active(&r) {
		return nil
	}
	fp, err := d.fingerprintHex(typ, t.Payload(), &r)
	if err != nil {
		d.log.Warn("dedup: cannot key task at execution; running it unguarded", slog.String("type", typ), slog.String("task_id", id), slog.Any("error", err))
		d.count(typ, evUnguarded)
		return nil
	}
	return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ}
}

// lease is one running attempt registered with the heartbeat.
type lease struct {
	ref     store.Ref
	st      *store.Store // of the prefix its lock is under: the Dedup's, unless prefix.go found another
	arrived bool         // the task arrived without a lock (the execution-time guard keyed it)
	token   string
	follow  string // the follow-up its lock owed when it started
	begun   bool   // started by the begin script: its lock held nothing else then
	cools   bool   // its lock has a cooldown (the producer's, perhaps): a success settles on the handler's path
	cancel  context.CancelCauseFunc
	rec     *Attempt // what the middleware did, for a wrapper (WithAttempt); nil: not asked
}

func (l *lease) String() string { return fmt.Sprintf("%s@%s:%s", l.ref.ID, l.ref.Queue, l.ref.FP) }
