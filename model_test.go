package dedup

import (
	"context"
	"crypto/sha1"
	"errors"
	"flag"
	"fmt"
	"os"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"
	"pgregory.net/rapid"
)

// TestModel drives the library against a small in-memory reference model of
// the lock's intended semantics (docs/lifecycle.md), with rapid's shrinking
// state machine. A step is one of:
//
//   - an enqueue through Client.Submit on either path (NewClient's direct
//     path, WrapClient over asynq's client), Reject or Replace, a generated
//     or caller-chosen task ID (c1, c2: usable on either key once no task
//     has it), sometimes with asynq.Retention, sometimes repeating the
//     payload of its caller ID's live task, over two keys of one queue;
//   - an attempt of a waiting task (a retry or a busy task's copy forwarded
//     first) through the middleware itself, d.Middleware(), called with the
//     context asynq's processor builds, whose handler succeeds, is revoked,
//     fails with a retry left or for good, or returns SkipRetry;
//   - a worker crash: the middleware's steps up to the handler (process,
//     start), and no end; asynq's recoverer later retries (or archives) it;
//   - an operator deleting, archiving or running again (an archived task)
//     through asynq's Inspector;
//   - a lock's TTL running out, a WrapClient lock ageing past HealGrace;
//   - a Redis error on one call: an enqueue's lock script, or the first
//     call the middleware makes for an attempt (at its start, or its end).
//
// asynq's side of an attempt is done as asynq's own scripts do it: the
// dequeue (state active), then by the middleware's answer what its done,
// markAsComplete, retry or archive script does to the task's record, its
// lists and the unique key its message names (done: delete the record and
// compare-and-delete the unique key; retry: state retry, one retry used
// unless dedup.IsFailure says no failure; archive: state archived, the
// unique key kept).
//
// After every step the locks in Redis (holder, value form, age, lifetime),
// the keys' mode records and every task's asynq record (state, payload,
// retries used, the unique key it and its message name, the dedup-lost
// mark) must equal the model's, and these must hold: a key never has two
// live tasks that hold it (but after a documented TTL expiry); a duplicate
// names the live holder; a handler runs only while its task holds its key,
// and never beside a started handler of another task of the key; a healed
// over archived task run by hand waits behind the new holder (a BusyError,
// or on its last attempt a copy); a success or revoke frees its key (asynq's
// compare-and-delete, or the middleware's release); a final failure leaves
// the key to heal at the next enqueue; Replace writes the newest payload
// into the waiting holder; a failed Redis call fails closed. A divergence
// fails with the shrunk sequence of steps, each logged in words, and the
// model's state.
//
// Left out: Merge, RunningAllow, RunningDefer, Cooldown, Period, OnFailure,
// MaxPending, Debounce, scheduled enqueues, relocation, fail-open, asynq
// giving an attempt up (deadline, CancelProcessing), the heartbeat
// (handlers return at once), and real time: nothing expires or ages by
// itself during a run (lifetimes are an hour and more); expiry and ageing
// are steps.
func TestModel(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	needRealRedis(t)
	rapidDefault(t, "rapid.checks", "500")
	rapidDefault(t, "rapid.steps", "30")
	w := newModelWorld(t)
	var run int
	rapid.Check(t, func(rt *rapid.T) {
		run++
		m := w.newRun(rt, run)
		rt.Repeat(map[string]func(*rapid.T){"step": m.step, "": m.check})
	})
}

// step draws one of the actions the model's state allows (rapid's own
// choice among fixed actions would skip most of them in sparse states) and
// takes it.
func (m *modelRun) step(t *rapid.T) {
	actions := map[string]func(*rapid.T){"Enqueue": m.enqueue}
	names := []string{"Enqueue", "Enqueue"} // twice: the key's traffic
	add := func(name string, f func(*rapid.T), ok bool) {
		if ok {
			actions[name] = f
			names = append(names, name)
		}
	}
	waiting, archived, completed, crashed := false, false, false, false
	for _, x := range m.tasks {
		if m.byID[x.id] == x {
			waiting = waiting || waitingState(x.state)
			archived = archived || x.state == store.StateArchived
			completed = completed || x.state == store.StateCompleted
			crashed = crashed || x.crashed
		}
	}
	locked, young := false, false
	for _, l := range m.locks {
		locked = locked || l != nil
		young = young || l != nil && l.form == store.HoldWrap && !l.aged
	}
	add("Run", m.run, waiting)
	add("Run", m.run, waiting) // twice: attempts are the other half of the traffic
	add("Crash", m.crash, waiting)
	add("Recover", m.recoverTask, crashed)
	add("Delete", m.deleteTask, waiting || archived || completed)
	add("Archive", m.archiveTask, waiting)
	add("RunByHand", m.runByHand, archived)
	add("Expire", m.expire, locked)
	add("Age", m.age, young)
	add("RedisError enqueue", func(t *rapid.T) { m.enqueueWith(t, true) }, true)
	add("RedisError run", func(t *rapid.T) { m.runWith(t, true) }, waiting)
	actions[rapid.SampledFrom(names).Draw(t, "action")](t)
}

// rapidDefault sets one of rapid's flags for this test, unless the command
// line or the environment (RAPID_CHECKS, ...) set it, and puts it back
// afterwards.
func rapidDefault(t *testing.T, name, value string) {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	_, env := os.LookupEnv(strings.ToUpper(strings.ReplaceAll(name, ".", "_")))
	f := flag.Lookup(name)
	if set || env || f == nil {
		return
	}
	old := f.Value.String()
	if err := f.Value.Set(value); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Value.Set(old) })
}

// Lifetimes far apart, so that a lock's remaining lifetime tells its phase:
// waiting (or running) ≤ TTL < held across a retry ≤ TTL + retry delay.
// Nothing expires or ages by itself during a run; those are steps.
const (
	modelTTL      = time.Hour
	modelRetry    = 10 * time.Hour
	modelHeldTTL  = modelRetry + modelTTL
	modelGrace    = time.Hour
	modelMaxRetry = 1 // the second failure archives the task
	modelType     = "model:job"
)

// The key is the payload's "k" field (a type rule); "m" carries a marker
// unique to each enqueue.
var modelKeys = [2]string{"k0", "k1"}

func modelPayload(k int, marker string) []byte {
	return []byte(`{"k":"` + modelKeys[k] + `","m":"` + marker + `"}`)
}

// modelWorld is what the runs share: one Dedup, its two clients, its
// middleware, and the means to call the middleware as asynq does.
type modelWorld struct {
	h      *harness // its Dedup's Redis client fails a call on demand (faults)
	faults *modelFaults
	direct *Client // NewClient: the lock script stores the task
	wrap   *Client // WrapClient over asynq's client
	mw     asynq.MiddlewareFunc
	meta   asynqMeta
	insp   *asynq.Inspector      // asynq's, on raw
	raw    redis.UniversalClient // a client that never fails, for asynq's side and the checks
}

func newModelWorld(t *testing.T) *modelWorld {
	cfg := Config{
		TTL:              modelTTL,
		healGrace:        modelGrace, // never reached by the clock: the Age step ages a lock
		LockTimeout:      10 * time.Second,
		RetryDelayFunc:   func(int, error, *asynq.Task) time.Duration { return modelRetry },
		Rules:            map[string]Rule{modelType: {Fields: []string{"k"}}},
		BreakerThreshold: -1, // a failed call fails alone
		MaxBatch:         -1, // each call its own round trip, so that the faults hit one
	}
	faulty, raw := newRDB(t), newRDB(t)
	f := newModelFaults()
	faulty.AddHook(f)
	h := newHarnessOn(t, faulty, cfg)
	recheckAlways(h.d)
	w := &modelWorld{h: h, faults: f, direct: h.d.NewClient(), wrap: h.d.WrapClient(asynq.NewClientFromRedisClient(raw)),
		insp: asynq.NewInspectorFromRedisClient(raw), raw: raw}
	w.wrap.place.state.Store(placeHere) // no probes: the tasks are here
	w.meta = captureAsynqMeta(t, h)
	w.mw = h.d.Middleware()
	t.Cleanup(func() { w.deleteMatching(h.prefix + ":*") })
	return w
}

// recheckAlways gives d a store that reads the holder's record on every
// plain rejection (store.Config.Recheck < 0), as the model does; the
// default answers from the lock alone for a second after a read.
func recheckAlways(d *Dedup) {
	cfg := d.storeConfig()
	cfg.Recheck = -1
	d.store = store.New(d.store.Client(), cfg)
}

// deleteMatching deletes the keys matching pattern: the shared Redis is
// never flushed.
func (w *modelWorld) deleteMatching(pattern string) {
	ctx := context.Background()
	iter := w.raw.Scan(ctx, 0, pattern, 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if len(keys) > 0 {
		_ = w.raw.Del(ctx, keys...).Err()
	}
}

// asynqMeta builds the context asynq's processor hands a handler: its
// task metadata (ID, queue, retries used, max retry) lives under a key of
// asynq's internal/context, which no exported API writes. The key and the
// value's type are read once from a context a real asynq server made.
type asynqMeta struct {
	key any
	typ reflect.Type
}

func captureAsynqMeta(t *testing.T, h *harness) asynqMeta {
	t.Helper()
	queue := h.queue + "-meta"
	got := make(chan context.Context, 1)
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{queue: 1},
		TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel})
	handler := func(ctx context.Context, _ *asynq.Task) error {
		select {
		case got <- ctx:
		default:
		}
		return nil
	}
	if err := srv.Start(asynq.HandlerFunc(handler)); err != nil {
		t.Fatal(err)
	}
	if _, err := h.asynq.Enqueue(asynq.NewTask("model:meta", nil), asynq.Queue(queue)); err != nil {
		t.Fatal(err)
	}
	ctx := waitFor(t, got, "asynq's handler context")
	srv.Shutdown()
	_ = h.insp.DeleteQueue(queue, true)
	a := metadataOf(t, ctx)
	c, cancel := a.ctx("id-1", "q-1", 2, 5)
	defer cancel()
	id, _ := asynq.GetTaskID(c)
	q, _ := asynq.GetQueueName(c)
	n, _ := asynq.GetRetryCount(c)
	mx, _ := asynq.GetMaxRetry(c)
	if id != "id-1" || q != "q-1" || n != 2 || mx != 5 {
		t.Fatalf("asynq's task metadata cannot be built: read back %q %q %d %d", id, q, n, mx)
	}
	return a
}

// metadataOf finds the value asynq put in a handler's context.
func metadataOf(t *testing.T, ctx context.Context) asynqMeta {
	t.Helper()
	for c := any(ctx); c != nil; {
		v := reflect.ValueOf(c)
		if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
			break
		}
		e := v.Elem()
		if key, ok := unexported(e, "key"); ok {
			val, _ := unexported(e, "val")
			if ty := reflect.TypeOf(val); ty != nil && strings.HasPrefix(ty.PkgPath(), "github.com/hibiken/asynq") {
				return asynqMeta{key: key, typ: ty}
			}
		}
		parent, ok := unexported(e, "Context")
		if !ok {
			break
		}
		c = parent
	}
	t.Fatal("no asynq task metadata in the handler's context")
	return asynqMeta{}
}

// unexported reads field name of the addressable struct e, exported or not.
func unexported(e reflect.Value, name string) (any, bool) {
	f := e.FieldByName(name)
	if !f.IsValid() {
		return nil, false
	}
	return reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Interface(), true
}

// ctx is the context asynq's processor gives an attempt of task id.
func (a asynqMeta) ctx(id, queue string, retried, maxRetry int) (context.Context, context.CancelFunc) {
	v := reflect.New(a.typ).Elem()
	set := func(name string, x any) {
		f := v.FieldByName(name)
		reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Set(reflect.ValueOf(x))
	}
	set("id", id)
	set("qname", queue)
	set("retryCount", retried)
	set("maxRetry", maxRetry)
	ctx := context.WithValue(context.Background(), a.key, v.Interface())
	return context.WithDeadline(ctx, time.Now().Add(30*time.Minute))
}

// The model.

// mTask is one task: a generated ID (labelled t1, t2, …), a caller-chosen
// one (c1, c2; an ID used again once its task is gone is a new task,
// c1#2), or the copy of a busy task on its last attempt (t1').
type mTask struct {
	label    string
	id       string
	key      int
	path     string // "direct", "wrap", "self" (its own ID held the key: stored by asynq's client), "copy"
	state    string // asynq's state ("" no record)
	payload  string // the marker its stored payload carries
	retried  int
	lost     bool // marked dedup-lost: healed (its key was healed over while it was archived)
	unique   bool // its record names its lock (unique_key): asynq's DeleteTask releases it
	msgUniq  bool // its message does: asynq's done script compare-and-deletes it
	header   bool // it carries the dedup header (its lock, flags): else its ID's form and record say all
	release  bool // its header's flags say: release the lock at success and revoke
	retain   bool // asynq.Retention: a success leaves it completed
	unlocked bool // its lock expired under it (TTL): the one documented way to run beside another
	crashed  bool // active, its worker dead
	stalled  bool // crashed with its handler started (it may still be running: a hung worker)
}

func (x *mTask) kept() bool { return strings.HasPrefix(x.id, "dk-") }

// exempt: the task may wait beside the key's holder (it lost its key, or
// its lock expired): it checks the key before it runs.
func (x *mTask) exempt() bool { return x.lost || x.unlocked }

type mLock struct {
	holder *mTask
	form   store.Hold // the value's: the ID; ~w<sec>:<ID> taken before asynq's client stored the task; ~a:<ID> taken as it started
	aged   bool       // ~w older than HealGrace
	held   bool       // lengthened across a retry
}

// mMode is a key's mode record: Replace's fold count, about one holder.
type mMode struct {
	id string
	n  int
}

type modelRun struct {
	*modelWorld
	queue   string
	keys    [2]string
	locks   [2]*mLock
	modes   [2]*mMode
	tasks   []*mTask          // every task, in order of appearance
	byID    map[string]*mTask // the task that has the ID now
	markers int
	gen     int
}

func (w *modelWorld) newRun(rt *rapid.T, n int) *modelRun {
	m := &modelRun{modelWorld: w, queue: fmt.Sprintf("%s-%d", w.h.queue, n), byID: map[string]*mTask{}}
	for k := range modelKeys {
		m.keys[k] = w.h.keyOf(asynq.NewTask(modelType, modelPayload(k, "")), m.queue)
	}
	// The one-time checks of a queue new to the process (its registration
	// by the direct path, where the middleware finds its tasks) would be
	// the first Redis calls of some steps, where faults are injected.
	if err := w.h.d.store.PublishQueue(context.Background(), m.queue); err != nil {
		rt.Fatal(err)
	}
	w.h.d.here.Store(m.queue, true)
	rt.Cleanup(m.cleanup)
	return m
}

// cleanup deletes what the run wrote: the shared Redis is never flushed.
func (m *modelRun) cleanup() {
	ctx := context.Background()
	keys := []string{store.NewKeys(m.h.prefix).Wait(m.queue, modelType)}
	for _, k := range m.keys {
		keys = append(keys, k, store.ModeOf(k))
	}
	for _, set := range []string{"pending", "active", "lease", "scheduled", "retry", "archived", "completed"} {
		keys = append(keys, m.asynqKey(set))
	}
	ids, _ := m.raw.ZRange(ctx, store.ScheduledKey(m.queue), 0, -1).Result() // (copies a failed run did not see)
	for _, x := range m.tasks {
		ids = append(ids, x.id)
	}
	for _, id := range ids {
		keys = append(keys, store.TaskKey(m.queue, id))
	}
	_ = m.raw.Del(ctx, keys...).Err()
	_ = m.raw.SRem(ctx, store.QueuesKey, m.queue).Err()
}

func (m *modelRun) marker() string {
	m.markers++
	return "p" + strconv.Itoa(m.markers)
}

func waitingState(s string) bool { return s == "pending" || s == "scheduled" || s == "retry" }

func liveState(s string) bool { return waitingState(s) || s == "active" }

func formWord(f store.Hold) string {
	switch f {
	case store.HoldWrap:
		return "taken before asynq's client stored it"
	case store.HoldStart:
		return "taken as it started"
	}
	return "its ID"
}

func stateWord(s string) string {
	if s == "" {
		return "deleted"
	}
	return s
}

// recState is the state of the holder lock l names, as the scripts should
// read it: its ID's record, but read as completed (gone) when the ID is
// another key's task now, whatever the lock's form (lib.lua's belongs).
func (m *modelRun) recState(l *mLock) string {
	h := l.holder
	if cur := m.byID[h.id]; cur != nil && cur != h && cur.state != "" {
		if cur.key == h.key {
			return cur.state
		}
		return store.StateCompleted
	}
	return h.state
}

// healable reports whether the key's next enqueue takes lock l over at
// once: its holder is gone, and it is not a WrapClient lock within its
// grace.
func (m *modelRun) healable(l *mLock) bool {
	st := m.recState(l)
	return !liveState(st) && (st != "" || l.form != store.HoldWrap || l.aged)
}

func (m *modelRun) addTask(x *mTask) *mTask {
	if x.label == "" {
		n := 0
		for _, y := range m.tasks {
			if y.id == x.id {
				n++
			}
		}
		x.label = x.id
		if n > 0 {
			x.label = fmt.Sprintf("%s#%d", x.id, n+1)
		}
	}
	m.tasks = append(m.tasks, x)
	m.byID[x.id] = x
	return x
}

func (m *modelRun) labelOfTask(x *mTask) string {
	if x == nil {
		return "-"
	}
	return x.label
}

func (m *modelRun) labelOf(id string) string {
	if x, ok := m.byID[id]; ok {
		return x.label
	}
	if id == "" {
		return `""`
	}
	return "unknown task " + id
}

// fold counts a Replace into holder h of key k in the mode record.
func (m *modelRun) fold(k int, h *mTask) {
	if md := m.modes[k]; md != nil && md.id == h.id {
		md.n++
		return
	}
	m.modes[k] = &mMode{id: h.id, n: 1}
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
	for _, x := range m.tasks {
		if m.byID[x.id] == x && pred(x) {
			labels = append(labels, x.label)
			byLabel[x.label] = x
		}
	}
	if len(labels) == 0 {
		t.Skip("no task in that state")
	}
	return byLabel[rapid.SampledFrom(labels).Draw(t, "task")]
}

// Enqueue.

type enqKind int

const (
	enqCreated  enqKind = iota // the key is free (or healed): a new task holds it
	enqSelf                    // the caller's ID holds the key and has no record: asynq's client stores it under that lock
	enqSame                    // the caller's ID holds the key with this very payload: that task, created
	enqConflict                // the caller's ID is another task's: asynq.ErrTaskIDConflict
	enqDup                     // DuplicateTaskError naming the holder
	enqReplaced                // the payload is written into the waiting holder
	enqReserved                // the holder is a WrapClient lock's whose task is not stored: waited for, in vain
)

func (k enqKind) String() string {
	return [...]string{"created", "created under its own lock", "the same task, created", "ID taken", "duplicate of",
		"replaced into", "waits in vain to be stored:"}[k]
}

// enqCall is one enqueue the model makes.
type enqCall struct {
	k      int
	direct bool // NewClient, else WrapClient
	policy Conflict
	cid    string // caller-chosen ID, "" generated
	marker string
	same   bool // the payload of cid's task, again
	retain bool // asynq.Retention: a success leaves the task completed
}

func (e *enqCall) String() string {
	via := "WrapClient"
	if e.direct {
		via = "NewClient"
	}
	s := fmt.Sprintf("enqueue %s on %s through %s", e.marker, modelKeys[e.k], via)
	if e.cid != "" {
		s += " as " + e.cid
	}
	if e.retain {
		s += ", kept once done"
	}
	return s + " (" + e.policy.String() + ")"
}

func (m *modelRun) drawEnqueue(t *rapid.T) *enqCall {
	e := &enqCall{k: m.drawKey(t, nil), direct: rapid.Bool().Draw(t, "direct"),
		policy: rapid.SampledFrom([]Conflict{Reject, Replace}).Draw(t, "policy"),
		cid:    rapid.SampledFrom([]string{"", "", "c1", "c2"}).Draw(t, "taskID"),
		retain: rapid.IntRange(0, 3).Draw(t, "retention") == 3} // (shrinks to none)
	if x := m.byID[e.cid]; x != nil && liveState(x.state) && rapid.Bool().Draw(t, "samePayload") {
		e.same, e.k, e.marker = true, x.key, x.payload
	} else {
		e.marker = m.marker()
	}
	return e
}

// enqPlan is what the model says an enqueue does: kind, about holder h
// (whose state the script reads as st), having first healed h's lock
// (heal).
type enqPlan struct {
	kind enqKind
	h    *mTask
	st   string
	heal bool
}

// predictEnqueue is the model of an enqueue.
func (m *modelRun) predictEnqueue(e *enqCall) enqPlan {
	l := m.locks[e.k]
	taken := e.cid != "" && m.byID[e.cid] != nil && m.byID[e.cid].state != ""
	if l == nil {
		if taken {
			return enqPlan{kind: enqConflict}
		}
		return enqPlan{kind: enqCreated}
	}
	p := enqPlan{h: l.holder, st: m.recState(l)}
	own := e.cid != "" && p.h.id == e.cid
	switch {
	case own && p.st == "" && l.form == store.HoldStart:
		p.kind, p.heal = enqCreated, true // a start's lock its ID left, whose task is gone, heals (acquire.lua)
	case own && p.st == "":
		p.kind = enqSelf
	case own && !liveState(p.st):
		p.kind = enqConflict // its own task, completed or archived: the ID stays taken
	case waitingState(p.st) && e.policy == Replace:
		p.kind = enqReplaced
	case own && e.same:
		p.kind = enqSame
	case liveState(p.st):
		p.kind = enqDup
	case !m.healable(l) && e.policy == Replace:
		p.kind = enqReserved
	case !m.healable(l):
		p.kind = enqDup
	case taken:
		p.kind, p.heal = enqConflict, true
	default:
		p.kind, p.heal = enqCreated, true
	}
	return p
}

func (m *modelRun) enqueue(t *rapid.T) { m.enqueueWith(t, false) }

// enqueueWith makes an enqueue; with fault, its first Redis call fails.
func (m *modelRun) enqueueWith(t *rapid.T, fault bool) {
	e := m.drawEnqueue(t)
	plan := m.predictEnqueue(e)
	ctx := context.Background()
	if plan.kind == enqReserved {
		// The client waits ~0.8 s for the holder to be stored: bound it.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 30*time.Millisecond)
		defer cancel()
	}
	c := m.wrap
	if e.direct {
		c = m.direct
	}
	opts := []asynq.Option{asynq.Queue(m.queue), OnConflict(e.policy), asynq.MaxRetry(modelMaxRetry)}
	if e.cid != "" {
		opts = append(opts, asynq.TaskID(e.cid))
	}
	if e.retain {
		opts = append(opts, asynq.Retention(time.Hour))
	}
	if fault {
		ctx = m.faults.arm(ctx)
	}
	res, err := c.Submit(ctx, asynq.NewTask(modelType, modelPayload(e.k, e.marker)), opts...)
	fired := m.faults.disarm()
	if fault {
		m.expectEnqueueFault(t, e, fired, res, err)
		return
	}
	m.expectFired(t, e.String(), "", fired)
	m.expectEnqueue(t, e, plan, res, err)
	m.applyEnqueue(t, e, plan, res)
}

// expectEnqueueFault checks an enqueue whose lock call failed: refused
// (fail-closed), and nothing changed.
func (m *modelRun) expectEnqueueFault(t *rapid.T, e *enqCall, fired []string, res Result, err error) {
	t.Helper()
	what := e.String() + ", its lock call failing"
	if len(fired) != 1 || (fired[0] != "script:take" && fired[0] != "script:acquire" && fired[0] != "script:fold") {
		m.diverge(t, "enqueue: the first Redis call is not the lock script", "%s: failed commands %v", what, fired)
	}
	if e.same && e.direct && fired[0] == "script:take" {
		// The failed call carried the task: the client looks for it, and
		// finds its caller's ID stored with this very payload.
		if err != nil || res.Outcome != Created || res.TaskID != e.cid {
			m.diverge(t, "enqueue: the same payload again is not answered with its task", "%s: %+v, %v; model: %s, created", what, res, err, e.cid)
		}
		t.Logf("%s → the same task, created", what)
		return
	}
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, errInjected) {
		m.diverge(t, "enqueue: a failed lock call is not refused with ErrUnavailable", "%s: %+v, %v; model: ErrUnavailable, nothing changes", what, res, err)
	}
	t.Logf("%s → refused (ErrUnavailable)", what)
}

// expectEnqueue checks the call's answer against the plan.
func (m *modelRun) expectEnqueue(t *rapid.T, e *enqCall, plan enqPlan, res Result, err error) {
	t.Helper()
	var dup *DuplicateTaskError
	got := fmt.Sprintf("%s: got %v %s (%+v), %v; model: %s %s", e, res.Outcome, m.labelOf(res.TaskID), res.Info, err, plan.kind, m.labelOfTask(plan.h))
	switch plan.kind {
	case enqCreated, enqSelf:
		if err != nil || res.Outcome != Created || res.Info == nil || res.Info.ID != res.TaskID || res.Info.State != asynq.TaskStatePending {
			m.diverge(t, "enqueue: not created as the model says", "%s", got)
		}
	case enqSame:
		if err != nil || res.Outcome != Created || res.TaskID != e.cid || res.Info == nil || string(res.Info.Payload) != string(modelPayload(e.k, e.marker)) {
			m.diverge(t, "enqueue: the same payload again is not answered with its task", "%s", got)
		}
	case enqDup:
		if !errors.As(err, &dup) || dup.Holder != plan.h.id {
			m.diverge(t, "enqueue: not the duplicate the model names", "%s", got)
		}
		if !errors.Is(err, ErrDuplicateTask) || !errors.Is(err, asynq.ErrDuplicateTask) || dup.Key != m.keys[e.k] || dup.Queue != m.queue {
			m.diverge(t, "enqueue: duplicate error does not match its sentinels, key or queue", "%s: %#v", e, dup)
		}
	case enqReplaced:
		if err != nil || res.Outcome != Replaced || res.TaskID != plan.h.id || res.Info == nil || res.Info.State != parseState(plan.st) {
			m.diverge(t, "enqueue: not replaced into the holder the model names", "%s (%s)", got, plan.st)
		}
	case enqReserved:
		if err == nil || (errors.As(err, &dup) && dup.Holder != plan.h.id) {
			m.diverge(t, "enqueue: not the wait for an unstored holder", "%s", got)
		}
	case enqConflict:
		if !errors.Is(err, asynq.ErrTaskIDConflict) || errors.As(err, &dup) {
			m.diverge(t, "enqueue: not refused for a taken task ID", "%s", got)
		}
	}
}

// applyEnqueue moves the model by the plan, once the answer matched it.
func (m *modelRun) applyEnqueue(t *rapid.T, e *enqCall, plan enqPlan, res Result) {
	t.Helper()
	note := ""
	if plan.heal {
		if plan.st == store.StateArchived {
			m.byID[plan.h.id].lost = true // (marked: should it run again, it checks its key)
		}
		m.locks[e.k] = nil
		note = fmt.Sprintf(" (healed %s's lock, its holder %s)", plan.h.label, stateWord(plan.st))
	}
	switch plan.kind {
	case enqCreated, enqSelf:
		x := m.created(t, e, plan, res)
		t.Logf("%s → %s %s%s", e, plan.kind, x.label, note)
	case enqReplaced:
		plan.h.payload = e.marker
		m.fold(e.k, plan.h)
		t.Logf("%s → replaced into %s", e, plan.h.label)
	case enqConflict:
		t.Logf("%s → refused: %s is taken%s", e, e.cid, note)
	default:
		t.Logf("%s → %s %s", e, plan.kind, plan.h.label)
	}
}

// created adds the task an enqueue created.
func (m *modelRun) created(t *rapid.T, e *enqCall, plan enqPlan, res Result) *mTask {
	t.Helper()
	id := res.TaskID
	switch {
	case e.cid != "" && id != e.cid:
		m.diverge(t, "enqueue: created task does not have the caller's ID", "%s: created %s", e, id)
	case e.cid == "" && (m.byID[id] != nil || store.KindOf(id) != store.IDPlain):
		m.diverge(t, "enqueue: created task's ID is not a fresh generated one", "%s: created %q (%s)", e, id, m.labelOf(id))
	}
	x := &mTask{id: id, key: e.k, state: store.StatePending, payload: e.marker, retain: e.retain, header: e.cid != "" || !e.direct}
	if e.cid == "" {
		m.gen++
		x.label = "t" + strconv.Itoa(m.gen)
	}
	switch {
	case plan.kind == enqSelf:
		// The lock stays as it is (its value, age and lifetime); the task
		// asynq's client stored holds it now, its record naming no lock, so
		// its end releases it (the header says so, on either path).
		x.path, x.release = "self", true
		m.addTask(x)
		m.locks[e.k].holder = x
		return x
	case e.direct:
		x.path, x.unique, x.msgUniq = "direct", true, true
	default:
		x.path, x.release = "wrap", true
	}
	m.addTask(x)
	m.locks[e.k] = &mLock{holder: x}
	if !e.direct {
		m.locks[e.k].form = store.HoldWrap
	}
	return x
}

// Attempts.

// startPlan is what the model says an attempt's start does.
type startPlan struct {
	check bool   // the middleware calls the start script
	runs  bool   // the handler runs
	takes bool   // the attempt takes the key (free, or healed over heal)
	heal  *mTask // the holder whose lock it healed
	st    string // the state the script read for heal
	busy  *mTask // the live holder it waits behind
}

// predictStart is the model of task x's attempt starting: a task asynq
// runs again, one that lost its key or a busy task's copy checks its key
// (lua/start.lua); any other runs at once, making no Redis call.
func (m *modelRun) predictStart(x *mTask) startPlan {
	if x.retried == 0 && !x.lost && !x.kept() {
		return startPlan{runs: true}
	}
	l := m.locks[x.key]
	switch {
	case l == nil:
		return startPlan{check: true, runs: true, takes: true}
	case l.holder.id == x.id:
		return startPlan{check: true, runs: true}
	case !m.healable(l):
		return startPlan{check: true, busy: l.holder}
	}
	return startPlan{check: true, runs: true, takes: true, heal: l.holder, st: m.recState(l)}
}

// applyStart moves the model by the plan.
func (m *modelRun) applyStart(x *mTask, p startPlan) {
	if p.heal != nil && p.st == store.StateArchived {
		m.byID[p.heal.id].lost = true
	}
	if p.takes {
		// Its own ID where its record names the lock (asynq releases it),
		// else ~a:, which its end releases.
		m.locks[x.key] = &mLock{holder: x, form: store.HoldStart}
		if x.unique {
			m.locks[x.key].form = store.HoldTask
		}
		x.unlocked = false
	}
	if l := m.locks[x.key]; l != nil && l.holder.id == x.id {
		l.holder = x
	}
}

func (p startPlan) String() string {
	switch {
	case p.busy != nil:
		return "busy behind " + p.busy.label
	case p.heal != nil:
		return "took the key over from " + p.heal.label
	case p.takes:
		return "took the free key"
	case p.check:
		return "found its key its own"
	}
	return "ran without a Redis call"
}

// Outcomes of a handler.
var modelOutcomes = []string{"success", "revoke", "error", "skip-retry"}

var (
	errModel       = errors.New("model: handler failed")
	errModelRevoke = fmt.Errorf("model: %w", asynq.RevokeTask)
	errModelSkip   = fmt.Errorf("model: %w", asynq.SkipRetry)
)

func outcomeErr(o string) error {
	switch o {
	case "revoke":
		return errModelRevoke
	case "error":
		return errModel
	case "skip-retry":
		return errModelSkip
	}
	return nil
}

// mAttempt is one attempt the model runs through the middleware.
type mAttempt struct {
	x         *mTask
	outcome   string
	plan      startPlan
	fault     string // the Redis call made to fail ("" none)
	refused   bool   // that call was its start check: fail-closed, the handler does not run
	ran       bool
	violation string
}

func (a *mAttempt) String() string {
	s := fmt.Sprintf("run %s (%s)", a.x.label, a.outcome)
	if a.fault != "" {
		s += ", its first Redis call (" + a.fault + ") failing"
	}
	return s
}

// run: asynq runs a waiting task (forwarding a retry or a scheduled one
// first) through the middleware, and ends the attempt by its result.
func (m *modelRun) run(t *rapid.T) { m.runWith(t, false) }

// runWith runs an attempt; with fault, the first Redis call the
// middleware makes for it fails.
func (m *modelRun) runWith(t *rapid.T, fault bool) {
	x := m.drawTask(t, func(x *mTask) bool { return waitingState(x.state) })
	a := &mAttempt{x: x, outcome: rapid.SampledFrom(modelOutcomes).Draw(t, "outcome"), plan: m.predictStart(x)}
	if fault {
		a.fault = m.firstCall(x, a.plan, a.outcome)
	}
	a.refused = a.plan.check && a.fault != ""
	msg := m.dequeue(t, x)
	if !a.refused {
		m.applyStart(x, a.plan)
	}
	err := m.process(t, a, msg, fault)
	switch {
	case a.refused:
		if a.ran || !errors.Is(err, ErrUnavailable) || !errors.Is(err, errInjected) {
			m.diverge(t, "attempt: a failed start check did not refuse the attempt (fail-closed)", "%s: handler ran %v, returned %v; model: not run, ErrUnavailable", a, a.ran, err)
		}
	case a.ran != a.plan.runs:
		m.diverge(t, "attempt: the handler ran where the model says not, or not where it says so", "%s: handler ran %v; model: %s", a, a.ran, a.plan)
	case a.violation != "":
		m.diverge(t, "attempt: a handler ran without its key, or beside another", "%s: %s", a, a.violation)
	case !a.plan.runs:
		m.expectBusy(t, a.String(), x, a.plan, err)
	case err != outcomeErr(a.outcome):
		m.diverge(t, "attempt: the middleware changed the handler's result", "%s: returned %v; the handler returned %v", a, err, outcomeErr(a.outcome))
	case a.fault == "":
		m.settleModel(x, a.outcome, msg)
	}
	what := a.String() + " → " + a.result() + m.finish(t, x, msg, err)
	if a.plan.runs && a.fault == "" {
		m.expectFreed(t, what, x, a.outcome)
	}
	t.Logf("%s", what)
}

func (a *mAttempt) result() string {
	switch {
	case a.refused:
		return "refused, not run"
	case a.fault != "":
		return a.plan.String() + ", its end not settled"
	}
	return a.plan.String()
}

// process calls the middleware for the attempt as asynq's processor does,
// with the message the worker dequeued; with arm, the first Redis call it
// makes fails.
func (m *modelRun) process(t *rapid.T, a *mAttempt, msg modelMsg, arm bool) error {
	t.Helper()
	x := a.x
	ctx, cancel := m.meta.ctx(x.id, m.queue, msg.retried, msg.retry)
	defer cancel()
	handler := asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		a.ran, a.violation = true, m.runningViolation(x)
		return outcomeErr(a.outcome)
	})
	if arm {
		ctx = m.faults.arm(ctx)
	}
	err := m.mw(handler).ProcessTask(ctx, asynq.NewTaskWithHeaders(msg.typ, msg.payload, msg.headers))
	m.expectFired(t, a.String(), a.fault, m.faults.disarm())
	return err
}

// firstCall is the first Redis call the middleware makes for an attempt of
// x: at its start for a task that checks its key (a task whose ID and
// header name no lock reads its record's unique key first), else at its
// end where its mode acts there (a retry; a release its record cannot ask
// of asynq); "" for none.
func (m *modelRun) firstCall(x *mTask, p startPlan, outcome string) string {
	if p.check {
		if !x.header {
			return "hget"
		}
		return "script:start"
	}
	retry := outcome == "error" && x.retried < modelMaxRetry
	end := outcome == "success" || outcome == "revoke"
	switch {
	case !retry && !(end && x.release):
		return ""
	case !x.header:
		return "hget"
	}
	return "script:settle"
}

// runningViolation checks, as the handler of x starts, that x holds its
// key in Redis and no other task of the key is running (but where a lock
// expired).
func (m *modelRun) runningViolation(x *mTask) string {
	if !x.unlocked {
		v, err := m.raw.Get(context.Background(), m.keys[x.key]).Result()
		if holder := holderIn(v); err != nil || holder != x.id {
			return fmt.Sprintf("%s runs, but its key's lock is %q (%v)", x.label, v, err)
		}
	}
	for _, y := range m.tasks {
		if y != x && y.key == x.key && m.byID[y.id] == y && y.stalled && !x.unlocked && !y.unlocked {
			return fmt.Sprintf("%s runs beside %s (its handler started, its worker hung or dead)", x.label, y.label)
		}
	}
	return ""
}

// expectBusy checks the answer of an attempt that met its key busy: a
// BusyError asynq retries, or on its last attempt a copy of it scheduled
// (and the attempt done).
func (m *modelRun) expectBusy(t *rapid.T, what string, x *mTask, p startPlan, err error) {
	t.Helper()
	var busy *BusyError
	if x.retried < modelMaxRetry {
		if !errors.As(err, &busy) || busy.Holder != p.busy.id || busy.TaskID != x.id || IsFailure(err) {
			m.diverge(t, "attempt: not the BusyError naming the holder", "%s: %v; model: busy behind %s", what, err, p.busy.label)
		}
		return
	}
	if err != nil {
		m.diverge(t, "attempt: busy on its last attempt, but no copy made", "%s: %v; model: a copy is scheduled, the attempt done", what, err)
	}
	m.findCopy(t, what, x)
}

// findCopy adds the copy a busy task on its last attempt scheduled.
func (m *modelRun) findCopy(t *rapid.T, what string, x *mTask) {
	t.Helper()
	ids, err := m.raw.ZRange(context.Background(), store.ScheduledKey(m.queue), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, id := range ids {
		if m.byID[id] == nil {
			found = append(found, id)
		}
	}
	if len(found) != 1 || store.KindOf(found[0]) != store.IDKept {
		m.diverge(t, "attempt: busy on its last attempt, but not one kept copy scheduled", "%s: new scheduled tasks %v", what, found)
	}
	c := *x
	c.label, c.id, c.path, c.state, c.crashed, c.stalled = x.label+"'", found[0], "copy", store.StateScheduled, false, false
	m.addTask(&c)
}

// settleModel is the model of how an attempt that ran ends for its key:
// the middleware's settle call where the task's mode acts at that end (a
// retry, or a release its record cannot ask of asynq), before asynq's own
// scripts (finish).
func (m *modelRun) settleModel(x *mTask, outcome string, msg modelMsg) {
	l := m.locks[x.key]
	mine := l != nil && l.holder.id == x.id // (settle.lua compares IDs)
	switch {
	case (outcome == "success" || outcome == "revoke") && x.release && mine:
		m.locks[x.key] = nil
		if md := m.modes[x.key]; md != nil && md.id == x.id {
			m.modes[x.key] = nil
		}
	case outcome == "error" && msg.retried < msg.retry && mine:
		l.held = true
	}
}

// expectFreed checks the model's promise for the key of x's attempt that
// just ended: a success or revoke frees it; a final failure leaves it to
// heal at the next enqueue.
func (m *modelRun) expectFreed(t *rapid.T, what string, x *mTask, outcome string) {
	t.Helper()
	l := m.locks[x.key]
	if l == nil || l.holder != x || outcome == "error" && x.state == store.StateRetry {
		return
	}
	if !m.healable(l) {
		m.diverge(t, "a task's end left its key held", "%s: its key's lock stays %s's (%s, aged %v), and the key's next enqueue cannot take it", what, x.label, formWord(l.form), l.aged)
	}
}

// asynq's side of an attempt, as asynq v0.26.0's scripts do it
// (internal/rdb): the dequeue, then done, retry or archive. Only the stats
// counters are left out.
var (
	modelDequeue = redis.NewScript(`
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return redis.error_reply('NOT FOUND') end
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], 'state', 'active')
redis.call('HDEL', KEYS[4], 'pending_since')
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return redis.call('HGET', KEYS[4], 'msg')`)
	// modelDone is doneCmd (ARGV[2] '') and markAsCompleteCmd (ARGV[2] the
	// message, completed).
	modelDone = redis.NewScript(`
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return redis.error_reply('NOT FOUND') end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return redis.error_reply('NOT FOUND') end
if ARGV[2] == '' then
  if redis.call('DEL', KEYS[3]) == 0 then return redis.error_reply('NOT FOUND') end
else
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
  redis.call('HSET', KEYS[3], 'msg', ARGV[2], 'state', 'completed')
end
if KEYS[5] and redis.call('GET', KEYS[5]) == ARGV[1] then redis.call('DEL', KEYS[5]) end
return 1`)
	// modelFail is retryCmd (ARGV[3] 'retry') and archiveCmd ('archived'):
	// the worker's copy of the message, annotated, replaces the record's.
	modelFail = redis.NewScript(`
if redis.call('LREM', KEYS[2], 0, ARGV[1]) == 0 then return redis.error_reply('NOT FOUND') end
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return redis.error_reply('NOT FOUND') end
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('HSET', KEYS[1], 'msg', ARGV[2], 'state', ARGV[3])
return 1`)
)

func (m *modelRun) asynqKey(name string) string { return asynqPrefix(m.queue) + name }

// dequeue hands the waiting task x to a worker as asynq does: a retry or
// scheduled task is forwarded first (as its forwarder does once it is due),
// then dequeued (state active). It returns the message the worker got.
func (m *modelRun) dequeue(t *rapid.T, x *mTask) modelMsg {
	t.Helper()
	if x.state != store.StatePending {
		if err := m.insp.RunTask(m.queue, x.id); err != nil {
			t.Fatalf("forward %s: %v", x.label, err)
		}
	}
	keys := []string{store.PendingKey(m.queue), m.asynqKey("active"), m.asynqKey("lease"), store.TaskKey(m.queue, x.id)}
	raw, err := modelDequeue.Run(context.Background(), m.raw, keys, x.id, time.Now().Add(30*time.Second).Unix()).Text()
	if err != nil {
		t.Fatalf("dequeue %s: %v", x.label, err)
	}
	msg, err := decodeModelMsg([]byte(raw))
	if err != nil {
		t.Fatalf("dequeue %s: %v", x.label, err)
	}
	x.state = store.StateActive
	return msg
}

// finish does what asynq's processor does once the middleware returned err
// for x's attempt (handleSucceededMessage, handleFailedMessage), and moves
// the model with it; it returns the step's words.
func (m *modelRun) finish(t *rapid.T, x *mTask, msg modelMsg, err error) string {
	t.Helper()
	switch {
	case err == nil && msg.retention > 0:
		m.asynqDone(t, x, msg, true)
	case err == nil || errors.Is(err, asynq.RevokeTask):
		m.asynqDone(t, x, msg, false)
		return fmt.Sprintf("; asynq: %s done", x.label)
	case msg.retried >= msg.retry || errors.Is(err, asynq.SkipRetry):
		m.asynqFail(t, x, msg, msg.retried, err, store.StateArchived)
	default:
		n := msg.retried
		if IsFailure(err) { // the server's asynq.Config.IsFailure
			n++
		}
		m.asynqFail(t, x, msg, n, err, store.StateRetry)
	}
	return fmt.Sprintf("; asynq: %s %s", x.label, x.state)
}

// asynqDone is asynq's done script, or with keep (a retention)
// markAsComplete's: either compare-and-deletes the unique key the message
// names.
func (m *modelRun) asynqDone(t *rapid.T, x *mTask, msg modelMsg, keep bool) {
	t.Helper()
	keys := []string{m.asynqKey("active"), m.asynqKey("lease"), store.TaskKey(m.queue, x.id), m.asynqKey("completed")}
	if msg.unique != "" {
		keys = append(keys, msg.unique)
	}
	enc := ""
	if keep {
		enc = string(msg.completed(time.Now().Unix()))
	}
	if err := modelDone.Run(context.Background(), m.raw, keys, x.id, enc, time.Now().Add(time.Hour).Unix()).Err(); err != nil {
		t.Fatalf("asynq done %s: %v", x.label, err)
	}
	if l := m.locks[x.key]; x.msgUniq && l != nil && l.holder.id == x.id && l.form == store.HoldTask {
		m.locks[x.key] = nil // (compared with the lock's value: the ID)
	}
	x.state, x.crashed, x.stalled = "", false, false
	if keep {
		x.state = store.StateCompleted
	}
}

func (m *modelRun) asynqFail(t *rapid.T, x *mTask, msg modelMsg, retried int, cause error, state string) {
	t.Helper()
	set := m.asynqKey(state)
	if state == store.StateRetry {
		set = store.RetryKey(m.queue)
	}
	keys := []string{store.TaskKey(m.queue, x.id), m.asynqKey("active"), m.asynqKey("lease"), set}
	enc := msg.annotated(retried, cause.Error(), time.Now().Unix())
	if err := modelFail.Run(context.Background(), m.raw, keys, x.id, enc, state, time.Now().Unix()).Err(); err != nil {
		t.Fatalf("asynq %s %s: %v", state, x.label, err)
	}
	x.state, x.retried, x.crashed, x.stalled = state, retried, false, false
}

// modelMsg is a task's message (asynq's TaskMessage) as a worker decodes it.
type modelMsg struct {
	raw            []byte
	typ            string
	payload        []byte
	headers        map[string]string
	retry, retried int
	retention      int64
	unique         string
}

// TaskMessage field numbers beside those internal/store names.
const (
	pbType, pbPayload, pbRetry, pbRetried, pbErrorMsg = 1, 2, 5, 6, 7
	pbUniqueKey, pbLastFailedAt, pbRetention          = 10, 11, 12
	pbCompletedAt, pbHeaders                          = 13, 15
)

func decodeModelMsg(raw []byte) (modelMsg, error) {
	msg := modelMsg{raw: raw, headers: map[string]string{}}
	for b := raw; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return msg, protowire.ParseError(n)
		}
		b = b[n:]
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return msg, protowire.ParseError(n)
		}
		v := b[:n]
		b = b[n:]
		if typ == protowire.VarintType {
			x, _ := protowire.ConsumeVarint(v)
			switch num {
			case pbRetry:
				msg.retry = int(x)
			case pbRetried:
				msg.retried = int(x)
			case pbRetention:
				msg.retention = int64(x)
			}
			continue
		}
		s, _ := protowire.ConsumeBytes(v)
		switch num {
		case pbType:
			msg.typ = string(s)
		case pbPayload:
			msg.payload = s
		case pbUniqueKey:
			msg.unique = string(s)
		case pbHeaders:
			k, val := decodeHeader(s)
			msg.headers[k] = val
		}
	}
	return msg, nil
}

// decodeHeader reads one entry of the headers map.
func decodeHeader(b []byte) (k, v string) {
	for len(b) > 0 {
		num, _, n := protowire.ConsumeTag(b)
		if n < 0 {
			return k, v
		}
		b = b[n:]
		s, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return k, v
		}
		b = b[n:]
		if num == 1 {
			k = string(s)
		} else {
			v = string(s)
		}
	}
	return k, v
}

// without is the message without the fields nums.
func (msg modelMsg) without(nums ...protowire.Number) []byte {
	var out []byte
	for b := msg.raw; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if !slices.Contains(nums, num) {
			out = append(out, b[:n+m]...)
		}
		b = b[n+m:]
	}
	return out
}

// completed is the message as asynq's markAsComplete writes it.
func (msg modelMsg) completed(at int64) []byte {
	out := msg.without(pbCompletedAt)
	out = protowire.AppendTag(out, pbCompletedAt, protowire.VarintType)
	return protowire.AppendVarint(out, uint64(at))
}

// annotated is the message as asynq's retry and archive write it back: the
// worker's copy with its retries used, its error and when it failed.
func (msg modelMsg) annotated(retried int, errMsg string, at int64) []byte {
	out := msg.without(pbRetried, pbErrorMsg, pbLastFailedAt)
	if retried != 0 {
		out = protowire.AppendTag(out, pbRetried, protowire.VarintType)
		out = protowire.AppendVarint(out, uint64(retried))
	}
	out = protowire.AppendTag(out, pbErrorMsg, protowire.BytesType)
	out = protowire.AppendString(out, errMsg)
	out = protowire.AppendTag(out, pbLastFailedAt, protowire.VarintType)
	return protowire.AppendVarint(out, uint64(at))
}

// crash: asynq hands a waiting task to a worker, which dies once the
// middleware has made its start checks, before the handler returns: the
// attempt never ends, and asynq keeps the task active until its recoverer
// finds the lease expired.
func (m *modelRun) crash(t *rapid.T) {
	x := m.drawTask(t, func(x *mTask) bool { return waitingState(x.state) })
	plan := m.predictStart(x)
	msg := m.dequeue(t, x)
	ctx, cancel := m.meta.ctx(x.id, m.queue, msg.retried, msg.retry)
	defer cancel()
	m.applyStart(x, plan)
	runs, err := m.begin(ctx, x, asynq.NewTaskWithHeaders(msg.typ, msg.payload, msg.headers))
	what := fmt.Sprintf("the worker running %s dies", x.label)
	if runs != plan.runs {
		m.diverge(t, "attempt: the handler would run where the model says not, or not where it says so", "%s: would run %v; model: %s", what, runs, plan)
	}
	if !plan.runs {
		m.expectBusy(t, what, x, plan, err)
	}
	x.crashed, x.stalled = true, plan.runs
	t.Logf("%s (its start: %s)", what, plan)
}

// begin is the middleware's process up to the handler's call: it reports
// whether the handler would run, and if not, the attempt's answer.
func (m *modelRun) begin(ctx context.Context, x *mTask, task *asynq.Task) (runs bool, err error) {
	d := m.h.d
	l := d.attemptFor(ctx, m.queue, x.id, task)
	if l == nil {
		return true, nil
	}
	if !d.storedHere(ctx, m.queue, x.id) {
		return false, d.elsewhere(task, x.id)
	}
	rule := d.ruleFor(task.Type())
	if l.mustStart() {
		next := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { runs = true; return nil })
		if done, err := d.start(ctx, task, next, &rule, l); done {
			return runs, err
		}
	}
	return true, nil
}

// recoverTask: asynq's recoverer finds a crashed worker's task (its lease
// expired) and retries it, or archives it if it has no retry left.
func (m *modelRun) recoverTask(t *rapid.T) {
	x := m.drawTask(t, func(x *mTask) bool { return x.crashed })
	raw, err := m.raw.HGet(context.Background(), store.TaskKey(m.queue, x.id), "msg").Bytes()
	if err != nil {
		t.Fatalf("read %s: %v", x.label, err)
	}
	msg, err := decodeModelMsg(raw)
	if err != nil {
		t.Fatal(err)
	}
	if msg.retried >= msg.retry {
		m.asynqFail(t, x, msg, msg.retried, asynq.ErrLeaseExpired, store.StateArchived)
	} else {
		n := msg.retried
		if IsFailure(asynq.ErrLeaseExpired) {
			n++
		}
		m.asynqFail(t, x, msg, n, asynq.ErrLeaseExpired, store.StateRetry)
	}
	t.Logf("asynq recovers %s: %s", x.label, x.state)
}

// Operators and time.

// deleteTask: an operator deletes a waiting, archived or completed task
// (Inspector): asynq's script also deletes the lock its record names, if
// the lock's value is still its ID.
func (m *modelRun) deleteTask(t *rapid.T) {
	x := m.drawTask(t, func(x *mTask) bool { return x.state != "" && x.state != store.StateActive })
	if err := m.insp.DeleteTask(m.queue, x.id); err != nil {
		t.Fatalf("delete %s: %v", x.label, err)
	}
	from := x.state
	if l := m.locks[x.key]; x.unique && l != nil && l.holder.id == x.id && l.form == store.HoldTask {
		m.locks[x.key] = nil // (compared with the lock's value: the ID)
	}
	x.state = ""
	t.Logf("%s (%s) deleted by hand", x.label, from)
}

// archiveTask: an operator archives a waiting task (Inspector): its lock
// stays, for the key's next enqueue to heal.
func (m *modelRun) archiveTask(t *rapid.T) {
	x := m.drawTask(t, func(x *mTask) bool { return waitingState(x.state) })
	if err := m.insp.ArchiveTask(m.queue, x.id); err != nil {
		t.Fatalf("archive %s: %v", x.label, err)
	}
	t.Logf("%s (%s) archived by hand", x.label, x.state)
	x.state = store.StateArchived
}

// runByHand: an operator runs an archived task again (Inspector.RunTask).
func (m *modelRun) runByHand(t *rapid.T) {
	x := m.drawTask(t, func(x *mTask) bool { return x.state == store.StateArchived })
	if err := m.insp.RunTask(m.queue, x.id); err != nil {
		t.Fatalf("run %s by hand: %v", x.label, err)
	}
	x.state = store.StatePending
	t.Logf("%s run again by hand: pending", x.label)
}

// expire: a lock's lifetime runs out, and with it its mode record if that
// would not outlive it.
func (m *modelRun) expire(t *rapid.T) {
	k := m.drawKey(t, func(l *mLock) bool { return l != nil })
	ctx := context.Background()
	lock, mode := m.keys[k], store.ModeOf(m.keys[k])
	lt, err1 := m.raw.PTTL(ctx, lock).Result()
	mt, err2 := m.raw.PTTL(ctx, mode).Result()
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	dropMode := mt > 0 && mt <= lt
	if err := m.raw.Del(ctx, lock).Err(); err != nil {
		t.Fatal(err)
	}
	if dropMode {
		_ = m.raw.Del(ctx, mode).Err()
		m.modes[k] = nil
	}
	l := m.locks[k]
	l.holder.unlocked = true
	m.locks[k] = nil
	t.Logf("lock %s (held by %s) expires (mode record too: %v)", modelKeys[k], l.holder.label, dropMode)
}

// age: a WrapClient lock grows older than HealGrace.
func (m *modelRun) age(t *rapid.T) {
	k := m.drawKey(t, func(l *mLock) bool { return l != nil && l.form == store.HoldWrap && !l.aged })
	l := m.locks[k]
	v := store.WrapValue(l.holder.id, time.Now().Add(-2*modelGrace))
	if err := m.raw.SetArgs(context.Background(), m.keys[k], v, redis.SetArgs{Mode: "XX", KeepTTL: true}).Err(); err != nil {
		t.Fatal(err)
	}
	l.aged = true
	t.Logf("lock %s (held by %s) ages past HealGrace", modelKeys[k], l.holder.label)
}

// Invariants.

// band is the lifetime a lock has: (lo, hi].
func (l *mLock) band() (lo, hi time.Duration) {
	if l.held {
		return modelTTL, modelHeldTTL
	}
	return 0, modelTTL
}

type modelRead struct {
	lock  [2]*redis.StringCmd
	ttl   [2]*redis.DurationCmd
	mode  [2]*redis.MapStringStringCmd
	tasks map[*mTask]*redis.SliceCmd
}

func (m *modelRun) read(t *rapid.T) *modelRead {
	ctx := context.Background()
	r := &modelRead{tasks: map[*mTask]*redis.SliceCmd{}}
	pipe := m.raw.Pipeline()
	for k, key := range m.keys {
		r.lock[k], r.ttl[k], r.mode[k] = pipe.Get(ctx, key), pipe.PTTL(ctx, key), pipe.HGetAll(ctx, store.ModeOf(key))
	}
	for _, x := range m.tasks {
		if m.byID[x.id] == x {
			r.tasks[x] = pipe.HMGet(ctx, store.TaskKey(m.queue, x.id), "state", "msg", "unique_key")
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		t.Fatalf("reading state: %v", err)
	}
	return r
}

func (m *modelRun) check(t *rapid.T) {
	r := m.read(t)
	for k := range m.keys {
		m.checkLock(t, k, r)
		m.checkMode(t, k, r.mode[k].Val())
	}
	for _, x := range m.tasks {
		if c := r.tasks[x]; c != nil {
			m.checkTask(t, x, c.Val())
		}
	}
	m.checkHolders(t)
}

func (m *modelRun) checkLock(t *rapid.T, k int, r *modelRead) {
	v, err := r.lock[k].Result()
	want, name := m.locks[k], modelKeys[k]
	switch {
	case want == nil && errors.Is(err, redis.Nil):
		return
	case want == nil:
		m.diverge(t, "lock held where the model has it free", "lock %s is %q (%s); model: free", name, v, m.labelOf(holderIn(v)))
	case err != nil:
		m.diverge(t, "lock free where the model has it held", "lock %s: %v; model: held by %s", name, err, want.holder.label)
	}
	p := store.ParseValue(v)
	if p.Holder != want.holder.id || p.Kind != want.form {
		m.diverge(t, "lock holder or form differs from the model", "lock %s is %q (%s); model: held by %s, %s", name, v, m.labelOf(p.Holder), want.holder.label, formWord(want.form))
	}
	if old := p.Kind == store.HoldWrap && time.Since(p.At) > modelGrace; old != want.aged {
		m.diverge(t, "lock age differs from the model", "lock %s is %q; model: older than HealGrace %v", name, v, want.aged)
	}
	if lo, hi := want.band(); r.ttl[k].Val() <= lo || r.ttl[k].Val() > hi {
		m.diverge(t, "lock lifetime does not fit the model", "lock %s: lifetime %v; model: held across a retry %v, in (%v, %v]", name, r.ttl[k].Val(), want.held, lo, hi)
	}
}

func (m *modelRun) checkMode(t *rapid.T, k int, got map[string]string) {
	want := m.modes[k]
	if want == nil {
		if len(got) != 0 {
			m.diverge(t, "mode record where the model has none", "key %s: mode record %v; model: none", modelKeys[k], got)
		}
		return
	}
	n, _ := strconv.Atoi(got[store.FieldFolds])
	if len(got) != 2 || got[store.FieldHolder] != want.id || n != want.n {
		m.diverge(t, "mode record differs from the model", "key %s: mode record %v; model: about %s, %d folds", modelKeys[k], got, m.labelOf(want.id), want.n)
	}
}

func (m *modelRun) checkTask(t *rapid.T, x *mTask, v []any) {
	state, _ := v[0].(string)
	if state != x.state {
		m.diverge(t, "asynq task state differs from the model", "task %s: asynq state %q; model %q", x.label, state, x.state)
	}
	if state == "" {
		return
	}
	raw, _ := v[1].(string)
	msg, err := decodeModelMsg([]byte(raw))
	if err != nil || string(msg.payload) != string(modelPayload(x.key, x.payload)) || msg.retried != x.retried {
		m.diverge(t, "stored task differs from the model", "task %s: payload %q, %d retries used (%v); model: marker %s, %d retries used", x.label, msg.payload, msg.retried, err, x.payload, x.retried)
	}
	if lost := msg.headers[store.HeaderLost]; (lost == store.LostHealed) != x.lost || (lost != "" && lost != store.LostHealed) {
		m.diverge(t, "task's dedup-lost mark differs from the model", "task %s: dedup-lost %q; model: healed over %v", x.label, lost, x.lost)
	}
	u, _ := v[2].(string)
	if (u != "") != x.unique || (u != "" && u != m.keys[x.key]) || (msg.unique != "") != x.msgUniq {
		m.diverge(t, "task's unique key differs from the model", "task %s: unique_key %q, message's %q; model: names its lock %v, %v", x.label, u, msg.unique, x.unique, x.msgUniq)
	}
}

// checkHolders checks the model's own promise: a key's live tasks that did
// not lose their key (healed over, or its lock expired) are at most one,
// and it holds the key.
func (m *modelRun) checkHolders(t *rapid.T) {
	for k := range m.keys {
		var live []string
		for _, x := range m.tasks {
			if x.key != k || m.byID[x.id] != x || !liveState(x.state) || x.exempt() {
				continue
			}
			live = append(live, x.label)
			if l := m.locks[k]; l == nil || l.holder != x {
				m.diverge(t, "a live task does not hold its key", "key %s: %s is %s, but does not hold the key", modelKeys[k], x.label, x.state)
			}
		}
		if len(live) > 1 {
			m.diverge(t, "a key has two live tasks", "key %s: live tasks %v", modelKeys[k], live)
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
		fmt.Fprintf(&b, "  lock %s: held by %s (%s, aged %v, across a retry %v)\n", modelKeys[k], l.holder.label, formWord(l.form), l.aged, l.held)
	}
	for k, md := range m.modes {
		if md != nil {
			fmt.Fprintf(&b, "  mode record %s: about %s, %d folds\n", modelKeys[k], m.labelOf(md.id), md.n)
		}
	}
	var lines []string
	for _, x := range m.tasks {
		lines = append(lines, fmt.Sprintf("  task %s (%s, %s): key %s, asynq %s, payload %s, retries used %d, lost %v, unlocked %v, crashed %v",
			x.label, x.id, x.path, modelKeys[x.key], stateWord(x.state), x.payload, x.retried, x.lost, x.unlocked, x.crashed))
	}
	sort.Strings(lines)
	b.WriteString(strings.Join(lines, "\n"))
	return b.String()
}

// Redis errors on demand.

var errInjected = errors.New("model: injected Redis error")

// modelFaults is a go-redis hook on the Dedup's client: once armed, it fails
// the next command (or pipeline) made under the armed context before it
// reaches Redis, and records it, naming this package's scripts. The
// Dedup's own background calls (its stats flusher, heartbeat, probes) go
// through: met first, they would take the fault meant for the step.
type modelFaults struct {
	mu      sync.Mutex
	armed   *faultArm // nil when disarmed
	fired   []string
	scripts map[string]string // SHA1 → script name
}

// faultArm marks the context of the call an armed fault is meant for.
type faultArm struct{}

func newModelFaults() *modelFaults {
	f := &modelFaults{scripts: map[string]string{}}
	for _, name := range []string{"take", "acquire", "fold", "merge", "start", "settle", "extend", "release", "again"} {
		f.scripts[store.ScriptHash(name)] = name
	}
	return f
}

// arm fails the next call made under the returned context, derived from ctx.
func (f *modelFaults) arm(ctx context.Context) context.Context {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed, f.fired = new(faultArm), nil
	return context.WithValue(ctx, faultArm{}, f.armed)
}

// disarm stops failing and returns the commands that failed.
func (f *modelFaults) disarm() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := f.fired
	f.armed, f.fired = nil, nil
	return out
}

// trip reports whether cmds, made under ctx, fail, disarming.
func (f *modelFaults) trip(ctx context.Context, cmds ...redis.Cmder) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.armed == nil || ctx.Value(faultArm{}) != f.armed {
		return false
	}
	for _, c := range cmds {
		switch name := strings.ToLower(c.Name()); name {
		case "hello", "auth", "client", "select", "readonly": // a connection's set-up
			return false
		case "evalsha", "eval":
			sha, _ := c.Args()[1].(string)
			if name == "eval" {
				sha = fmt.Sprintf("%x", sha1.Sum([]byte(sha)))
			}
			f.fired = append(f.fired, "script:"+f.scripts[sha])
		default:
			f.fired = append(f.fired, name)
		}
	}
	f.armed = nil
	return true
}

func (f *modelFaults) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f *modelFaults) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if f.trip(ctx, cmd) {
			cmd.SetErr(errInjected)
			return errInjected
		}
		return next(ctx, cmd)
	}
}

func (f *modelFaults) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if f.trip(ctx, cmds...) {
			for _, c := range cmds {
				c.SetErr(errInjected)
			}
			return errInjected
		}
		return next(ctx, cmds)
	}
}

// expectFired checks which command a step's armed fault failed: want, or
// none for "".
func (m *modelRun) expectFired(t *rapid.T, what, want string, fired []string) {
	t.Helper()
	if (want == "" && len(fired) != 0) || (want != "" && (len(fired) != 1 || fired[0] != want)) {
		m.diverge(t, "a step's Redis calls differ from the model", "%s: failed commands %v; model: its first Redis call is %q", what, fired, want)
	}
}
