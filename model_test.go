//go:build ignore

package dedup

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"pgregory.net/rapid"
)

// TestModel drives the library against a small in-memory reference model of
// the lock's intended semantics: random sequences of enqueue (Reject or
// Replace, generated or caller-chosen task IDs), attempt start, heartbeat,
// success / revoke / final failure / failure with a retry left, worker
// crash, asynq's recovery of a crashed task or redelivery of a stalled one
// (leaving an old attempt behind), lease expiry, tasks deleted or archived
// by hand, locks aged past the heal grace, and Redis errors (a command
// failing, Redis staying down, or a command that ran but whose reply was
// lost) at one of the first commands of an operation, fail-closed and
// fail-open, over two keys of one queue.
//
// Enqueues go through Client.Submit and a real asynq enqueue; attempts
// through the middleware's own lock calls (resolve, then start, extend and
// finish with the resolved lock), with asynq's side simulated by hand: the
// task record's state field, which is all the scripts read. After every step
// the lock records in Redis (owner, attempt token, age, lifetime), the index
// keys of caller-chosen IDs and the asynq records (state, payload) must
// equal the model's. A divergence fails with the shrunk sequence of steps,
// each logged in words, and the model's state.
//
// Left out: Merge, RunningAllow and RunningDefer (follow-ups), MaxPending,
// scheduled tasks, relocation to another queue, the heartbeat loop and the
// circuit breaker (disabled here), and real time: lifetimes are checked but
// expiry and ageing are steps.
func TestModel(t *testing.T) {
	w := newModelWorld(t)
	var run int
	rapid.Check(t, func(rt *rapid.T) {
		run++
		m := w.newRun(rt, run)
		rt.Repeat(map[string]func(*rapid.T){
			"Enqueue":     m.enqueue,
			"Start":       m.start,
			"Heartbeat":   m.heartbeat,
			"Finish":      m.finish,
			"Crash":       m.crash,
			"Recover":     m.recoverTask,
			"Redeliver":   m.redeliver,
			"LeaseExpiry": m.expire,
			"Age":         m.age,
			"TaskGone":    m.taskGone,
			"RedisError":  m.redisError,
			"":            m.check,
		})
	})
}

// Lifetimes far apart, so a lock's remaining lifetime tells its phase:
// running ≤ Lease < waiting ≤ TTL < held for a retry ≤ TTL + retry delay.
// Nothing expires by itself during a run; expiry is a step of its own.
const (
	modelTTL     = time.Hour
	modelLease   = 2 * time.Minute
	modelRetry   = 10 * time.Hour
	modelHeldTTL = modelRetry + modelTTL
	modelType    = "model:job"
)

// The key is the payload's "k" field (a type rule, so that the
// execution-time guard finds the same key as the client); "m" carries a
// marker unique to each enqueue.
var modelKeys = [2]string{"k0", "k1"}

func modelPayload(k int, marker string) []byte {
	return []byte(`{"k":"` + modelKeys[k] + `","m":"` + marker + `"}`)
}

// modelWorld is what the runs share: one Dedup fail-closed, one fail-open,
// both on a Redis client whose commands can be made to fail, and a clean
// client for setting up and inspecting state.
type modelWorld struct {
	h      *harness // fail-closed
	open   *harness // fail-open, same prefix
	raw    redis.UniversalClient
	faults *faults
}

func newModelWorld(t *testing.T) *modelWorld {
	faulty := newRDB(t)
	raw := redis.NewClient(&redis.Options{Addr: faulty.(*redis.Client).Options().Addr})
	t.Cleanup(func() { _ = raw.Close() })
	f := newFaults()
	faulty.AddHook(f)
	cfg := Config{
		TTL:            modelTTL,
		heartbeat:          (modelLease) / 3,
		HealGrace:      time.Hour, // never reached by the clock: the Age step ages a lock
		LockTimeout:    10 * time.Second,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return modelRetry },
		Rules:          map[string]Rule{modelType: {Fields: []string{"k"}}},
		// Injected errors must reach go-redis, not be cut short by the
		// circuit breaker, which this model leaves out.
		BreakerThreshold: -1,
	}
	h := newHarnessOn(t, faulty, cfg)
	// Load asynq's enqueue script, so that a lost reply never meets a
	// NOSCRIPT retry.
	if _, err := h.asynq.Enqueue(asynq.NewTask(modelType, nil), asynq.Queue(h.queue+"-warmup")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.insp.DeleteQueue(h.queue+"-warmup", true)
	})
	cfg.Prefix, cfg.FailOpen = h.prefix, true
	open := newHarnessOn(t, faulty, cfg)
	// The one-time check of where tasks live would add Redis commands to
	// the first steps and shift the injected faults: settle it now.
	for _, w := range []*harness{h, open} {
		w.client.place.state.Store(placeHere)
		recheckAlways(w.d) // the model reads every owner's record on every call
	}
	return &modelWorld{h: h, open: open, raw: raw, faults: f}
}

// recheckAlways gives d a store that reads the owner's record on every
// rejection of a lock marked v (store.Config.Recheck < 0), as the model
// does; the default trusts such a lock for store.DefaultRecheck after a read.
func recheckAlways(d *Dedup) {
	cfg := d.storeConfig()
	cfg.Recheck = -1
	old := d.store
	d.store = store.New(d.rdb, cfg)
	old.Close()
}

// The model.

type phase int

const (
	waitingPhase phase = iota // taken at enqueue, no attempt yet
	runningPhase              // an attempt holds it under its token
	heldPhase                 // held across a retry
)

func (p phase) String() string { return [...]string{"waiting", "running", "held"}[p] }

// mTask is one task ID. Generated IDs are labelled t1, t2, … (g1, … for one
// whose enqueue never landed); a caller-chosen ID is its own label (k0-c1:
// IDs are bound to one key) and may be enqueued again once its record is
// gone.
type mTask struct {
	label   string
	id      string
	key     int
	caller  bool
	state   string // asynq state in the task record; "" for no record
	payload string // marker the stored message must carry
	latest  string // token of the attempt asynq runs now, "" for none
	index   bool   // caller-chosen ID: its index key points to its lock
	tries   int
}

type mLock struct {
	holder *mTask
	tok    string // "" while no attempt runs
	old    bool   // older than the heal grace
	stored bool   // written with its task's record (an attempt started): v
	phase  phase
}

// orphan reports whether the lock may be taken over: its holder is gone,
// and the lock is older than the heal grace or was written with its
// holder's record and no attempt runs.
func (l *mLock) orphan() bool {
	return !liveState(l.holder.state) && (l.old || (l.stored && l.tok == ""))
}

// mAttempt is a handler run: it keeps the lock reference the middleware
// resolved when it started, as the middleware does.
type mAttempt struct {
	label string // t1#2: task t1's second attempt
	task  *mTask
	tok   string
	ref   *store.Ref
}

type modelRun struct {
	*modelWorld
	queue    string
	keys     [2]string // lock keys
	fps      [2]string // their fingerprints
	locks    [2]*mLock
	tasks    []*mTask
	byID     map[string]*mTask
	attempts []*mAttempt
	markers  int
	gen      int
	ghosts   int
}

func (w *modelWorld) newRun(rt *rapid.T, n int) *modelRun {
	m := &modelRun{modelWorld: w, queue: fmt.Sprintf("%s-%d", w.h.queue, n), byID: map[string]*mTask{}}
	for k := range modelKeys {
		m.keys[k] = w.h.keyOf(asynq.NewTask(modelType, modelPayload(k, "")), m.queue)
		m.fps[k] = m.keys[k][strings.LastIndexByte(m.keys[k], ':')+1:]
	}
	rt.Cleanup(m.cleanup)
	return m
}

// cleanup deletes what the run wrote: the shared Redis is never flushed.
func (m *modelRun) cleanup() {
	ctx := context.Background()
	keys := []string{m.keys[0], m.keys[1], asynqPrefix(m.queue) + "pending", store.PrefixesKey(m.queue)}
	for _, tk := range m.tasks {
		keys = append(keys, asynqTaskKeyPrefix(m.queue)+tk.id, indexKey(m.h.prefix, m.queue, tk.id))
	}
	_ = m.raw.Del(ctx, keys...).Err()
	_ = m.raw.SRem(ctx, "asynq:queues", m.queue).Err()
}

func (m *modelRun) marker() string {
	m.markers++
	return "p" + strconv.Itoa(m.markers)
}

func waitingState(s string) bool { return s == "pending" || s == "scheduled" || s == "retry" }

func liveState(s string) bool { return s != "" && s != "completed" && s != "archived" }

func stateWord(s string) string {
	if s == "" {
		return "deleted"
	}
	return s
}

func (m *modelRun) addTask(id string, key int, caller, ghost bool) *mTask {
	var label string
	switch {
	case caller:
		label = id
	case ghost:
		m.ghosts++
		label = "g" + strconv.Itoa(m.ghosts)
	default:
		m.gen++
		label = "t" + strconv.Itoa(m.gen)
	}
	tk := &mTask{label: label, id: id, key: key, caller: caller}
	m.tasks = append(m.tasks, tk)
	m.byID[id] = tk
	return tk
}

func (m *modelRun) labelOf(id string) string {
	if tk, ok := m.byID[id]; ok {
		return tk.label
	}
	if id == "" {
		return `""`
	}
	return "unknown task " + id
}

func (m *modelRun) owner(a *mAttempt) bool {
	l := m.locks[a.task.key]
	return l != nil && l.holder == a.task && l.tok == a.tok
}

// release frees key k, with its holder's index.
func (m *modelRun) release(k int) {
	if l := m.locks[k]; l != nil {
		l.holder.index = false
	}
	m.locks[k] = nil
}

// Draws.

func (m *modelRun) drawKey(t *rapid.T, pred func(*mLock) bool) int {
	var ks []string
	for k, l := range m.locks {
		if pred == nil || pred(l) {
			ks = append(ks, modelKeys[k])
		}
	}
	if len(ks) == 0 {
		t.Skip("no key in that state")
	}
	if rapid.SampledFrom(ks).Draw(t, "key") == modelKeys[0] {
		return 0
	}
	return 1
}

func (m *modelRun) drawTask(t *rapid.T, pred func(*mTask) bool) *mTask {
	var labels []string
	byLabel := map[string]*mTask{}
	for _, tk := range m.tasks {
		if pred(tk) {
			labels = append(labels, tk.label)
			byLabel[tk.label] = tk
		}
	}
	if len(labels) == 0 {
		t.Skip("no task in that state")
	}
	return byLabel[rapid.SampledFrom(labels).Draw(t, "task")]
}

func (m *modelRun) drawAttempt(t *rapid.T) *mAttempt {
	if len(m.attempts) == 0 {
		t.Skip("no attempt running")
	}
	labels := make([]string, len(m.attempts))
	for i, a := range m.attempts {
		labels[i] = a.label
	}
	l := rapid.SampledFrom(labels).Draw(t, "attempt")
	for _, a := range m.attempts {
		if a.label == l {
			return a
		}
	}
	panic("unreachable")
}

func (m *modelRun) dropAttempt(a *mAttempt) {
	for i, b := range m.attempts {
		if b == a {
			m.attempts = append(m.attempts[:i], m.attempts[i+1:]...)
			break
		}
	}
	if a.task.latest == a.tok {
		a.task.latest = ""
	}
}

// Enqueue.

type enqKind int

const (
	enqCreated     enqKind = iota // key free or healed: the task is created and holds it
	enqDup                        // DuplicateTaskError naming the holder
	enqReplaced                   // payload written into the waiting holder
	enqReserved                   // holder not stored (yet?): the client waits for it, then gives up
	enqRefused                    // caller's ID taken by a stored task: asynq refuses, the lock is given back
	enqSelf                       // the caller's ID holds the key and has no record: created, lock untouched
	enqSelfRefused                // the caller's ID holds the key and its record is completed or archived: refused, lock untouched
)

func (k enqKind) String() string {
	return [...]string{"created", "duplicate", "replaced", "wait for holder to be stored", "ID taken: refused",
		"created under its own lock", "ID taken, own lock: refused"}[k]
}

// predictEnqueue is the model of an enqueue on key k with policy, under the
// caller-chosen task x (nil: a generated ID). It returns the holder it is
// about (duplicate, replaced, healed), if any.
func (m *modelRun) predictEnqueue(k int, policy Conflict, x *mTask) (enqKind, *mTask) {
	l := m.locks[k]
	if l != nil && x != nil && l.holder == x {
		switch {
		case x.state == "":
			return enqSelf, x
		case !liveState(x.state):
			return enqSelfRefused, x
		case l.tok != "" || !waitingState(x.state) || policy == Reject:
			return enqDup, x // its own live task holds the key: met like any holder
		}
		return enqReplaced, x
	}
	var kind enqKind
	var h *mTask
	switch {
	case l == nil:
		kind = enqCreated
	case l.orphan():
		kind, h = enqCreated, l.holder // healed
	case !liveState(l.holder.state) && l.holder.state == "" && policy == Replace:
		kind, h = enqReserved, l.holder
	case !liveState(l.holder.state):
		kind, h = enqDup, l.holder
	case l.tok != "" || !waitingState(l.holder.state) || policy == Reject:
		kind, h = enqDup, l.holder
	default:
		kind, h = enqReplaced, l.holder
	}
	if kind == enqCreated && x != nil && x.state != "" {
		kind = enqRefused
	}
	return kind, h
}

func (m *modelRun) submit(ctx context.Context, c *Client, k int, policy Conflict, callerID, marker string) (Result, error) {
	opts := []asynq.Option{asynq.Queue(m.queue), OnConflict(policy)}
	if callerID != "" {
		opts = append(opts, asynq.TaskID(callerID))
	}
	return c.Submit(ctx, asynq.NewTask(modelType, modelPayload(k, marker)), opts...)
}

func (m *modelRun) enqueue(t *rapid.T) {
	k := m.drawKey(t, nil)
	policy := rapid.SampledFrom([]Conflict{Reject, Replace}).Draw(t, "policy")
	var x *mTask
	callerID := ""
	if c := rapid.SampledFrom([]string{"generated", "generated", "c1", "c2"}).Draw(t, "taskID"); c != "generated" {
		callerID = modelKeys[k] + "-" + c
		x = m.byID[callerID]
	}
	kind, holder := m.predictEnqueue(k, policy, x)
	ctx := context.Background()
	if kind == enqReserved {
		// The client polls ~20 times for the holder to be stored: bound it.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 25*time.Millisecond)
		defer cancel()
	}
	marker := m.marker()
	res, err := m.submit(ctx, m.h.client, k, policy, callerID, marker)
	what := fmt.Sprintf("enqueue %s on %s (%s)", marker, modelKeys[k], policy)
	if callerID != "" {
		what = fmt.Sprintf("enqueue %s on %s as %s (%s)", marker, modelKeys[k], callerID, policy)
	}
	m.expectEnqueue(t, what, k, callerID, kind, holder, marker, res, err)
}

func (m *modelRun) expectEnqueue(t *rapid.T, what string, k int, callerID string, kind enqKind, holder *mTask, marker string, res Result, err error) {
	t.Helper()
	var dup *DuplicateTaskError
	switch kind {
	case enqCreated, enqSelf:
		if err != nil {
			m.diverge(t, "enqueue: an error where the model creates a task", "%s: err %v; model: %s", what, err, kind)
		}
		tk := m.created(t, what, k, callerID, marker, res)
		switch {
		case kind == enqSelf:
			m.selfCall(k)
			t.Logf("%s → created %s again under the lock it still held", what, tk.label)
			return
		case holder != nil:
			holder.index = false
			t.Logf("%s → created %s (healed %s)", what, tk.label, holder.label)
		default:
			t.Logf("%s → created %s", what, tk.label)
		}
		m.locks[k] = &mLock{holder: tk}
		tk.index = tk.caller
	case enqDup:
		if !errors.As(err, &dup) || dup.TaskID != holder.id {
			m.diverge(t, "enqueue: not the duplicate the model names", "%s: got %+v, %v; model: duplicate of %s", what, res, err, holder.label)
		}
		if !errors.Is(err, ErrDuplicateTask) || !errors.Is(err, asynq.ErrDuplicateTask) || dup.Key != m.keys[k] || dup.Queue != m.queue {
			m.diverge(t, "enqueue: duplicate error does not match its sentinels, key or queue", "%s: duplicate error %#v", what, dup)
		}
		t.Logf("%s → duplicate of %s", what, holder.label)
	case enqReplaced:
		if err != nil || res.Outcome != Replaced || res.TaskID != holder.id {
			m.diverge(t, "enqueue: not replaced into the holder the model names", "%s: got %v %s, %v; model: replaced into %s", what, res.Outcome, m.labelOf(res.TaskID), err, holder.label)
		}
		if res.Info == nil || res.Info.State != parseState(holder.state) || string(res.Info.Payload) != string(modelPayload(k, marker)) {
			m.diverge(t, "enqueue: replaced, but the result describes the task wrongly", "%s: replaced, info %+v; model: state %s", what, res.Info, holder.state)
		}
		holder.payload = marker
		t.Logf("%s → replaced into %s", what, holder.label)
	case enqReserved:
		if err == nil || (errors.As(err, &dup) && dup.TaskID != holder.id) {
			m.diverge(t, "enqueue: not the wait for an unstored holder the model expects", "%s: got %v %s, %v; model: waits for %s to be stored, then gives up", what, res.Outcome, m.labelOf(res.TaskID), err, holder.label)
		}
		t.Logf("%s → waited for %s to be stored; gave up (%v)", what, holder.label, err)
	case enqRefused, enqSelfRefused:
		if !errors.Is(err, asynq.ErrTaskIDConflict) || errors.As(err, &dup) {
			m.diverge(t, "enqueue: not refused for a taken task ID", "%s: got %v %s, %v; model: %s", what, res.Outcome, m.labelOf(res.TaskID), err, kind)
		}
		if kind == enqRefused {
			m.release(k) // the lock taken (or healed) for it is given back
			t.Logf("%s → refused: %s is stored (%s); lock given back", what, callerID, m.byID[callerID].state)
		} else {
			t.Logf("%s → refused: %s is stored (%s); its lock untouched", what, callerID, m.byID[callerID].state)
		}
	}
}

// selfCall: acquire found the key held by the caller's own ID, which the
// caller then enqueues through asynq: a lock written with its task loses
// that mark (v) and is young again, so the grace covers the gap.
func (m *modelRun) selfCall(k int) {
	if l := m.locks[k]; l != nil && l.tok == "" && l.stored {
		l.stored, l.old = false, false
	}
}

// created checks a Created result and adds or renews its task in the model.
func (m *modelRun) created(t *rapid.T, what string, k int, callerID, marker string, res Result) *mTask {
	t.Helper()
	if res.Outcome != Created || res.Info == nil || res.TaskID != res.Info.ID || res.Info.State != asynq.TaskStatePending {
		m.diverge(t, "enqueue: result of a created task is malformed", "%s: result %+v, info %+v; model: created", what, res, res.Info)
	}
	var tk *mTask
	if callerID != "" {
		if res.TaskID != callerID {
			m.diverge(t, "enqueue: created task does not have the caller's ID", "%s: created %s", what, res.TaskID)
		}
		if tk = m.byID[callerID]; tk == nil {
			tk = m.addTask(callerID, k, true, false)
		}
	} else {
		if _, dup := m.byID[res.TaskID]; dup {
			m.diverge(t, "enqueue: created task reuses a known task ID", "%s: created task %s has the ID of %s", what, res.TaskID, m.labelOf(res.TaskID))
		}
		if fp, ok := parseLockedID(res.TaskID); !ok || fp != m.fps[k] {
			m.diverge(t, "enqueue: created task ID does not name its lock", "%s: task ID %q does not name lock %s", what, res.TaskID, m.keys[k])
		}
		tk = m.addTask(res.TaskID, k, false, false)
	}
	tk.state, tk.payload = "pending", marker
	return tk
}

// Attempts.

// ref is what the middleware resolves for a task it is about to run: from a
// generated ID, or a caller-chosen ID's index, or (index gone) the type's
// rule applied to the payload.
func (m *modelRun) ref(t *rapid.T, tk *mTask) *store.Ref {
	t.Helper()
	ref, _, _, err := m.h.d.resolve(context.Background(), m.queue, tk.id, asynq.NewTask(modelType, modelPayload(tk.key, tk.payload)))
	if err != nil || ref == nil || m.h.d.lockKey(ref) != m.keys[tk.key] || ref.ID != tk.id || ref.Indexed != tk.index {
		m.diverge(t, "resolve: task does not lead to its lock", "resolve %s: %+v, %v; want lock %s, index %v", tk.label, ref, err, m.keys[tk.key], tk.index)
	}
	return ref
}

func (m *modelRun) setState(t *rapid.T, tk *mTask, state string) {
	t.Helper()
	key := asynqTaskKeyPrefix(m.queue) + tk.id
	var err error
	if state == "" {
		err = m.raw.Del(context.Background(), key).Err()
	} else {
		err = m.raw.HSet(context.Background(), key, "state", state).Err()
	}
	if err != nil {
		t.Fatalf("set task state: %v", err)
	}
	tk.state = state
}

// predictStart is the model of an attempt of tk starting: taken, possibly
// over an orphan (returned), or busy because of the returned holder.
func (m *modelRun) predictStart(tk *mTask) (taken bool, holder *mTask) {
	l := m.locks[tk.key]
	switch {
	case l == nil, l.holder == tk:
		return true, nil
	case l.orphan():
		return true, l.holder // orphan taken over
	}
	return false, l.holder
}

// start: asynq hands a pending or retrying task to a worker; the middleware
// makes the attempt the lock's owner under a fresh token.
func (m *modelRun) start(t *rapid.T) {
	m.startTask(t, m.drawTask(t, func(tk *mTask) bool { return waitingState(tk.state) }))
}

// redeliver: asynq gives up on a stalled worker (its lease lapsed, the
// handler still runs), queues the task again and starts a new attempt at
// once. The stalled attempt is left over.
func (m *modelRun) redeliver(t *rapid.T) {
	tk := m.drawTask(t, func(tk *mTask) bool { return tk.state == "active" && tk.latest != "" })
	m.setState(t, tk, "retry")
	tk.latest = ""
	t.Logf("asynq redelivers %s, whose worker stalls", tk.label)
	m.startTask(t, tk)
}

func (m *modelRun) startTask(t *rapid.T, tk *mTask) {
	t.Helper()
	ref := m.ref(t, tk)
	tok := newToken()
	taken, holder := m.predictStart(tk)
	m.setState(t, tk, "active") // asynq dequeued it
	st, got, err := m.h.d.start(context.Background(), ref, tok, RunningReject)
	what := "start " + tk.label
	if err != nil {
		m.diverge(t, "start: unexpected error", "%s: %v", what, err)
	}
	if !taken {
		if st != store.StatusHeld || got != holder.id {
			m.diverge(t, "start: not busy as the model says", "%s: status %d holder %s; model: busy, held by %s", what, st, m.labelOf(got), holder.label)
		}
		m.setState(t, tk, "retry") // BusyError: asynq retries it later
		t.Logf("%s → busy, held by %s", what, holder.label)
		return
	}
	if st != store.StatusTaken || got != tk.id {
		m.diverge(t, "start: not taken as the model says", "%s: status %d holder %s; model: taken", what, st, m.labelOf(got))
	}
	l := m.locks[tk.key]
	if l == nil || l.holder != tk {
		if holder != nil {
			holder.index = false
		}
		l = &mLock{holder: tk} // fresh, or an orphan's taken over: young again
		m.locks[tk.key] = l
	}
	l.tok, l.phase, l.stored = tok, runningPhase, true
	tk.tries++
	tk.latest = tok
	a := &mAttempt{label: fmt.Sprintf("%s#%d", tk.label, tk.tries), task: tk, tok: tok, ref: ref}
	m.attempts = append(m.attempts, a)
	if holder != nil {
		t.Logf("%s → %s runs (took the lock over from orphan %s)", what, a.label, holder.label)
	} else {
		t.Logf("%s → %s runs", what, a.label)
	}
}

func (m *modelRun) heartbeat(t *rapid.T) {
	a := m.drawAttempt(t)
	want := m.owner(a)
	ok, err := m.h.d.extend(context.Background(), a.ref, a.tok, modelLease)
	if err != nil || ok != want {
		m.diverge(t, "heartbeat: renewal differs from the model", "heartbeat %s: %v, %v; model: owner %v", a.label, ok, err, want)
	}
	t.Logf("heartbeat %s → renewed %v", a.label, ok)
}

// finishOutcomes: how an attempt ends, and what asynq then does with the
// task's record if the attempt is the one asynq is running.
var finishOutcomes = []string{"success", "success, result retained", "revoked", "final failure", "failure, retry left"}

func (m *modelRun) finish(t *rapid.T) {
	a := m.drawAttempt(t)
	outcome := rapid.SampledFrom(finishOutcomes).Draw(t, "outcome")
	m.settle(t, a, outcome, nil)
}

// settle ends attempt a: the middleware's finish, then asynq's bookkeeping.
// With fail, the finish call meets a Redis error.
func (m *modelRun) settle(t *rapid.T, a *mAttempt, outcome string, fault *faultMode) {
	t.Helper()
	release := outcome != "failure, retry left"
	want := m.owner(a)
	if fault != nil {
		m.faults.arm(1, *fault)
	}
	ok, follow, err := m.h.d.finish(context.Background(), a.ref, a.tok, release, modelHeldTTL, modelTTL)
	fired := m.faults.disarm()
	what := fmt.Sprintf("%s ends: %s", a.label, outcome)
	if fault != nil {
		if len(fired) != 1 || !errors.Is(err, errInjected) {
			m.diverge(t, "finish with Redis failing: not the injected error", "%s, Redis failing: %v, %v, %v (failed: %v); want the injected error", what, ok, follow, err, fired)
		}
		what += fmt.Sprintf(" (its lock call %s)", *fault)
		// It fails no task. Had the call run, it did what it does.
		ok, err = want && *fault == lost, nil
	}
	switch {
	case fault == nil && (err != nil || ok != want || follow != ""):
		m.diverge(t, "finish: ownership differs from the model", "%s: owned %v, follow-up %q, %v; model: owner %v", what, ok, follow, err, want)
	case ok && release:
		m.release(a.task.key)
		what += " → released"
	case ok:
		l := m.locks[a.task.key]
		l.tok, l.phase = "", heldPhase
		what += " → held for the retry"
	case fault != nil && *fault == blip && want:
		what += " → lock left to expire"
	default:
		what += " → not the owner: lock untouched"
	}
	if a.task.latest == a.tok && a.task.state == "active" {
		switch outcome {
		case "success", "revoked":
			m.setState(t, a.task, "")
		case "success, result retained":
			m.setState(t, a.task, "completed")
		case "final failure":
			m.setState(t, a.task, "archived")
		default:
			m.setState(t, a.task, "retry")
		}
		what += fmt.Sprintf("; asynq: %s %s", a.task.label, stateWord(a.task.state))
	}
	m.dropAttempt(a)
	t.Logf("%s", what)
}

// crash: the worker dies; the attempt never ends. asynq keeps the task
// active until it recovers it.
func (m *modelRun) crash(t *rapid.T) {
	a := m.drawAttempt(t)
	m.dropAttempt(a)
	t.Logf("worker of %s crashes", a.label)
}

// recoverTask: asynq's recoverer finds an active task whose worker is gone
// (or stalled: its attempt may still be running) and queues it for a retry.
func (m *modelRun) recoverTask(t *rapid.T) {
	tk := m.drawTask(t, func(tk *mTask) bool { return tk.state == "active" })
	m.setState(t, tk, "retry")
	tk.latest = ""
	t.Logf("asynq recovers %s: retry", tk.label)
}

// expire: the lock's lifetime runs out (lease of a crashed or stalled
// worker, or the waiting/retry TTL), and with it its holder's index, which
// always gets the same lifetime.
func (m *modelRun) expire(t *rapid.T) {
	k := m.drawKey(t, func(l *mLock) bool { return l != nil })
	l := m.locks[k]
	if err := m.raw.Del(context.Background(), m.keys[k], indexKey(m.h.prefix, m.queue, l.holder.id)).Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("lock %s (%s, held by %s) expires", modelKeys[k], l.phase, l.holder.label)
	m.release(k)
}

// age: the lock grows older than the heal grace.
func (m *modelRun) age(t *rapid.T) {
	k := m.drawKey(t, func(l *mLock) bool { return l != nil && !l.old })
	if err := m.raw.HSet(context.Background(), m.keys[k], "c", 0).Err(); err != nil {
		t.Fatal(err)
	}
	m.locks[k].old = true
	t.Logf("lock %s (held by %s) ages past the heal grace", modelKeys[k], m.locks[k].holder.label)
}

// taskGone: someone deletes or archives a task by hand (Inspector, CLI),
// or asynq's retention of a completed one runs out.
func (m *modelRun) taskGone(t *rapid.T) {
	tk := m.drawTask(t, func(tk *mTask) bool { return tk.state != "" && tk.state != "active" })
	to := ""
	if waitingState(tk.state) && rapid.Bool().Draw(t, "archive") {
		to = "archived"
	}
	from := tk.state
	m.setState(t, tk, to)
	t.Logf("%s (%s) %s by hand", tk.label, from, stateWord(to))
}

// redisError: one operation meets Redis failing.
func (m *modelRun) redisError(t *rapid.T) {
	ops := []string{"enqueue"}
	for _, tk := range m.tasks {
		if waitingState(tk.state) {
			ops = append(ops, "start")
			break
		}
	}
	if len(m.attempts) > 0 {
		ops = append(ops, "heartbeat", "finish")
	}
	op := rapid.SampledFrom(ops).Draw(t, "op")
	if op == "enqueue" {
		m.enqueueFailing(t)
		return
	}
	// The other operations are one lock call each.
	mode := rapid.SampledFrom([]faultMode{blip, lost}).Draw(t, "redis")
	switch op {
	case "start":
		m.startFailing(t, mode)
	case "heartbeat":
		a := m.drawAttempt(t)
		m.faults.arm(1, mode)
		_, err := m.h.d.extend(context.Background(), a.ref, a.tok, modelLease)
		fired := m.faults.disarm()
		if len(fired) != 1 || !errors.Is(err, errInjected) {
			m.diverge(t, "heartbeat with Redis failing: not the injected error", "heartbeat %s, Redis failing: %v (failed: %v); want the injected error", a.label, err, fired)
		}
		t.Logf("heartbeat %s: its lock call %s", a.label, mode)
	case "finish":
		a := m.drawAttempt(t)
		m.settle(t, a, rapid.SampledFrom(finishOutcomes).Draw(t, "outcome"), &mode)
	}
}

// startFailing: the start lock call of an attempt fails; the middleware
// returns ErrUnavailable without running the handler, and asynq retries the
// task. If the call ran on Redis, it took the lock all the same, under a
// token no handler has.
func (m *modelRun) startFailing(t *rapid.T, mode faultMode) {
	tk := m.drawTask(t, func(tk *mTask) bool { return waitingState(tk.state) })
	ref := m.ref(t, tk)
	taken, holder := m.predictStart(tk)
	m.setState(t, tk, "active")
	tok := newToken()
	m.faults.arm(1, mode)
	_, _, err := m.h.d.start(context.Background(), ref, tok, RunningReject)
	fired := m.faults.disarm()
	if len(fired) != 1 || !errors.Is(err, errInjected) {
		m.diverge(t, "start with Redis failing: not the injected error", "start %s, Redis failing: %v (failed: %v); want the injected error", tk.label, err, fired)
	}
	what := fmt.Sprintf("start %s: its lock call %s; not run, asynq retries it", tk.label, mode)
	if l := m.locks[tk.key]; mode == lost && taken && ref.FP != "" && !tk.index && isLockedID(tk.id) && (l == nil || l.holder != tk || !l.stored) {
		// A task locked at enqueue tries begin first (the common case);
		// here begin declines, and its lost reply ends the start there.
		taken = false
		what += "; its first call (begin) declined, so nothing changed"
	}
	if mode == lost && taken {
		l := m.locks[tk.key]
		if l == nil || l.holder != tk {
			if holder != nil {
				holder.index = false
			}
			l = &mLock{holder: tk}
			m.locks[tk.key] = l
		}
		l.tok, l.phase, l.stored = tok, runningPhase, true
		what += "; the lock is its, under a token no handler has"
	}
	m.setState(t, tk, "retry")
	t.Logf("%s", what)
}

// enqueueFailing: an enqueue (generated ID) meets Redis failing at its
// at-th command.
func (m *modelRun) enqueueFailing(t *rapid.T) {
	k := m.drawKey(t, nil)
	policy := rapid.SampledFrom([]Conflict{Reject, Replace}).Draw(t, "policy")
	kind, holder := m.predictEnqueue(k, policy, nil)
	if kind == enqReserved {
		policy = Reject // keep the step fast; that wait is covered by Enqueue
		kind, holder = m.predictEnqueue(k, policy, nil)
	}
	at := rapid.IntRange(1, 3).Draw(t, "failAtCommand")
	mode := rapid.SampledFrom([]faultMode{blip, down, lost}).Draw(t, "redis")
	failOpen := rapid.Bool().Draw(t, "failOpen")
	c := m.h.client
	if failOpen {
		c = m.open.client
	}
	marker := m.marker()
	m.faults.arm(at, mode)
	res, err := m.submit(context.Background(), c, k, policy, "", marker)
	fired := m.faults.disarm()
	how := "fail-closed"
	if failOpen {
		how = "fail-open"
	}
	what := fmt.Sprintf("enqueue %s on %s (%s, %s): Redis command %d %s", marker, modelKeys[k], policy, how, at, mode)
	switch {
	case len(fired) == 0: // the call was over before the failure
		m.expectEnqueue(t, what+" (not reached)", k, "", kind, holder, marker, res, err)
	case fired[0] == "script:acquire" && mode == lost:
		m.lostAcquire(t, what, k, kind, holder, failOpen, marker, res, err)
	case fired[0] == "script:acquire" && failOpen && mode == blip:
		// Fail-open: enqueued without the lock; the lock is untouched.
		if err != nil {
			m.diverge(t, "fail-open enqueue: not created without the lock", "%s: %v; model: created unlocked (fail-open)", what, err)
		}
		tk := m.created(t, what, k, "", marker, res)
		t.Logf("%s → lock call failed, created %s without the lock", what, tk.label)
	case fired[0] == "script:acquire":
		if err == nil || (!failOpen && (!errors.Is(err, ErrUnavailable) || !errors.Is(err, errInjected))) {
			m.diverge(t, "enqueue with the lock call failing: not the expected error", "%s: %+v, %v; model: error (ErrUnavailable when fail-closed), nothing changes", what, res, err)
		}
		t.Logf("%s → lock call failed: error, nothing changes", what)
	case kind != enqCreated:
		m.diverge(t, "enqueue: commands failed after a lock call that ends the enqueue", "%s: commands %v failed after a lock call that should have ended the enqueue (%s)", what, fired, kind)
	case mode == lost && fired[0] == "sadd":
		// asynq registered the queue, then gave up: nothing stored, and the
		// rollback gives the lock back.
		if err == nil {
			m.diverge(t, "enqueue: asynq failed but no error returned", "%s: %+v; asynq's enqueue failed (%v), want an error", what, res, fired)
		}
		m.release(k)
		t.Logf("%s → asynq's enqueue failed (%s): lock given back", what, fired[0])
	case mode == lost:
		// asynq stored the task but its reply was lost: the rollback finds
		// it stored, keeps the lock and returns it.
		m.expectEnqueue(t, what+" (asynq's reply)", k, "", kind, holder, marker, res, err)
	case err == nil:
		m.diverge(t, "enqueue: asynq failed but no error returned", "%s: %+v; asynq's enqueue failed (%v), want an error", what, res, fired)
	case mode == blip:
		// asynq failed; the rollback found no task and gave the lock back
		// (after healing the orphan it replaced, if any).
		m.release(k)
		t.Logf("%s → asynq's enqueue failed (%s): lock given back", what, fired[0])
	default:
		// asynq failed and the rollback could not look: the lock stays with
		// a task that was never stored, until it is healed or expires.
		m.ghost(t, what, k, marker)
		t.Logf("%s → asynq's enqueue failed (%v), rollback too: lock left to %s, never stored", what, fired, m.locks[k].holder.label)
	}
}

// ghost records that key k's lock was left to a new task ID that was never
// stored in asynq.
func (m *modelRun) ghost(t *rapid.T, what string, k int, marker string) {
	t.Helper()
	raw, err := m.raw.HGet(context.Background(), m.keys[k], "id").Result()
	id := ownerIn(m.keys[k], raw)
	if err != nil || m.byID[id] != nil {
		m.diverge(t, "enqueue: lock owner is not a fresh unstored task", "%s: lock owner %q (%v); model: a new task that was never stored", what, id, err)
	}
	if fp, ok := parseLockedID(id); !ok || fp != m.fps[k] {
		m.diverge(t, "enqueue: lock owner is not a task ID of this key", "%s: lock owner %q is not a task ID of this key", what, id)
	}
	m.release(k)
	g := m.addTask(id, k, false, true)
	g.payload = marker
	m.locks[k] = &mLock{holder: g}
}

// lostAcquire: the acquire script ran on Redis but its reply was lost.
func (m *modelRun) lostAcquire(t *rapid.T, what string, k int, kind enqKind, holder *mTask, failOpen bool, marker string, res Result, err error) {
	t.Helper()
	if kind == enqReplaced {
		holder.payload = marker // it ran: the caller cannot tell
	}
	if failOpen {
		// Enqueued anyway, under the ID the client chose before the lock
		// call: the lock, if the script took it, is the new task's.
		if err != nil {
			m.diverge(t, "fail-open enqueue: not created after a lost lock reply", "%s: %v; model: created (fail-open)", what, err)
		}
		tk := m.created(t, what, k, "", marker, res)
		if kind == enqCreated {
			if holder != nil {
				holder.index = false
			}
			m.locks[k] = &mLock{holder: tk}
			t.Logf("%s → created %s, which holds the lock the lost call took", what, tk.label)
		} else {
			t.Logf("%s → created %s without the lock (the lost call: %s)", what, tk.label, kind)
		}
		return
	}
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, errInjected) {
		m.diverge(t, "enqueue with a lost lock reply: not ErrUnavailable", "%s: %+v, %v; model: ErrUnavailable", what, res, err)
	}
	if kind == enqCreated {
		// README, "When Redis fails": "A lock call that times out may still
		// have run on the server: a lock taken for a task that was never
		// enqueued blocks its key only until HealGrace".
		m.ghost(t, what, k, marker)
		t.Logf("%s → ErrUnavailable; the lock stays with %s, never stored", what, m.locks[k].holder.label)
		return
	}
	t.Logf("%s → ErrUnavailable (the lost call: %s)", what, kind)
}

// Invariants.

var lockFields = map[string]bool{"id": true, "c": true, "tok": true, "n": true, "v": true, "ty": true, "kf": true}

// band is the lifetime a lock (and its holder's index) has in a phase.
func band(p phase) (lo, hi time.Duration) {
	switch p {
	case waitingPhase:
		return modelLease, modelTTL
	case heldPhase:
		return modelTTL, modelHeldTTL
	}
	return 0, modelLease
}

func (m *modelRun) check(t *rapid.T) {
	ctx := context.Background()
	pipe := m.raw.Pipeline()
	var locks [2]*redis.MapStringStringCmd
	var ttls [2]*redis.DurationCmd
	for k := range m.keys {
		locks[k] = pipe.HGetAll(ctx, m.keys[k])
		ttls[k] = pipe.PTTL(ctx, m.keys[k])
	}
	recs := make([]*redis.SliceCmd, len(m.tasks))
	idxs := make([]*redis.StringCmd, len(m.tasks))
	idxTTLs := make([]*redis.DurationCmd, len(m.tasks))
	for i, tk := range m.tasks {
		recs[i] = pipe.HMGet(ctx, asynqTaskKeyPrefix(m.queue)+tk.id, "state", "msg")
		idxs[i] = pipe.Get(ctx, indexKey(m.h.prefix, m.queue, tk.id))
		idxTTLs[i] = pipe.PTTL(ctx, indexKey(m.h.prefix, m.queue, tk.id))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		t.Fatalf("reading state: %v", err)
	}
	for k, want := range m.locks {
		got := locks[k].Val()
		name := modelKeys[k]
		if want == nil {
			if len(got) != 0 {
				m.diverge(t, "lock held where the model has it free", "lock %s is %v (owner %s); model: free", name, got, m.labelOf(ownerIn(m.keys[k], got["id"])))
			}
			continue
		}
		if len(got) == 0 {
			m.diverge(t, "lock free where the model has it held", "lock %s is free; model: held by %s", name, want.holder.label)
		}
		if owner := ownerIn(m.keys[k], got["id"]); owner != want.holder.id || got["tok"] != want.tok {
			m.diverge(t, "lock owner or attempt token differs from the model", "lock %s: owner %s token %q; model: owner %s token %q", name, m.labelOf(owner), got["tok"], want.holder.label, want.tok)
		}
		for f := range got {
			if !lockFields[f] {
				m.diverge(t, "lock has an unexpected field", "lock %s: unexpected field %q in %v", name, f, got)
			}
		}
		if (got["v"] == "1") != want.stored {
			m.diverge(t, "lock's stored mark differs from the model", "lock %s: v=%q; model: written with its task %v", name, got["v"], want.stored)
		}
		if c, err := strconv.ParseInt(got["c"], 10, 64); err != nil || (c == 0) != want.old {
			m.diverge(t, "lock age differs from the model", "lock %s: created %q; model: older than the heal grace %v", name, got["c"], want.old)
		}
		if lo, hi := band(want.phase); ttls[k].Val() <= lo || ttls[k].Val() > hi {
			m.diverge(t, "lock lifetime does not fit its phase", "lock %s: lifetime %v; model: %s, in (%v, %v]", name, ttls[k].Val(), want.phase, lo, hi)
		}
	}
	running := map[int]string{}
	for _, a := range m.attempts {
		if m.owner(a) {
			if other, ok := running[a.task.key]; ok {
				m.diverge(t, "two attempts own one key", "key %s: attempts %s and %s both own it", modelKeys[a.task.key], other, a.label)
			}
			running[a.task.key] = a.label
		}
	}
	for i, tk := range m.tasks {
		v := recs[i].Val()
		state, _ := v[0].(string)
		if state != tk.state {
			m.diverge(t, "asynq task state differs from the model", "task %s: asynq state %q; model %q", tk.label, state, tk.state)
		}
		if msg, _ := v[1].(string); state != "" && !strings.Contains(msg, `"`+tk.payload+`"`) {
			m.diverge(t, "stored payload differs from the model", "task %s: stored payload lacks %s; model: last written by that enqueue", tk.label, tk.payload)
		}
		fp, err := idxs[i].Result()
		switch {
		case errors.Is(err, redis.Nil) && !tk.index:
		case errors.Is(err, redis.Nil):
			m.diverge(t, "index missing where the model has one", "task %s: no index; model: index to %s", tk.label, modelKeys[tk.key])
		case !tk.index:
			m.diverge(t, "index present where the model has none", "task %s: index %q (lifetime %v); model: none", tk.label, fp, idxTTLs[i].Val())
		case fp != m.fps[tk.key]:
			m.diverge(t, "index points to the wrong lock", "task %s: index %q; model: %s (%s)", tk.label, fp, modelKeys[tk.key], m.fps[tk.key])
		}
		if l := m.locks[tk.key]; tk.index {
			if l == nil || l.holder != tk {
				m.diverge(t, "model: index of a task not holding its key", "task %s has an index but does not hold %s", tk.label, modelKeys[tk.key])
			}
			if lo, hi := band(l.phase); idxTTLs[i].Val() <= lo || idxTTLs[i].Val() > hi {
				m.diverge(t, "index lifetime does not fit its lock's phase", "task %s: index lifetime %v; model: lock %s, in (%v, %v]", tk.label, idxTTLs[i].Val(), l.phase, lo, hi)
			}
		}
	}
}

// diverge fails the run. The failure message names only the kind of
// divergence, the same in every run that shows it, so that rapid can shrink
// the sequence; the details and the model's state go to the log, which rapid
// prints for the shrunk sequence.
func (m *modelRun) diverge(t *rapid.T, kind, format string, args ...any) {
	t.Helper()
	t.Logf("DIVERGENCE: "+format, args...)
	t.Logf("%s", m.dump())
	t.Fatalf("model divergence: %s", kind)
}

func (m *modelRun) dump() string {
	var b strings.Builder
	b.WriteString("model:\n")
	for k, l := range m.locks {
		if l == nil {
			fmt.Fprintf(&b, "  lock %s: free\n", modelKeys[k])
			continue
		}
		tok := "-"
		for _, a := range m.attempts {
			if a.tok == l.tok && a.task == l.holder {
				tok = a.label
			}
		}
		if l.tok != "" && tok == "-" {
			tok = "a crashed attempt"
		}
		fmt.Fprintf(&b, "  lock %s: %s by %s, attempt %s, old %v\n", modelKeys[k], l.phase, l.holder.label, tok, l.old)
	}
	for _, tk := range m.tasks {
		fmt.Fprintf(&b, "  task %s (%s): key %s, asynq %s, payload %s, index %v\n", tk.label, tk.id, modelKeys[tk.key], stateWord(tk.state), tk.payload, tk.index)
	}
	labels := make([]string, len(m.attempts))
	for i, a := range m.attempts {
		labels[i] = a.label
	}
	sort.Strings(labels)
	fmt.Fprintf(&b, "  attempts running: %v", labels)
	return b.String()
}

// Redis errors on demand.

var errInjected = errors.New("model: injected Redis error")

// faultMode says how the armed command fails.
type faultMode int

const (
	blip faultMode = iota // the at-th command fails before reaching Redis
	down                  // the at-th and every later command fail before reaching Redis
	lost                  // the at-th command runs on Redis, but its reply is lost
)

func (f faultMode) String() string {
	return [...]string{"fails", "fails, and Redis stays down", "runs but its reply is lost"}[f]
}

// faults is a go-redis hook failing commands while armed. Connection set-up
// commands are neither counted nor failed. It records the commands it
// failed, naming this package's scripts.
type faults struct {
	mu      sync.Mutex
	armed   bool
	at, n   int
	mode    faultMode
	fired   []string
	scripts map[string]string // SHA1 → script name
}

func newFaults() *faults {
	f := &faults{scripts: map[string]string{}}
	for _, name := range []string{"acquire", "start", "extend", "finish", "unlock", "coalesce"} {
		f.scripts[store.ScriptHash(name)] = name
	}
	// The replace script is acquire's first step when the holder is known:
	// the model sees one lock call either way.
	f.scripts[store.ScriptHash("replace")] = "acquire"
	return f
}

func (f *faults) arm(at int, mode faultMode) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed, f.at, f.mode, f.n, f.fired = true, at, mode, 0, nil
}

// disarm stops failing and returns the commands that failed.
func (f *faults) disarm() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed = false
	return f.fired
}

var setupCommands = map[string]bool{"hello": true, "auth": true, "client": true, "select": true, "readonly": true}

// trip counts cmd and says whether it fails, and if so whether it runs first.
func (f *faults) trip(cmd redis.Cmder) (fail, run bool) {
	name := strings.ToLower(cmd.Name())
	if setupCommands[name] {
		return false, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.armed {
		return false, false
	}
	f.n++
	if f.n != f.at && !(f.mode == down && f.n > f.at) {
		return false, false
	}
	if args := cmd.Args(); len(args) > 1 && (name == "eval" || name == "evalsha") {
		if s, ok := args[1].(string); ok {
			sha := s
			if name == "eval" {
				sum := sha1.Sum([]byte(s))
				sha = hex.EncodeToString(sum[:])
			}
			if n, ok := f.scripts[sha]; ok {
				name = "script:" + n
			}
		}
	}
	f.fired = append(f.fired, name)
	return true, f.mode == lost
}

func (f *faults) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f *faults) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		fail, run := f.trip(cmd)
		if run {
			err := next(ctx, cmd)
			if isNeed(cmd) {
				f.untrip() // it changed nothing: the fault waits for the call that works
				return err
			}
		}
		if fail {
			cmd.SetErr(errInjected)
			return errInjected
		}
		return next(ctx, cmd)
	}
}

func (f *faults) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		fail, run := false, false
		tripped := make([]bool, len(cmds))
		for i, c := range cmds {
			if fl, r := f.trip(c); fl {
				fail, run, tripped[i] = true, run || r, true
			}
		}
		if run {
			err := next(ctx, cmds)
			fail = false
			for i, c := range cmds {
				if tripped[i] && isNeed(c) {
					f.untrip()
				} else if tripped[i] {
					fail = true
				}
			}
			if !fail {
				return err
			}
		}
		if fail {
			for _, c := range cmds {
				c.SetErr(errInjected)
			}
			return errInjected
		}
		return next(ctx, cmds)
	}
}

// isNeed reports whether cmd ran a script that changed nothing and is
// followed by another: one that answered that it lacks keys (internal/
// store's roles), or the replace script finding it does not apply.
func isNeed(cmd redis.Cmder) bool {
	c, ok := cmd.(*redis.Cmd)
	if !ok || c.Err() != nil {
		return false
	}
	arr, ok := c.Val().([]any)
	if !ok || len(arr) == 0 {
		return false
	}
	st, ok := arr[0].(int64)
	if ok && st == 0 && len(c.Args()) > 1 {
		sha, _ := c.Args()[1].(string)
		return sha == store.ScriptHash("replace")
	}
	return ok && st == 11
}

// untrip takes back the last trip.
func (f *faults) untrip() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if len(f.fired) > 0 {
		f.fired = f.fired[:len(f.fired)-1]
	}
}

// isLockedID reports whether id is one the wrapper makes for a task it
// locks at enqueue.
func isLockedID(id string) bool {
	_, ok := store.ParseLockedID(id)
	return ok
}
