package dedup

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/asynq-dedup/dedup/internal/attempt"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Busy says what the middleware does with a task that arrives without a
// lock (asynq.Scheduler, another service, the CLI) and finds its key held
// by another live task.
type Busy int

const (
	// BusyRetry returns a *BusyError, so asynq runs the task again later;
	// with IsFailure in asynq.Config that uses up no retry. On its last
	// attempt, where asynq would archive it whatever the error, a copy is
	// scheduled a little later instead (three heartbeats, 30 s by
	// default). Default (unless Config.SkipBusy).
	BusyRetry Busy = iota
	// BusyDrop drops the task: the middleware returns nil (asynq marks it
	// done), counts it (busy) and tells Config.OnDecision (Dropped). It
	// never reaches asynq's ErrorHandler.
	BusyDrop
	// BusyFold folds the task's payload into the holder, as an enqueue with
	// Replace and RunningDefer would: into the waiting holder, or into the
	// running holder's follow-up when the holder's lock defers. The arrival
	// then returns nil; its own asynq options are not carried over (the
	// holder's are). A type with a Cooldown or Debounce folds into a waiting
	// holder only (a Debounce moves its due time, as an enqueue would).
	// Where it cannot fold (another type holds a shared key, the running
	// holder's lock does not defer, the key cools down) it is retried as
	// with BusyRetry (or dropped at a cooling key).
	BusyFold
)

func (b Busy) String() string {
	switch b {
	case BusyRetry:
		return "retry"
	case BusyDrop:
		return "drop"
	case BusyFold:
		return "fold"
	}
	return fmt.Sprintf("Busy(%d)", int(b))
}

// busyPolicy is the rule's Busy, with Config.SkipBusy turning the default
// into BusyDrop.
func (d *Dedup) busyPolicy(r *resolved) Busy {
	if r.busy == BusyRetry && d.cfg.SkipBusy {
		return BusyDrop
	}
	return r.busy
}

// busy answers a task whose key another live task holds. A task that
// arrived without a lock (or its last-attempt copy) meets its type's Busy
// policy. A task locked at enqueue is never dropped or folded: its payload
// may be the newest (a fail-open enqueue, a lock that expired, a relocated
// task a worker took first) or carry work of its own; it is retried, to
// run when the key is free — the key's own follow-up run early by an
// operator too, so it runs after the holder. But one whose lock an
// operator released (Release, dedupctl release) and that meets a task of
// its type which took the key since is, as to its payload, older than the
// holder's: of a Replace type it is superseded (not run: the holder
// carries the newer payload); of a Merge type its type's policy applies
// but for dropping (its units are its own); of a Reject type its type's
// policy applies, as to an arrival. And a task busy behind a handler of
// its own that asynq gave up is retried, whatever the policy.
func (d *Dedup) busy(ctx context.Context, t *asynq.Task, r *resolved, l *lease, st *store.StartResult) error {
	holder := st.Holder
	policy := d.busyPolicy(r)
	switch released := l.lost == store.LostReleased && d.sameType(ctx, &l.ref, holder); {
	case holder == l.ref.ID:
		// Busy behind a handler of its own attempt that asynq gave up, which
		// still runs and does the work: dropping it would lose the work should
		// that handler fail, and folding it would owe the key a second run.
		policy = BusyRetry
	case l.arrived:
	case released && r.conflict == Replace:
		return d.superseded(t, l, holder)
	case released && r.conflict == Merge && policy == BusyDrop:
		policy = BusyRetry
	case !released:
		policy = BusyRetry
	}
	d.count(t.Type(), evBusy)
	dec := Decision{Event: eventNames[evBusy], Type: t.Type(), Queue: l.ref.Queue, Key: d.lockKey(&l.ref), TaskID: holder}
	switch policy {
	case BusyDrop:
		l.rec.Other(attempt.BusyDropped, holder)
		dec.Dropped = true
		d.decide(dec)
		d.log.Info("dedup: dropped task, key held by another task", slog.String("type", t.Type()), slog.String("task_id", l.ref.ID), slog.String("holder", holder))
		return nil
	case BusyFold:
		if res, ok := d.foldBusy(ctx, t, &l.ref); ok {
			l.rec.Other(attempt.BusyFolded, res.TaskID)
			dec.TaskID, dec.FollowUp = res.TaskID, res.FollowUp
			d.decide(dec)
			d.log.Info("dedup: busy task folded into the key's task", slog.String("type", t.Type()), slog.String("task_id", l.ref.ID), slog.String("into", res.TaskID), slog.String("outcome", res.Outcome.String()))
			return nil
		}
	}
	d.decide(dec)
	l.rec.Other(attempt.BusyRetried, holder)
	return d.retryBusy(ctx, t, l, holder)
}

// sameType reports whether the holder of ref's key is of ref's type (a
// shared key holds tasks of several types), reading its asynq record.
func (d *Dedup) sameType(ctx context.Context, ref *store.Ref, holder string) bool {
	typ, _, _, found, err := d.store.StoredTask(ctx, ref.Queue, holder)
	return err == nil && found && typ == ref.Type
}

// superseded answers a task whose lock an operator released, meeting a
// task of its type that took the key since: it does not run.
func (d *Dedup) superseded(t *asynq.Task, l *lease, holder string) error {
	l.rec.Other(attempt.Superseded, holder)
	d.count(t.Type(), evSuperseded)
	d.log.Info("dedup: not run: an operator released the task's lock, and a task of its type took the key since", slog.String("type", t.Type()), slog.String("task_id", l.ref.ID), slog.String("holder", holder))
	return nil
}

// foldBusy enqueues the busy task's payload through the Dedup's own client
// with Replace and RunningDefer; ok reports that it now lives in a task
// (folded, or created because the key came free meanwhile).
func (d *Dedup) foldBusy(ctx context.Context, t *asynq.Task, key *store.Ref) (Result, bool) {
	d.foldOnce.Do(func() { d.folder = d.NewClient() })
	res, err := d.folder.Submit(ctx, asynq.NewTask(t.Type(), t.Payload()), asynq.Queue(key.Queue), foldBusyOption(key.FP))
	if err != nil {
		d.log.Info("dedup: busy task could not be folded; retried later", slog.String("type", t.Type()), slog.Any("error", err))
		return Result{}, false
	}
	return res, true
}

// foldBusyOption makes a call on the key fp (the one the arrival met,
// whatever its own rule or options would give) Replace into a waiting
// holder (Merge with a Merge rule) and defer behind a running one,
// quietly: the busy decision speaks for it. A type with a Cooldown or a
// Debounce keeps its running policy (neither allows RunningDefer), so its
// arrival folds into a waiting holder only, and is retried behind a
// running one.
func foldBusyOption(fp string) option {
	return option{desc: "fold busy", apply: func(r *resolved) error {
		if r.conflict != Merge {
			r.conflict = Replace
		}
		if r.cooldown == 0 && r.debounce == 0 {
			r.running = RunningDefer
		}
		r.fixedFP, r.quiet, r.skip = fp, true, false
		return nil
	}}
}

// retryBusy returns the BusyError that has asynq retry the task later. On
// its last attempt asynq would archive it whatever the error, so a copy of
// it is scheduled instead, due after copyDelay, and this attempt succeeds.
func (d *Dedup) retryBusy(ctx context.Context, t *asynq.Task, l *lease, holder string) error {
	berr := &BusyError{TaskID: l.ref.ID, Holder: holder, Key: d.lockKey(&l.ref)}
	n, _ := asynq.GetRetryCount(ctx)
	max, _ := asynq.GetMaxRetry(ctx)
	if n < max || holder == l.ref.ID {
		// (Busy behind a handler of its own attempt that asynq gave up, which
		// still runs: that handler holds the key and does the work; a copy
		// would wait as a second task of the key. asynq archives this one.)
		return berr
	}
	id := store.NewAgainID(l.ref.FP)
	switch {
	case l.kind == store.IDMarked:
		id = store.NewMarkedID(l.flags, l.ref.FP) // (no task headers: the ID carries the mark)
	case !l.arrived:
		id = store.NewKeptID() // its copy keeps its standing
	}
	ok, err := d.store.Again(ctx, &l.ref, id, time.Now().Add(d.copyDelay()))
	if err != nil || !ok {
		d.log.Warn("dedup: busy task on its last attempt could not be scheduled again; asynq archives it", slog.String("type", t.Type()), slog.String("task_id", l.ref.ID), slog.Any("error", err))
		return berr
	}
	d.log.Info("dedup: busy task on its last attempt scheduled again as a copy", slog.String("type", t.Type()), slog.String("task_id", l.ref.ID), slog.String("copy", id), slog.String("holder", holder))
	return nil
}

// copyDelay is how long after a busy task's last attempt its copy comes
// due: three heartbeats (30 s by default).
func (d *Dedup) copyDelay() time.Duration { return 3 * d.cfg.heartbeat }
