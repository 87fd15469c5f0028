package dedup

import (
	"context"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// call is one enqueue, composed from its task and options: what every later
// step needs, worked out once.
type call struct {
	task *asynq.Task
	typ  string
	rule resolved       // the type's rule with the call's options applied
	pass []asynq.Option // asynq's own options, for next.EnqueueContext

	queue         string
	explicitQueue bool // the call named the queue (asynq.Queue)
	callerID      string
	blankID       bool      // an asynq.TaskID option was blank
	processAt     time.Time // zero: due now
	conflicting   string    // asynq.Unique or asynq.Group, which deduplication refuses
	taskQueue     string    // the queue given to asynq.NewTask, if any
	msg           store.Message
	msgUnknown    bool              // an asynq option the direct path cannot store
	headers       map[string]string // added by dedup.Headers options and prepare's lock header (headers.go); nil: none
	userHeaders   bool              // a dedup.Headers option was given

	// Set by prepare, for a deduplicated call.
	ref       store.Ref
	acquire   store.Acquire
	terms     terms
	locked    bool // the lock is taken (false: fail-open)
	self      bool // the caller's own task ID already held the key: not this call's lock
	relocated bool // made again in the queue its task landed in (relocate.go)
}

// compose reads the task's and the call's options into k: this package's
// apply to the type's rule (those given to asynq.NewTask first, the call's
// over them, as asynq orders its own), asynq's are kept for asynq and read
// for what the lock needs.
func (c *Client) compose(k *call, task *asynq.Task, opts []asynq.Option) error {
	conflicting, taskQueue, taskID, err := checkTask(task)
	if err != nil {
		return err
	}
	k.conflicting, k.taskQueue = conflicting, taskQueue
	k.callerID = taskID // NewTask's, which asynq applies (a call's own asynq.TaskID overrides it, as in asynq)
	k.task, k.typ, k.rule = task, task.Type(), c.d.ruleFor(task.Type())
	k.pass = make([]asynq.Option, 0, len(opts)+1)
	k.msg.Retry = store.DefaultMaxRetry
	var rule *resolved // the options' functions get a copy, so k stays on the caller's stack
	if own, _ := taskOpts(task); len(own) > 0 {
		if err := k.ownOptions(own, &rule); err != nil {
			return err
		}
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if ov, ok := o.(option); ok {
			if err := k.applyOption(ov, &rule); err != nil {
				return err
			}
			continue
		}
		k.asynqOption(o)
		k.pass = append(k.pass, o)
	}
	if rule != nil {
		if err := rule.settleConflict(); err != nil {
			return err
		}
		k.rule = *rule
	}
	if k.rule.typeOff && k.rule.optedIn && !k.rule.skip {
		return errorf("%w: the rule for %q turns deduplication off (Rule.Skip): this call's deduplication options would be ignored (drop them, or the rule's Skip)", ErrInvalidOption, k.typ)
	}
	return k.chooseQueue(c.d)
}

// ownOptions applies this package's options given to asynq.NewTask (asynq
// applies its own from there itself), as the options of a layer under the
// call's: a key, OnConflict or MergeWith the call gives replaces theirs
// rather than contradicting it.
func (k *call) ownOptions(own []asynq.Option, rule **resolved) error {
	n := 0
	for _, o := range own {
		if ov, ok := o.(option); ok {
			if err := k.applyOption(ov, rule); err != nil {
				return errorf("%w (given to asynq.NewTask)", err)
			}
			n++
		}
	}
	if n == 0 || *rule == nil { // (Headers alone leave the rule as it is)
		return nil
	}
	if err := (*rule).endLayer(); err != nil {
		return errorf("%w (given to asynq.NewTask)", err)
	}
	return nil
}

// endLayer ends a layer of options (asynq.NewTask's) under the call's:
// its OnConflict and MergeWith become the rule's, and its key choice no
// longer counts as the call's, so that the call's own options replace them
// (a key, Fields, a policy) rather than contradicting them.
func (r *resolved) endLayer() error {
	if err := r.takeConflict(); err != nil {
		return err
	}
	r.callConflict, r.callConflictSet, r.callMerge, r.callKey = 0, false, nil, ""
	return nil
}

// applyOption applies one of this package's options to the call: Headers
// to its task, the others to its rule (a copy of the type's, made at the
// first).
func (k *call) applyOption(ov option, rule **resolved) error {
	if ov.headers != nil {
		k.addHeaders(ov.headers)
		k.userHeaders = true
		return nil
	}
	if *rule == nil {
		*rule = new(resolved)
		**rule = k.rule
	}
	return ov.apply(*rule)
}

// asynqOption reads one of asynq's options.
func (k *call) asynqOption(o asynq.Option) {
	switch v := o.Value(); o.Type() {
	case asynq.QueueOpt:
		if s, ok := v.(string); ok {
			k.queue, k.explicitQueue = s, true
		}
	case asynq.TaskIDOpt:
		if s, ok := v.(string); ok {
			k.callerID = s
			k.blankID = k.blankID || strings.TrimSpace(s) == "" // asynq refuses any, even if a later one is not
		}
	case asynq.ProcessAtOpt:
		if t, ok := v.(time.Time); ok {
			k.processAt = t
		}
	case asynq.ProcessInOpt:
		if d, ok := v.(time.Duration); ok {
			k.processAt = time.Now().Add(d)
		}
	case asynq.UniqueOpt, asynq.GroupOpt:
		k.conflicting = o.String()
		k.msgUnknown = true
	default:
		k.msgUnknown = k.msgUnknown || !k.messageOption(o)
	}
}

// messageOption records an option the direct path stores in asynq's
// message; it reports false for one it cannot reproduce.
func (k *call) messageOption(o asynq.Option) bool {
	var ok bool
	switch v := o.Value(); o.Type() {
	case asynq.MaxRetryOpt:
		k.msg.Retry, ok = v.(int)
	case asynq.TimeoutOpt:
		k.msg.Timeout, ok = v.(time.Duration)
	case asynq.DeadlineOpt:
		k.msg.Deadline, ok = v.(time.Time)
	case asynq.RetentionOpt:
		k.msg.Retention, ok = v.(time.Duration)
	}
	return ok
}

// chooseQueue picks the queue the lock lives in: the call's, else the one
// tasks of this type last landed in, else "default".
func (k *call) chooseQueue(d *Dedup) error {
	switch {
	case k.explicitQueue && strings.TrimSpace(k.queue) == "":
		return errorf("%w: blank queue name", ErrInvalidOption)
	case k.explicitQueue:
	case k.taskQueue != "": // asynq.NewTask's queue, which the call does not override
		k.queue = k.taskQueue
	default:
		k.queue = "default"
		if q, ok := d.queues.Load(k.typ); ok {
			k.queue = q.(string)
		}
	}
	if k.blankID {
		return errorf("%w: blank task ID", ErrInvalidOption)
	}
	return nil
}

// prepare makes a deduplicated call ready for the lock scripts: its key,
// task ID, what its policy needs beside the lock (modes.go), the scripts'
// arguments and, on the direct path, the task to store with the lock.
func (c *Client) prepare(ctx context.Context, k *call) error {
	d := c.d
	if k.conflicting != "" {
		return errorf("%w: %s cannot be combined with deduplication (use dedup.Skip() to enqueue this call without it)", ErrInvalidOption, k.conflicting)
	}
	if err := k.rule.checkModes(); err != nil {
		return err
	}
	now := time.Now()
	k.debounce(now)
	k.rule.settleWindow(now)
	fp, err := k.rule.fixedFP, error(nil)
	if fp == "" {
		fp, err = d.fingerprintHex(k.typ, k.task.Payload(), &k.rule)
	}
	if err != nil {
		return err
	}
	id := k.callerID
	switch {
	case id == "" && !hasHeaders(): // (markID marks it, once its terms are known)
	case id == "":
		id = store.NewPlainID()
		k.pass = append(k.pass, asynq.TaskID(id))
	case store.Reserved(id):
		return reservedID(id)
	}
	direct := c.canDirect(ctx, k)
	k.ref = store.Ref{Queue: k.queue, FP: fp, ID: id, Type: k.typ, Lock: d.store.Keys().Lock(k.queue, fp)}
	k.acquire = k.acquireOf(d, direct, now)
	if id == "" {
		k.markID(d, direct, now)
	}
	k.locked = true
	if err := k.markTask(); err != nil {
		return err
	}
	if direct {
		c.prepareDirect(k)
	}
	return nil
}

// acquireOf is the call's Acquire: the lock's value, lifetime and mode
// record, and what the policy does with a holder.
func (k *call) acquireOf(d *Dedup, direct bool, now time.Time) store.Acquire {
	r := &k.rule
	a := store.Acquire{Ref: k.ref, OnWaiting: r.conflict.fold(), TTL: d.lockTTL(r, k.processAt, now), Now: now,
		MaxPending: r.maxPending, Caller: k.callerID != ""}
	kept := time.Duration(0)
	if direct {
		kept = k.keptFor(now)
	}
	switch {
	case r.firing > 0: // a Scheduler firing: held until it expires, whatever its task does
		a.Value, a.TTL = store.FiringValue(k.ref.ID), r.firing
		if r.maxPending > 0 { // (counted while it waits: it leaves the waiting set as it starts)
			k.terms = terms{flags: store.Flags([]byte{store.FlagStart}), mode: []any{store.FieldHolder, k.ref.ID,
				store.FieldType, k.typ, store.FieldKeyForm, keyForm(r), store.FieldBounded, k.typ}}
			a.Mode = k.terms.mode
		}
		return a
	case kept > 0:
		a.Value, a.Unique = store.KeptValue(k.ref.ID, now.Add(kept)), true
	case direct:
		a.Value, a.Unique = store.Value(k.ref.ID), true
	default:
		a.Value = store.WrapValue(k.ref.ID, now)
	}
	k.terms = termsOf(r, k.typ, k.ref.ID, now, !direct, kept > 0)
	a.Mode = k.terms.mode
	if r.debounce > 0 {
		a.DebounceDue = k.processAt.Unix()
	}
	if r.conflict == Replace || r.running == RunningDefer {
		a.Payload = k.task.Payload()
	}
	if r.running == RunningDefer {
		a.Defers, a.FollowID = true, store.NewFollowID()
	}
	return a
}

// keptFor is how long after now a key the direct path takes stays held
// once its task succeeds (Cooldown), 0 for none. asynq's own record says
// that the task succeeded: the task is stored with a Retention at least as
// long, so that asynq keeps the record that long, and the middleware makes
// no call at the success.
//
// Not for a Period: its window holds whatever becomes of the task's record
// (an operator may delete a completed task), which the settle at success
// writes beside it. Not for a caller-chosen ID: asynq's record would keep it taken until the
// cooldown ends, even once the key is released. Nor with a fail hold (OnFailure):
// a task that failed for good on its first attempt and is run again by hand
// makes no start call (its retry count is 0), so nothing would lengthen the
// fail hold's lifetime to the window, nor clear its error, at its success;
// the settle at success does both.
func (k *call) keptFor(now time.Time) time.Duration {
	if k.rule.firing > 0 || k.rule.period > 0 || k.callerID != "" || k.rule.failHold != 0 {
		return 0
	}
	cool, _ := k.rule.lockTerms(now)
	return cool
}

// reservedID is the error for a caller-chosen ID of a form this package
// makes (store.Reserved).
func reservedID(id string) error {
	return errorf("%w: task ID %q has the form of this package's own IDs (dd-, df-, dk-, da-, dx-, dm-, or a leading '~')", ErrInvalidOption, id)
}

// markID gives the call's task an ID that carries what its lock header
// would, where asynq has no task headers. Its flags always ask the
// middleware to check the key at start: it cannot see the marks a task
// gets later in its header (a key lost while it waited, store.HeaderLost),
// nor one from markUnlocked.
func (k *call) markID(d *Dedup, direct bool, now time.Time) {
	flags := k.terms.flags
	if !flags.Has(store.FlagStart) {
		flags += store.Flags([]byte{store.FlagStart})
	}
	k.ref.ID = store.NewMarkedID(flags, k.ref.FP)
	k.pass = append(k.pass, asynq.TaskID(k.ref.ID))
	k.acquire = k.acquireOf(d, direct, now) // again, for the ID
}

// markUnlocked marks a fail-open call's task, which asynq's client stores
// without its lock: it takes the key when it starts (or meets it busy), and
// gives it back at its end.
func (k *call) markUnlocked() error {
	flags := k.terms.flags + store.Flags([]byte{store.FlagStart, store.FlagRelease})
	k.addHeaders(map[string]string{store.HeaderLock: store.LockHeader(flags, k.ref.Lock)})
	return k.applyHeaders()
}

// markTask gives the task the header that tells the middleware what to do
// with it (modes.go), unless its ID says all (a plain task the direct path
// stores), and drops any of this package's headers it carried (a task a
// handler enqueues again).
func (k *call) markTask() error {
	if k.terms.flags != "" || k.callerID != "" {
		k.addHeaders(map[string]string{store.HeaderLock: store.LockHeader(k.terms.flags, k.ref.Lock)})
	}
	return k.applyHeaders()
}

// Direct enqueue: for a Client from Dedup.NewClient (whose asynq client
// shares the Dedup's Redis) and a task that carries none of asynq's options
// from asynq.NewTask (which the wrapper cannot see; this package's it
// reads), the acquire script stores
// asynq's task record itself, in the same atomic step that takes the lock:
// one round trip for an accepted enqueue instead of two, and no window in
// which the lock exists without its task. It stores exactly what asynq
// v0.26.0's own client stores; TestDirectEnqueueMatchesAsynq compares the
// two field by field.

// canDirect reports whether the direct path applies to the call.
func (c *Client) canDirect(ctx context.Context, k *call) bool {
	if !c.direct || k.msgUnknown || strings.TrimSpace(k.typ) == "" {
		return false
	}
	if !k.explicitQueue && k.queue != "default" {
		return false // the remembered queue came from NewTask options: asynq's path
	}
	if opts, ok := taskOpts(k.task); !ok || !onlyOwn(opts) {
		return false
	}
	return c.d.store.PublishQueue(ctx, k.queue) == nil // else asynq's client registers it
}

// onlyOwn reports whether opts (a task's asynq.NewTask options) hold none
// of asynq's (nil ones asynq ignores): then the direct path stores what
// asynq would.
func onlyOwn(opts []asynq.Option) bool {
	for _, o := range opts {
		if _, own := o.(option); !own && o != nil {
			return false
		}
	}
	return true
}

// prepareDirect adds the task's record to the acquire call.
func (c *Client) prepareDirect(k *call) {
	m := &k.msg
	m.Type, m.Payload, m.Headers, m.ID, m.Queue = k.typ, k.task.Payload(), taskHeaders(k.task), k.ref.ID, k.queue
	if k.acquire.Unique {
		m.UniqueKey = k.ref.Lock
	}
	if p := store.ParseValue(k.acquire.Value); p.Kind == store.HoldKept {
		// asynq keeps the record of its success until the cooldown ends: whole
		// seconds, rounded up, and one more, as asynq counts from the second
		// of the success, truncated.
		m.Retention = max(m.Retention, (time.Until(p.At)+2*time.Second-1)/time.Second*time.Second)
	}
	// As asynq's client: neither a timeout nor a deadline (zero, or the
	// Unix epoch exactly) means the default timeout.
	if (m.Deadline.IsZero() || m.Deadline.Equal(time.Unix(0, 0))) && m.Timeout == 0 {
		m.Timeout = store.DefaultTimeout
	}
	k.acquire.Direct, k.acquire.Message = true, *m // a copy: a pointer into k would move k to the heap
	if k.scheduled() {
		k.acquire.DueAt = k.processAt.Unix()
	}
}

// scheduled reports whether the task is due later than now.
func (k *call) scheduled() bool { return !k.processAt.IsZero() && k.processAt.After(time.Now()) }

// storedInfo is the TaskInfo asynq's client would return for the task the
// direct path stored.
func (k *call) storedInfo() *asynq.TaskInfo {
	m := &k.msg
	ti := &asynq.TaskInfo{
		ID: m.ID, Queue: m.Queue, Type: m.Type, Payload: m.Payload,
		// asynq stores whole seconds, and returns what it stored.
		MaxRetry: m.Retry, Timeout: m.Timeout / time.Second * time.Second, Retention: m.Retention / time.Second * time.Second,
		State: asynq.TaskStatePending, NextProcessAt: time.Now(),
	}
	if sec := m.Deadline.Unix(); !m.Deadline.IsZero() && sec != 0 {
		ti.Deadline = time.Unix(sec, 0)
	}
	if k.acquire.DueAt != 0 { // as stored: decided once, before the call
		ti.State, ti.NextProcessAt = asynq.TaskStateScheduled, k.processAt
	}
	setInfoHeaders(ti, m.Headers)
	return ti
}

// checkTask refuses, before any lock is taken, a task asynq's client would
// refuse. It returns the asynq option among those given to NewTask that
// deduplication cannot honour (Unique, Group), if any, and the queue and
// task ID given to NewTask, if any.
func checkTask(t *asynq.Task) (conflicting, queue, id string, err error) {
	if t == nil {
		return "", "", "", errorf("%w: nil task", ErrInvalidOption)
	}
	if strings.TrimSpace(t.Type()) == "" {
		return "", "", "", errorf("%w: blank task type", ErrInvalidOption)
	}
	opts, _ := taskOpts(t)
	for _, o := range opts {
		if o == nil {
			continue // asynq ignores it too
		}
		switch v, _ := o.Value().(string); o.Type() {
		case asynq.QueueOpt:
			if strings.TrimSpace(v) == "" {
				return "", "", "", errorf("%w: blank queue name in NewTask", ErrInvalidOption)
			}
			queue = v
		case asynq.TaskIDOpt:
			if strings.TrimSpace(v) == "" {
				return "", "", "", errorf("%w: blank task ID in NewTask", ErrInvalidOption)
			}
			id = v
		case asynq.UniqueOpt, asynq.GroupOpt:
			conflicting = o.String() + " in NewTask"
		}
	}
	return conflicting, queue, id, nil
}
