package dedup

import (
	"context"
	"errors"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// KeyLock is the lock of one key, as Dedup.Lookup reads it: BullMQ's
// getDeduplicationJobId, with the holder's state.
type KeyLock struct {
	Key      string        // the lock key (prefix, queue, fingerprint)
	Queue    string        // the queue it lives in
	Holder   string        // the task holding the key
	FollowUp string        // the follow-up task owed to the key (RunningDefer), "" for none
	State    string        // "waiting", "running", "retry-wait", "cooling" (its task succeeded; Cooldown, Period), "failed" (its task failed for good; OnFailure) or "orphaned" (its task is gone; it heals)
	TTL      time.Duration // left before the lock expires; negative: no expiry (held until released)
	Folds    int64         // enqueues folded into the key
	// LastError: State "failed", the holder's last error.
	LastError string
	// Window: a period key (Period), the wall-clock window it belongs to,
	// [WindowStart, WindowEnd); zero otherwise.
	WindowStart, WindowEnd time.Time
}

// ErrNotHolder reports a Release whose expected holder no longer holds
// the key; nothing was released.
var ErrNotHolder = errors.New("dedup: the key is held by another task")

// lockKeyOf computes the lock key a task would take when enqueued with
// opts (its type's rule, the options' key choice and asynq.Queue), as
// Client.Submit does.
func (d *Dedup) lockKeyOf(task *asynq.Task, opts []asynq.Option) (store.Ref, error) {
	var k call
	if err := (&Client{d: d}).compose(&k, task, opts); err != nil {
		return store.Ref{}, err
	}
	if !d.active(&k.rule) {
		return store.Ref{}, errorf("%w: deduplication is off for this task (Skip, or OptIn without a rule)", ErrInvalidOption)
	}
	fp, err := d.fingerprintHex(k.typ, task.Payload(), &k.rule)
	if err != nil {
		return store.Ref{}, err
	}
	return store.Ref{Queue: k.queue, FP: fp, Type: k.typ, Lock: d.store.Keys().Lock(k.queue, fp)}, nil
}

// queueOf returns the queue an enqueue of task with opts would use, as
// Client.Submit chooses it: the call's asynq.Queue, else the one given to
// asynq.NewTask, else the one tasks of its type last landed in, else
// "default" (also for a task or options Submit would refuse).
func (d *Dedup) queueOf(task *asynq.Task, opts ...asynq.Option) string {
	var k call
	if task == nil || (&Client{d: d}).compose(&k, task, opts) != nil || k.queue == "" {
		return "default"
	}
	return k.queue
}

// Lookup reads the lock the task would take if enqueued with opts (the
// same key choice and queue as an enqueue: its type's rule, per-call key
// options, asynq.Queue): found is false when the key is free. It reads
// Redis only (two round trips), bounded by Config.LockTimeout.
func (d *Dedup) Lookup(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (lock KeyLock, found bool, err error) {
	l, err := d.readKeyLock(ctx, task, opts)
	if err != nil || l == nil {
		return KeyLock{}, false, err
	}
	kl := KeyLock{Key: l.Key, Queue: l.Queue, Holder: l.Owner, FollowUp: l.Follow, State: l.State(), TTL: l.TTL, Folds: l.Folds,
		LastError: l.Fields[store.FieldError]}
	w := l.Window()
	kl.WindowStart, kl.WindowEnd = w.Start, w.End
	return kl, true, nil
}

// Release frees the key the task would take if enqueued with opts:
// BullMQ's removeDeduplicationKey. With holder set, only if that task
// still holds it (else ErrNotHolder); with holder "", whoever holds it
// (forced: in one step, so a key that changes hands meanwhile is released
// all the same). It deletes the lock with its MaxPending entry, never a
// task: the holder, if alive, still runs; if it still waits, it is marked,
// so that when it runs it checks the key first (and gives way to a task of
// its type that took the key since). A follow-up the key owes that waits
// is queued now, even while the holder runs (its payload is the newest).
// Held keys are released too: a cooldown, a fail hold. It reports
// whether a lock was released (false: the key was free).
func (d *Dedup) Release(ctx context.Context, task *asynq.Task, holder string, opts ...asynq.Option) (bool, error) {
	rel := &store.Release{How: store.ReleaseHolder, Holder: holder, Grace: d.cfg.healGrace}
	if holder == "" {
		rel.How = store.ReleaseForce
	}
	ref, err := d.lockKeyOf(task, opts)
	if err != nil {
		return false, err
	}
	rel.Lock, rel.Queue, rel.Type = ref.Lock, ref.Queue, ref.Type
	// (Through the store, as every lock call: bounded by LockTimeout, ended
	// at once by a refused dial, which it names.)
	v, err := d.store.Do(ctx, rel.Lock, func(c context.Context, rdb redis.Cmdable) (any, error) { return store.ReleaseKey(c, rdb, rel) })
	res, _ := v.(store.ReleaseResult)
	switch {
	case err != nil:
		return false, unavailable("release", err)
	case !res.Released && res.Holder != "":
		return false, errorf("%w: %s holds %s, not %s", ErrNotHolder, res.Holder, rel.Lock, holder)
	}
	if res.Released {
		d.store.Forget(rel.Lock)
	}
	return res.Released, nil
}

// readKeyLock reads the lock of task's key, nil when there is none.
func (d *Dedup) readKeyLock(ctx context.Context, task *asynq.Task, opts []asynq.Option) (*store.Lock, error) {
	ref, err := d.lockKeyOf(task, opts)
	if err != nil {
		return nil, err
	}
	v, err := d.store.Do(ctx, ref.Lock, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return store.ReadLocks(c, rdb, d.store.Keys(), []string{ref.Lock})
	})
	ls, _ := v.([]*store.Lock)
	if err != nil {
		return nil, unavailable("lookup", err)
	}
	if len(ls) == 0 || ls[0] == nil {
		return nil, nil
	}
	return ls[0], nil
}
