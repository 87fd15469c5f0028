package dedup

// The steps of TestOptionSpace (optionspace_test.go): each enqueues,
// ends runs, calls the Inspector, the lock API or the doctor, restarts the
// worker or waits for asynq's clock, and files what it did in the model
// (optionspace_model_test.go).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// submit enqueues through the library and files what it did; recheck
// allows one more enqueue of the same key when a lock whose owner is gone
// refused it.
func (w *osWorld) submit(s *osSpec, recheck bool) {
	m := w.m
	seq := w.nextSeq()
	w.submits++
	kid := w.kidOf(s.typ, s.k, s.noK, s.keyOpts)
	p := osPayload{Kid: kid, S: seq, U: []int{seq}}
	if !s.noK {
		p.K = &s.k
	}
	var task *asynq.Task
	taskDesc := ""
	if s.taskQueue != "" {
		task = asynq.NewTask(s.typ, p.bytes(), asynq.Queue(s.taskQueue))
		taskDesc = " NewTask(Queue(" + qn(s.taskQueue) + "))"
	} else {
		task = asynq.NewTask(s.typ, p.bytes())
	}
	kdesc := s.k
	if s.noK {
		kdesc = "(no k)"
	}
	what := fmt.Sprintf("enqueue #%d via %s: %s k=%s s=%d%s [%s]", w.submits, s.client, s.typ, kdesc, seq, taskDesc, strings.Join(s.desc, " "))
	timeout := osCallTimeout
	if s.wait {
		timeout = 400 * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	m.mu.Lock()
	start := m.next()
	m.mu.Unlock()
	res, err := w.clientOf(s.client).Submit(ctx, task, s.opts...)
	ctxDone := ctx.Err() != nil
	cancel()
	m.mu.Lock()
	sub := &osSubmit{n: w.submits, seq: seq, typ: s.typ, kid: kid, client: s.client, opts: strings.Join(s.desc, " "), start: start, end: m.next(), ctxDone: ctxDone, res: res, err: err}
	if err == nil {
		m.log = append(m.log, fmt.Sprintf("  %s → %s %s", what, res.Outcome, res.TaskID))
	} else {
		m.log = append(m.log, fmt.Sprintf("  %s → error: %v", what, err))
	}
	m.mu.Unlock()
	if err != nil {
		w.refused(s, sub, recheck)
		return
	}
	if s.refusal != "" {
		m.mu.Lock()
		m.violate("5", "enqueue #%d was accepted (%s), but the README refuses it: %s", sub.n, res.Outcome, s.refusal)
		m.mu.Unlock()
	}
	w.accepted(s, sub)
}

// merges reports whether the call s folds by Merge (its type's rule with
// its options applied, as the Client applies them).
func (w *osWorld) merges(s *osSpec) bool {
	r := w.h.d.ruleFor(s.typ)
	for _, o := range s.opts {
		if ov, ok := o.(option); ok {
			_ = ov.apply(&r)
		}
	}
	if r.settleConflict() != nil {
		return false
	}
	return r.conflict == Merge
}

// accepted files a successful enqueue.
func (w *osWorld) accepted(s *osSpec, sub *osSubmit) {
	m := w.m
	res := sub.res
	q := ""
	if res.Info != nil {
		q = res.Info.Queue
	}
	if q == "" {
		m.mu.Lock()
		m.violate("5", "enqueue #%d: a Result without the task's queue: %+v", sub.n, res)
		m.mu.Unlock()
		return
	}
	var known *osTask
	if res.Outcome == Replaced || res.Outcome == Merged {
		known = w.taskOf(q, res.TaskID)
	}
	st := ""
	if res.Outcome != Created {
		st = w.state(q, res.TaskID)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if res.Outcome != Created && goneState(st) {
		m.violate("4", "enqueue #%d was %s into %s, which asynq has %s: the payload is in a task that will not run", sub.n, res.Outcome, res.TaskID, orMissing(st))
	}
	var t *osTask
	switch res.Outcome {
	case Created, Deferred:
		origin := osAccepted
		kid := sub.kid
		if s.skip {
			origin, kid = osUnlocked, ""
		}
		pre := m.tasks[q+"/"+res.TaskID]
		takenFirst := pre != nil && pre.found > sub.start // a worker met it before the call returned
		t = m.newTask(w, q, res.TaskID, s.typ, kid, origin, sub.start)
		t.guarded = takenFirst && strings.Contains(sub.client, "→")
		t.followUp = res.Outcome == Deferred
		t.s = sub.seq
		if origin == osUnlocked {
			return
		}
	case Replaced, Merged:
		t = known
		if t == nil {
			m.violate("5", "enqueue #%d was %s into %s, which asynq does not have", sub.n, res.Outcome, res.TaskID)
			return
		}
		if t.typ != s.typ || t.kid != sub.kid {
			m.violate("1", "enqueue #%d (%s, key %s) was %s into %s (%s, key %s): another type's or key's task", sub.n, s.typ, short(sub.kid), res.Outcome, t.label, t.typ, short(t.kid))
		}
		t.foldedInto = true
		if res.Outcome == Replaced {
			for u := range t.units {
				m.units[u] = nil // replaced: no longer owed
				delete(t.units, u)
			}
		}
		t.s = sub.seq
	default:
		m.violate("5", "enqueue #%d: unknown outcome %v", sub.n, res.Outcome)
		return
	}
	t.units[sub.seq] = true
	m.units[sub.seq] = t
	if w.merges(s) { // (a unit is owed once only where payloads merge: Replace and Reject keep one of a key's)
		m.mergeUnits[sub.seq] = true
	}
	m.unitTasks[sub.seq] = append(m.unitTasks[sub.seq], t)
	m.carrier[sub.seq] = t
	sub.carrier = t
	k := osKey{q, sub.kid}
	m.keyInfo(k).newest = sub
	m.ranBeforeAccepted(k, t, sub.seq)
	if w.rules[s.typ].OnRunning == RunningAllow {
		m.keyInfo(k).allow = true
	}
	m.log[len(m.log)-1] += fmt.Sprintf(" (%s, key %s)", t.label, k)
	lk := w.lockKey(q, sub.kid)
	if _, ok := w.probes[lk]; !ok {
		w.probes[lk] = osProbe{typ: s.typ, k: s.k, keyOpts: s.keyOpts, keyDesc: strings.Join(s.keyDesc, " "), queue: q}
	}
}

// taskOf returns the current task queue/id, learning it from asynq's
// record if the test does not know it.
func (w *osWorld) taskOf(queue, id string) *osTask {
	w.m.mu.Lock()
	t := w.m.tasks[queue+"/"+id]
	w.m.mu.Unlock()
	if t != nil {
		return t
	}
	typ, payload, _, found, err := w.h.d.store.StoredTask(context.Background(), queue, id)
	if err != nil {
		w.fail("read a task: " + err.Error())
	}
	if !found {
		return nil
	}
	w.m.mu.Lock()
	defer w.m.mu.Unlock()
	return w.m.task(w, queue, id, typ, payload)
}

// refused checks a refused enqueue: its error's class, that it enqueued
// and locked nothing, and that a lock whose owner is gone did not refuse it.
func (w *osWorld) refused(s *osSpec, sub *osSubmit, recheck bool) {
	m := w.m
	err := sub.err
	var dup *DuplicateTaskError
	m.mu.Lock()
	m.refused[sub.seq] = fmt.Sprintf("enqueue #%d: %v", sub.n, err)
	switch {
	case !isDocumented(err, sub.ctxDone):
		m.violate("5", "enqueue #%d failed with an error of no documented class: %v", sub.n, err)
	case s.refusal != "" && !errors.Is(err, ErrInvalidOption):
		m.violate("5", "enqueue #%d: the README refuses it (%s) with ErrInvalidOption, but it failed with %v", sub.n, s.refusal, err)
	case s.refusal == "" && errors.Is(err, ErrInvalidOption):
		m.violate("5", "enqueue #%d: refused with ErrInvalidOption, though the README accepts it: %v", sub.n, err)
	}
	m.mu.Unlock()
	w.nothingLeft(sub)
	if !errors.As(err, &dup) || dup.CoolingDown {
		return
	}
	// Invariant 4: did a lock whose owner is gone refuse it?
	st := w.state(dup.Queue, dup.Holder)
	if !goneState(st) {
		return
	}
	holder := w.taskOf(dup.Queue, dup.Holder)
	value, _ := w.h.rdb.Get(context.Background(), dup.Key).Result()
	p := store.ParseValue(value)
	m.mu.Lock()
	// docs/lifecycle.md: a lock written with its task (NewClient's direct
	// path, a follow-up, a task that took it as it started) heals at once;
	// one taken before its task was stored (asynq's client stores it) once
	// it is HealGrace old (its time is in whole seconds).
	stored := p.Kind != store.HoldWrap
	age := time.Since(p.At)
	hlabel := dup.Holder
	if holder != nil {
		hlabel = holder.label + " " + dup.Holder
	}
	if holder != nil && m.zombieRuns(holder) {
		// docs/lifecycle.md: a handler asynq gave up that still runs keeps
		// its task's key, whatever asynq's record says.
		m.log = append(m.log, fmt.Sprintf("  · refused by %s, whose task is %s, while a given-up handler of it still runs: allowed", hlabel, orMissing(st)))
		m.mu.Unlock()
		return
	}
	if !stored && age < osHealGrace+time.Second {
		m.log = append(m.log, fmt.Sprintf("  · refused by %s, whose task is %s, with a lock not written with its task and %v old (under HealGrace): allowed", hlabel, orMissing(st), age.Round(time.Millisecond)))
		m.mu.Unlock()
		return
	}
	if !recheck {
		m.violate("4", "enqueue #%d (%s) was refused as a duplicate of %s, whose task is %s (written with its task %v, %v old), a second after a first such refusal; %s", sub.n, s.client, hlabel, orMissing(st), stored, age.Round(time.Millisecond), w.describeLock(osKey{dup.Queue, fpOfLockKey(dup.Key)}))
		m.mu.Unlock()
		return
	}
	m.log = append(m.log, fmt.Sprintf("  · refused by %s, whose task is %s: once more after a second (a process may answer from the lock alone for that long)", hlabel, orMissing(st)))
	m.mu.Unlock()
	time.Sleep(1100 * time.Millisecond) // the library's documented window (store.DefaultRecheck), not a wait for a signal
	if st := w.state(dup.Queue, dup.Holder); goneState(st) {
		again := *s
		w.submit(&again, false)
	}
}

func fpOfLockKey(key string) string { return key[strings.LastIndex(key, ":")+1:] }

func orMissing(st string) string {
	if st == "" {
		return "missing"
	}
	return st
}

// nothingLeft checks that a refused enqueue enqueued nothing (no live task
// carries its payload) and, for a refusal before any lock (ErrInvalidOption,
// ErrInvalidPayload, ErrTooManyPending), locked nothing.
func (w *osWorld) nothingLeft(sub *osSubmit) {
	m := w.m
	l := w.readLive()
	for qid := range l.state {
		q, id, _ := strings.Cut(qid, "/")
		_, payload, _, found, err := w.h.d.store.StoredTask(context.Background(), q, id)
		if err != nil || !found {
			continue
		}
		p, _ := decodeOS(payload)
		if p.S == sub.seq || slices.Contains(p.U, sub.seq) {
			m.mu.Lock()
			m.violate("5", "enqueue #%d was refused (%v), but task %s in %s carries its payload", sub.n, sub.err, id, q)
			m.mu.Unlock()
		}
	}
	if !errors.Is(sub.err, ErrInvalidOption) && !errors.Is(sub.err, ErrInvalidPayload) && !errors.Is(sub.err, ErrTooManyPending) {
		return
	}
	before := map[string]string{}
	for _, l := range w.locks {
		before[l.key] = l.owner
	}
	for _, l := range w.readLocks() {
		if before[l.key] != l.owner && l.ownerState == "" {
			m.mu.Lock()
			m.violate("5", "enqueue #%d was refused (%v), but left lock %s owned by %s, which asynq does not have", sub.n, sub.err, l.key, l.owner)
			m.mu.Unlock()
		}
	}
}

// lockless enqueues through asynq's own client.
func (w *osWorld) lockless() {
	rng := w.rng
	typ, k, q := osTypes[rng.IntN(len(osTypes))], fmt.Sprintf("k%d", rng.IntN(2)), w.queues[rng.IntN(2)]
	seq := w.nextSeq()
	kid := w.kidOf(typ, k, false, nil)
	opts := []asynq.Option{asynq.Queue(q)}
	desc := "Queue(" + qn(q) + ")"
	if rng.IntN(3) == 0 {
		opts = append(opts, asynq.MaxRetry(0))
		desc += " MaxRetry(0)"
	}
	if rng.IntN(7) == 0 {
		opts = append(opts, asynq.ProcessIn(time.Second))
		desc += " ProcessIn(1s)"
	}
	kk := k
	w.m.mu.Lock()
	start := w.m.next()
	w.m.mu.Unlock()
	info, err := w.h.asynq.Enqueue(asynq.NewTask(typ, osPayload{K: &kk, Kid: kid, S: seq, U: []int{seq}}.bytes()), opts...)
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.log = append(m.log, fmt.Sprintf("  lockless enqueue via asynq's client: %s k=%s s=%d [%s] → error: %v", typ, k, seq, desc, err))
		return
	}
	t := m.newTask(w, q, info.ID, typ, kid, osLockless, start)
	t.s = seq
	m.lockless[seq] = t
	m.carrier[seq] = t
	m.log = append(m.log, fmt.Sprintf("  lockless enqueue via asynq's client: %s k=%s s=%d [%s] → %s %s (key %s)", typ, k, seq, desc, t.label, info.ID, t.key()))
	lk := w.lockKey(q, kid)
	if _, ok := w.probes[lk]; !ok {
		w.probes[lk] = osProbe{typ: typ, k: k, queue: q}
	}
}

// parked returns the runs waiting for the test: live ones, or (zombie)
// those asynq gave up.
func (w *osWorld) parked(zombie bool) []*osRun {
	w.m.mu.Lock()
	defer w.m.mu.Unlock()
	var out []*osRun
	for r := range w.m.blocked {
		if (r.ctx.Err() != nil) == zombie {
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].start < out[j].start })
	return out
}

func (w *osWorld) slowable() []*osRun {
	var out []*osRun
	for _, r := range w.parked(false) {
		if dl, ok := r.ctx.Deadline(); ok && time.Until(dl) < 2*osTimeout {
			out = append(out, r) // its task's Timeout (a follow-up inherits its holder's)
		}
	}
	return out
}

func (w *osWorld) drawEnd() osEnd {
	switch x := w.rng.IntN(100); {
	case x < 55:
		return endSuccess
	case x < 78:
		return endError
	case x < 87:
		return endPanic
	case x < 95:
		return endSkipRetry
	}
	return endRevoke
}

func (w *osWorld) endRun() {
	rs := w.parked(false)
	r := rs[w.rng.IntN(len(rs))]
	end := w.drawEnd()
	w.m.logf("  end run %s: %s", r.label, end)
	w.end(r, end)
}

// end tells a parked run how to end and waits until the middleware call
// that ran it has returned.
func (w *osWorld) end(r *osRun, end osEnd) {
	r.reply <- end
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		w.fail("the middleware did not return after run " + r.label + " ended")
	}
}

func (w *osWorld) endZombie() {
	rs := w.parked(true)
	r := rs[w.rng.IntN(len(rs))]
	end := []osEnd{endSuccess, endError}[w.rng.IntN(2)]
	w.m.logf("  the given-up run %s returns late: %s", r.label, end)
	w.end(r, end)
}

// timeOut waits until asynq gives a parked run up (its task's Timeout).
func (w *osWorld) timeOut() {
	rs := w.slowable()
	r := rs[w.rng.IntN(len(rs))]
	w.m.logf("  let run %s pass its Timeout (%v)", r.label, osTimeout)
	select {
	case <-r.ctx.Done():
	case <-time.After(2*osTimeout + time.Second):
		w.fail("run " + r.label + " did not time out")
	}
}

// waitingIDs returns the tasks asynq has pending, scheduled or retrying.
func (w *osWorld) waitingIDs() []string {
	var out []string
	for qid, st := range w.live.state {
		if st != "active" {
			out = append(out, qid)
		}
	}
	sort.Strings(out)
	return out
}

func (w *osWorld) inspectTask() {
	ids := w.waitingIDs()
	qid := ids[w.rng.IntN(len(ids))]
	q, id, _ := strings.Cut(qid, "/")
	t := w.taskOf(q, id)
	label := id
	if t != nil {
		label = t.label + " " + id
	}
	var err error
	var what string
	switch x := w.rng.IntN(10); {
	case x < 4:
		what, err = "DeleteTask", w.h.insp.DeleteTask(q, id)
	case x < 7:
		what, err = "ArchiveTask", w.h.insp.ArchiveTask(q, id)
	default:
		what, err = "RunTask", w.h.insp.RunTask(q, id)
	}
	w.m.mu.Lock()
	defer w.m.mu.Unlock()
	w.m.log = append(w.m.log, fmt.Sprintf("  Inspector.%s(%s) of %s (%s): %v", what, qn(q), label, w.live.state[qid], errOr(err)))
	if err == nil && what != "RunTask" && t != nil {
		t.removed = what
	}
}

func errOr(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

func (w *osWorld) inspectQueue() {
	q := w.queues[w.rng.IntN(len(w.queues))]
	before := w.readLive()
	var what string
	var err error
	switch x := w.rng.IntN(10); {
	case x < 4:
		var n int
		n, err = w.h.insp.DeleteAllPendingTasks(q)
		what = fmt.Sprintf("DeleteAllPendingTasks (%d)", n)
	case x < 8:
		var n int
		n, err = w.h.insp.ArchiveAllPendingTasks(q)
		what = fmt.Sprintf("ArchiveAllPendingTasks (%d)", n)
	default:
		what, err = "DeleteQueue(force)", w.h.insp.DeleteQueue(q, true)
	}
	w.m.logf("  Inspector.%s on %s: %v", what, qn(q), errOr(err))
	// the tasks it removed: live before, gone or archived now
	for qid := range before.state {
		qq, id, _ := strings.Cut(qid, "/")
		if qq != q {
			continue
		}
		st := w.state(q, id)
		if st != "" && st != "archived" {
			continue
		}
		if t := w.taskOf(q, id); t != nil {
			w.m.mu.Lock()
			if !t.done && t.removed == "" {
				t.removed = what
				w.m.log = append(w.m.log, fmt.Sprintf("  · %s removed", t.label))
			}
			w.m.mu.Unlock()
		}
	}
}

// probeKeys returns the known lock keys, sorted.
func (w *osWorld) probeKeys() []string {
	keys := make([]string, 0, len(w.probes))
	for k := range w.probes {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func (w *osWorld) probeTask(pr osProbe) (*asynq.Task, []asynq.Option) {
	k := pr.k
	p := osPayload{K: &k, S: -1}
	return asynq.NewTask(pr.typ, p.bytes()), append(slices.Clip(pr.keyOpts), asynq.Queue(pr.queue))
}

// release calls Dedup.Release for a known key: owner-checked with the
// holder Lookup names, forced, or owner-checked with a wrong holder.
func (w *osWorld) release() {
	keys := w.probeKeys()
	lk := keys[w.rng.IntN(len(keys))]
	pr := w.probes[lk]
	task, opts := w.probeTask(pr)
	ctx := context.Background()
	kl, found, err := w.h.d.Lookup(ctx, task, opts...)
	if err != nil {
		w.m.mu.Lock()
		w.m.violate("5", "Lookup of %s: %v", lk, err)
		w.m.mu.Unlock()
		return
	}
	var holder, mode string
	switch x := w.rng.IntN(20); {
	case x < 11:
		holder, mode = kl.Holder, "owner-checked"
	case x < 17:
		holder, mode = "", "forced"
	default:
		holder, mode = "dd-0000000000000000-00000000000000000000", "with a wrong holder"
	}
	released, err := w.h.d.Release(ctx, task, holder, opts...)
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	m.log = append(m.log, fmt.Sprintf("  Release %s of %s (%s %s; Lookup: found %v, holder %s, %s): released %v, %v", mode, lk, pr.typ, pr.keyDesc, found, kl.Holder, kl.State, released, errOr(err)))
	switch {
	case err != nil && !errors.Is(err, ErrNotHolder):
		m.violate("5", "Release: an error of no documented class: %v", err)
	case mode == "with a wrong holder" && found && (released || !errors.Is(err, ErrNotHolder)):
		m.violate("4", "Release with a wrong holder: released %v, %v; want ErrNotHolder", released, err)
	}
	if !released {
		return
	}
	_, fp, _ := store.NewKeys(w.h.prefix).ParseLock(lk)
	k := osKey{pr.queue, fp}
	for _, t := range m.tasks {
		holder := t.id == kl.Holder && t.queue == pr.queue // (a lockless task the guard locked too)
		if t.key() == k && (t.counts() || holder) && !t.done && !t.failed {
			t.released, t.wasRelease = true, true
			m.log = append(m.log, fmt.Sprintf("  · %s no longer holds a lock", t.label))
		}
	}
	for r := range m.blocked {
		if r.queue == k.queue && r.kid == k.kid {
			r.releasedRunning = true
		}
	}
}

// lookup checks Dedup.Lookup against asynq's record of the holder.
func (w *osWorld) lookup() {
	keys := w.probeKeys()
	lk := keys[w.rng.IntN(len(keys))]
	pr := w.probes[lk]
	task, opts := w.probeTask(pr)
	kl, found, err := w.h.d.Lookup(context.Background(), task, opts...)
	st := ""
	if found {
		st = w.state(kl.Queue, kl.Holder)
	}
	m := w.m
	m.mu.Lock()
	defer m.mu.Unlock()
	m.log = append(m.log, fmt.Sprintf("  Lookup %s (%s %s): found %v, holder %s (%s in asynq), state %s, follow-up %q, %v", lk, pr.typ, pr.keyDesc, found, kl.Holder, orMissing(st), kl.State, kl.FollowUp, errOr(err)))
	switch {
	case err != nil:
		m.violate("5", "Lookup: %v", err)
	case !found:
	case (kl.State == "waiting" || kl.State == "retry-wait") && goneState(st):
		m.violate("4", "Lookup says the key is %s, held by %s, whose task is %s", kl.State, kl.Holder, orMissing(st))
	case kl.State == "orphaned" && !goneState(st):
		m.violate("4", "Lookup says the key is orphaned, but its holder %s is %s", kl.Holder, st)
	}
}

// doctor runs dedupctl doctor --fix's logic over the run's locks.
func (w *osWorld) doctor() {
	ctx := context.Background()
	keys := store.NewKeys(w.h.prefix)
	ls, err := store.ReadLocks(ctx, w.h.rdb, keys, w.h.locks())
	if err != nil {
		w.fail("doctor: read locks: " + err.Error())
	}
	ds, _, err := store.Diagnose(ctx, w.h.rdb, ls, osHealGrace, time.Now())
	if err != nil {
		w.fail("doctor: " + err.Error())
	}
	w.m.logf("  doctor --fix: %d locks, %d whose owner cannot run", len(ls), len(ds))
	for _, d := range ds {
		res, err := store.ReleaseKey(ctx, w.h.rdb, &store.Release{Lock: d.Lock.Key, Queue: d.Lock.Queue, Type: d.Lock.WaitType(), How: store.ReleaseStuck, Holder: d.Lock.Owner, Grace: osHealGrace})
		st := w.state(d.Lock.Queue, d.Lock.Owner)
		live := w.readLive()
		m := w.m
		m.mu.Lock()
		m.log = append(m.log, fmt.Sprintf("    %s (owner %s, %s: %s): released %v, %v", d.Lock.Key, d.Lock.Owner, d.Problem, d.Detail, res.Released, errOr(err)))
		if res.Released {
			if _, there := live.state[d.Lock.Queue+"/"+d.Lock.Owner]; there && !goneState(st) {
				m.violate("4", "doctor --fix released %s, whose owner %s can run (%s)", d.Lock.Key, d.Lock.Owner, st)
			}
			k := osKey{d.Lock.Queue, d.Lock.FP}
			for _, t := range m.tasks {
				if t.key() == k && t.counts() && !t.done && !t.failed {
					t.released, t.wasRelease = true, true
				}
			}
		}
		m.mu.Unlock()
	}
}

// restart shuts the worker down (parked handlers outlive ShutdownTimeout,
// so asynq puts their tasks back) and starts a new one.
func (w *osWorld) restart() {
	w.m.logf("  worker restart: Shutdown (ShutdownTimeout %v) and a new server", osShutdown)
	w.srv.Shutdown()
	w.startServer()
}

// tick waits for asynq's clock to move the task due first.
func (w *osWorld) tick() {
	var first string
	var due time.Time
	for qid, d := range w.live.due {
		if first == "" || d.Before(due) || (d.Equal(due) && qid < first) {
			first, due = qid, d
		}
	}
	if time.Until(due) > 3*time.Second {
		w.m.logf("  wait for asynq's clock: nothing due within 3 s")
		return
	}
	was := w.live.state[first]
	q, id, _ := strings.Cut(first, "/")
	w.m.logf("  wait for asynq's clock: %s (%s) due at %s", id, was, due.Format("15:04:05"))
	eventually(w.t, "asynq moves a due task", func() bool {
		// Moved: its state changed, or it came back to that state due
		// later (a busy retry that ran between two reads).
		l := w.readLive()
		d, ok := l.due[q+"/"+id]
		return l.state[q+"/"+id] != was || (ok && d.After(due))
	})
}

// orphanProbes returns the orphaned locks the test knows a task for.
func (w *osWorld) orphanProbes() []osLock {
	var out []osLock
	for _, l := range w.orphans {
		if _, ok := w.probes[l.key]; ok {
			out = append(out, l)
		}
	}
	return out
}

// probeOrphan enqueues through NewClient at a key whose lock's owner is gone.
func (w *osWorld) probeOrphan() {
	cands := w.orphanProbes()
	l := cands[w.rng.IntN(len(cands))]
	pr := w.probes[l.key]
	w.m.logf("  lock %s is orphaned (owner %s is %s):", l.key, l.owner, orMissing(l.ownerState))
	s := &osSpec{client: "NewClient", typ: pr.typ, k: pr.k, queue: pr.queue, keyOpts: pr.keyOpts}
	s.add(asynq.Queue(pr.queue), "Queue("+qn(pr.queue)+")")
	for _, o := range pr.keyOpts {
		s.add(o, pr.keyDesc)
	}
	s.refusal = w.callRefusal(s)
	w.submit(s, true)
}

// drain ends every run with success until nothing is left to run.
func (w *osWorld) drain() {
	w.m.logf("drain: every run ends with success until nothing is left")
	deadline := time.Now().Add(40 * time.Second)
	for {
		for _, zombie := range []bool{false, true} {
			for _, r := range w.parked(zombie) {
				w.m.logf("  end run %s: success", r.label)
				w.end(r, endSuccess)
			}
		}
		w.quiesce("drain")
		w.live = w.checkStep()
		w.failOnViolations()
		if len(w.live.state) == 0 && len(w.parked(false))+len(w.parked(true)) == 0 {
			return
		}
		if w.runStranded() {
			continue
		}
		if time.Now().After(deadline) {
			var left []string
			for qid, st := range w.live.state {
				q, id, _ := strings.Cut(qid, "/")
				d := ""
				if due, ok := w.live.due[qid]; ok {
					d = fmt.Sprintf(" due in %v", time.Until(due).Round(time.Second))
				}
				t := w.taskOf(q, id)
				if t == nil {
					continue
				}
				left = append(left, fmt.Sprintf("%s %s (%s%s); %s", t.label, id, st, d, w.describeLock(t.key())))
			}
			sort.Strings(left)
			w.m.mu.Lock()
			w.m.violate("4", "the work did not drain in 40 s: %s", strings.Join(left, ", "))
			w.m.mu.Unlock()
			return
		}
		time.Sleep(50 * time.Millisecond) // asynq's clocks: scheduled tasks, retries
	}
}

// runStranded runs now, as an operator would with Inspector.RunTask, the
// tasks that are all that is left and are due more than 3 s from now: a
// RunningDefer follow-up whose holder was deleted while it waited for a
// retry stays parked for the retry delay and TTL (minutes), or until the
// key's next enqueue queues it. It reports whether it ran any (the
// Inspector refuses a queue that DeleteQueue took out of asynq's list).
func (w *osWorld) runStranded() bool {
	if len(w.parked(false))+len(w.parked(true)) > 0 {
		return false
	}
	var far []string
	for qid, st := range w.live.state {
		due, ok := w.live.due[qid]
		if st != "scheduled" || !ok || time.Until(due) < 3*time.Second {
			return false
		}
		far = append(far, qid)
	}
	sort.Strings(far)
	ran := false
	for _, qid := range far {
		q, id, _ := strings.Cut(qid, "/")
		err := w.h.insp.RunTask(q, id)
		w.m.logf("  %s is parked until %s: Inspector.RunTask: %v", id, w.live.due[qid].Format("15:04:05"), errOr(err))
		ran = ran || err == nil
	}
	return ran
}
