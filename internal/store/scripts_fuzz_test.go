package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Random lock states × random calls × random hints, in the checked build
// (a script that touches a key it was not given fails). For every call of
// an Acquire (take.lua, acquire.lua): a statusNeed reply, and take.lua's
// statusFree (a direct call that left its task out finds the key free),
// must have changed nothing (no key written, no TTL moved), and no call may
// fail. The full Acquire loop must end in a final answer consistent with
// what is stored.

type scriptWorld struct {
	t    *testing.T
	rdb  *redis.Client
	s    *Store
	rng  *rand.Rand
	q    string
	fp   string
	lock string
	desc []string
	ids  map[string]string // role → ID: holder, follow, caller, call, new follow-up
}

func newWorld(t *testing.T, rdb *redis.Client, s *Store, rng *rand.Rand, i int) *scriptWorld {
	q := fmt.Sprintf("%s-%d", redistest.Uniq(t), i)
	fp := fmt.Sprintf("%016x", rng.Uint64())
	w := &scriptWorld{t: t, rdb: rdb, s: s, rng: rng, q: q, fp: fp, lock: s.keys.Lock(q, fp), ids: map[string]string{"caller": "cid-" + q}}
	w.build()
	return w
}

func (w *scriptWorld) note(f string, a ...any) { w.desc = append(w.desc, fmt.Sprintf(f, a...)) }

func (w *scriptWorld) pick(n int) int { return w.rng.IntN(n) }

func (w *scriptWorld) story() string { return strings.Join(w.desc, "\n  ") }

var taskStates = []string{"", StatePending, StateScheduled, StateRetry, StateActive, StateCompleted, StateArchived}

func (w *scriptWorld) state() string { return taskStates[w.pick(len(taskStates))] }

// build makes a random key: a lock of any kind whose holder is in any
// state, or none; a mode record about the holder or stale, with any of the
// modes' fields; a follow-up in any state; a waiting set.
func (w *scriptWorld) build() {
	ctx := context.Background()
	holder := ""
	if w.pick(5) != 0 {
		holder = NewPlainID()
		if w.pick(6) == 0 {
			holder = w.ids["caller"] // the call's own caller-chosen ID
		}
		w.ids["holder"] = holder
		st := w.state()
		if w.pick(4) == 0 {
			st = StateActive // running: where RunningDefer acts
		}
		putTask(w.rdb, w.q, holder, st)
		v := []string{Value(holder), Value(holder), WrapValue(holder, time.Now()), WrapValue(holder, time.Now().Add(-2*time.Hour)),
			"~c:" + holder, FiringValue(holder)}[w.pick(6)]
		ttl := time.Hour
		if w.pick(10) == 0 {
			ttl = 0 // a fail hold until released
		}
		w.rdb.Set(ctx, w.lock, v, ttl)
		if holder == w.ids["caller"] && st != "" {
			// A caller-chosen ID's task names its lock (its record's unique
			// key, or the dedup header), else it is another key's task now.
			m := &Message{Type: "t", Payload: []byte(`{"p":"` + holder + `"}`), ID: holder, Queue: w.q, Retry: 25, Timeout: time.Minute,
				Headers: map[string]string{HeaderLock: LockHeader("", w.lock)}}
			w.rdb.HSet(ctx, TaskKey(w.q, holder), "msg", m.Encode())
		}
		w.note("lock %q ttl %v, holder state %q", v, ttl, st)
	}
	if w.pick(3) == 0 {
		return // a key of no mode
	}
	about := holder
	if holder == "" || w.pick(5) == 0 {
		about = NewPlainID() // stale: about another task
	}
	fields := []any{FieldHolder, about, FieldType, "t"}
	add := func(odds int, f string, v any) {
		if w.pick(odds) == 0 {
			fields = append(fields, f, v)
		}
	}
	add(2, FieldRunning, []string{"d", "d", "a"}[w.pick(3)])
	add(2, FieldFolds, w.pick(5))
	add(4, FieldError, "boom")
	add(4, FieldCoolEnd, time.Now().Add(time.Hour).UnixMilli())
	add(4, FieldFailHold, "-1")
	// A handler asynq gave up still runs (extend.lua's Outlived), or did
	// until its note lapsed (its worker died).
	add(8, FieldOutlived, []int64{time.Now().Add(time.Hour).UnixMilli(), time.Now().Add(-time.Second).UnixMilli()}[w.pick(2)])
	if w.pick(3) == 0 {
		fields = append(fields, FieldBounded, "t")
		w.rdb.ZAdd(ctx, w.s.keys.Wait(w.q, "t"), redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: w.fp})
	}
	if w.pick(2) == 0 {
		f := NewFollowID()
		fst := w.state()
		putTask(w.rdb, w.q, f, fst)
		fields = append(fields, FieldFollow, f)
		w.ids["follow"] = f
		w.note("follow-up %s state %q", f, fst)
	}
	for range w.pick(3) { // other keys waiting (MaxPending)
		w.rdb.ZAdd(ctx, w.s.keys.Wait(w.q, "t"), redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: fmt.Sprintf("%016x", w.rng.Uint64())})
	}
	w.rdb.HSet(ctx, ModeOf(w.lock), fields...)
	w.rdb.Expire(ctx, ModeOf(w.lock), time.Hour)
	w.note("mode record %v", fields)
}

// call makes a random enqueue, and the hint this process has for the key.
func (w *scriptWorld) call() (*Acquire, hint) {
	id := NewPlainID()
	caller := w.pick(5) == 0
	if caller {
		id = w.ids["caller"]
		if w.pick(3) == 0 && w.rdb.Exists(context.Background(), TaskKey(w.q, id)).Val() == 0 {
			st := taskStates[1+w.pick(len(taskStates)-1)]
			putTask(w.rdb, w.q, id, st)
			w.note("the caller's ID is in asynq already, %q", st)
		}
	}
	r := w.s.ref(w.q, w.fp, id)
	w.ids["call"] = id
	a := &Acquire{Ref: r, OnWaiting: []Fold{FoldReject, FoldReplace, FoldMerge}[w.pick(3)], Defers: w.pick(3) == 0,
		TTL: time.Hour, Now: time.Now(), Value: WrapValue(id, time.Now()), Caller: caller, Payload: []byte(`{"p":"new"}`)}
	if a.Defers {
		a.FollowID = NewFollowID()
		w.ids["new follow-up"] = a.FollowID
	}
	if w.pick(3) == 0 {
		a.MaxPending = 1 + w.pick(3)
	}
	if w.pick(2) == 0 {
		a.Direct, a.Value, a.Unique = true, Value(id), true
		a.Message = testMessage(r, string(a.Payload))
		if w.pick(3) == 0 {
			a.DueAt = time.Now().Add(time.Hour).Unix()
		}
		if w.pick(6) == 0 { // a Scheduler firing's
			a.Value, a.Unique, a.Message.UniqueKey = FiringValue(id), false, ""
		}
	}
	if w.pick(4) == 0 {
		a.DebounceDue = time.Now().Add(time.Minute).Unix()
	}
	if w.pick(4) == 0 {
		a.Mode = []any{FieldHolder, id, FieldType, "t", FieldRunning, "d"}
	}
	h := w.hint()
	w.note("call %s caller=%v fold=%c defers=%v max=%d direct=%v value=%q due=%d debounce=%d mode=%v; hint %+v",
		id, caller, a.OnWaiting, a.Defers, a.MaxPending, a.Direct, a.Value, a.DueAt, a.DebounceDue, a.Mode, h)
	return a, h
}

// hint is what this process remembers of the key: nothing, the truth, or
// a stale holder or follow-up; a holder's record read moments ago, or not.
func (w *scriptWorld) hint() hint {
	ctx := context.Background()
	holder := ParseValue(w.rdb.Get(ctx, w.lock).Val()).Holder
	follow := w.rdb.HGet(ctx, ModeOf(w.lock), FieldFollow).Val()
	var h hint
	switch w.pick(5) {
	case 1:
		h = hint{holder: holder, follow: follow}
	case 2:
		h = hint{holder: NewPlainID()}
	case 3:
		h = hint{holder: holder, follow: NewFollowID()}
	case 4:
		h = hint{follow: w.ids["follow"]}
	}
	if h.holder != "" && w.pick(3) == 0 {
		h.checked = time.Now().UnixNano() // trusted: a plain rejection is answered from the lock
	}
	return h
}

// keys are the keys a world's calls may touch (nil for a world that does
// not track them: every key of its queue is read then).
func (w *scriptWorld) keys() []string {
	if w.lock == "" {
		return nil
	}
	out := []string{w.lock, ModeOf(w.lock), w.s.keys.Wait(w.q, "t"), PendingKey(w.q), ScheduledKey(w.q), RetryKey(w.q), ActiveKey(w.q)}
	for _, id := range w.ids {
		out = append(out, TaskKey(w.q, id))
	}
	return out
}

// snapshot is every key of the world (asynq's and the Store's), dumped,
// with its TTL in minutes.
func (w *scriptWorld) snapshot() map[string]string {
	ctx := context.Background()
	keys := w.keys()
	if keys == nil {
		for _, pat := range []string{"asynq:{" + w.q + "}:*", w.s.keys.Prefix() + ":{" + w.q + "}:*"} {
			keys = append(keys, w.rdb.Keys(ctx, pat).Val()...)
		}
	}
	dumps := make([]*redis.StringCmd, len(keys))
	ttls := make([]*redis.DurationCmd, len(keys))
	_, _ = w.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, key := range keys {
			dumps[i], ttls[i] = p.Dump(ctx, key), p.PTTL(ctx, key)
		}
		return nil
	})
	out := map[string]string{}
	for i, key := range keys {
		if d, err := dumps[i].Result(); err == nil {
			out[key] = fmt.Sprintf("%x ttl~%d", d, (ttls[i].Val()+30*time.Second)/time.Minute)
		}
	}
	return out
}

// clear deletes the world's keys.
func (w *scriptWorld) clear() { w.rdb.Del(context.Background(), w.keys()...) }

func diff(a, b map[string]string) []string {
	var out []string
	for k, v := range a {
		if b[k] != v {
			out = append(out, "changed/removed "+k)
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			out = append(out, "added "+k)
		}
	}
	sort.Strings(out)
	return out
}

// pure reports whether a reply of sc must have changed nothing.
func (w *scriptWorld) pure(sc *redis.Script, v any) (bool, reply) {
	rep, err := parseReply(v)
	if err != nil {
		w.t.Fatalf("reply %v: %v", v, err)
	}
	return rep.status == statusNeed || (sc == w.s.sc.take && rep.status == statusFree), rep
}

func TestAcquireNeedIsPure(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	rng := rand.New(rand.NewPCG(1, 2))
	fails, pure := 0, 0
	for i := 0; i < 3000 && fails < 15; i++ {
		w := newWorld(t, rdb, s, rng, i)
		n, bad := w.runPure(i)
		pure += n
		if bad {
			fails++
		}
		w.clear()
	}
	if pure < 500 {
		t.Errorf("only %d replies that must change nothing: the test does not reach its case", pure)
	}
}

// setHint makes h what s remembers of a's key, and nothing else.
func setHint(s *Store, a *Acquire, h hint) {
	s.hints = hintCache{}
	if h.holder != "" || h.follow != "" {
		s.hints.put(a.Ref.Lock, h)
	}
}

// runPure makes a random call of case i one script call at a time, as
// Acquire does, and checks each reply that must change nothing; it reports
// how many there were, and whether a check failed.
func (w *scriptWorld) runPure(i int) (pure int, bad bool) {
	ctx := context.Background()
	s, t := w.s, w.t
	a, h := w.call()
	setHint(s, a, h)
	st := s.newAcquireStep(a)
	for round := 0; round < 12; round++ {
		sc, keys, args := st.next(s, a)
		before := w.snapshot()
		v, err := sc.Run(ctx, w.rdb, keys, args...).Result()
		if err != nil {
			t.Errorf("case %d round %d: script error %v\n  %s\n  keys %v", i, round, err, w.story(), keys)
			return pure, true
		}
		if ok, rep := w.pure(sc, v); ok {
			pure++
			if d := diff(before, w.snapshot()); len(d) > 0 {
				t.Errorf("case %d round %d: reply %d %v changed %v\n  %s", i, round, rep.status, rep.strs, d, w.story())
				return pure, true
			}
		}
		if _, more, err := st.read(s, a, v, nil); !more || err != nil {
			break
		}
	}
	return pure, false
}

// keyState is what a world's key holds, as the checks read it.
type keyState struct {
	value  Parsed
	locked bool
	state  string            // the holder's asynq state ("" none)
	mode   map[string]string // the mode record, whoever it is about
}

func (w *scriptWorld) read() keyState {
	ctx := context.Background()
	v, err := w.rdb.Get(ctx, w.lock).Result()
	k := keyState{value: ParseValue(v), locked: err == nil, mode: w.rdb.HGetAll(ctx, ModeOf(w.lock)).Val()}
	if k.locked {
		k.state = w.rdb.HGet(ctx, TaskKey(w.q, k.value.Holder), "state").Val()
	}
	return k
}

// live reports whether the key held a task that can still run, or was held
// on purpose: no call may take it.
func (k keyState) live(grace time.Duration) bool {
	p := k.value
	failed := k.mode[FieldHolder] == p.Holder && k.mode[FieldError] != "" && (k.state == "" || k.state == StateArchived || k.state == StateActive)
	young := p.Kind == HoldWrap && k.state == "" && time.Since(p.At) < grace
	outlived := k.mode[FieldHolder] == p.Holder && noteLive(k.mode[FieldOutlived])
	return k.locked && (p.HeldOnPurpose() || failed || young || outlived || !Gone(k.state))
}

// The full Acquire loop on random states ends in a final answer, never an
// error, and what it answers is what is stored.
func TestAcquireAnswersAgree(t *testing.T) {
	rdb := redistest.Client(t)
	rng := rand.New(rand.NewPCG(3, 4))
	s := newTestStore(t, rdb)
	fails := 0
	seen := map[Status]int{}
	for i := 0; i < 2000 && fails < 15; i++ {
		w := newWorld(t, rdb, s, rng, i)
		a, h := w.call()
		setHint(s, a, h)
		before := w.read()
		res, err := s.Acquire(context.Background(), a)
		seen[res.Status]++
		if err != nil {
			fails++
			t.Errorf("case %d: %v\n  %s", i, err, w.story())
		} else if bad := w.check(a, res, before, h.checked != 0); bad != "" {
			fails++
			t.Errorf("case %d: %+v: %s\n  %s", i, res, bad, w.story())
		}
		w.clear()
	}
	for _, st := range []Status{StatusTaken, StatusHeld, StatusReplaced, StatusMerge, StatusDeferred, StatusCooling, StatusReserved, StatusOver} {
		if seen[st] < 5 && fails == 0 {
			t.Errorf("status %d answered %d times: the test does not reach it (%v)", st, seen[st], seen)
		}
	}
}

// check compares an answer with what is stored after it; trusted: the
// answer may come from the lock alone.
func (w *scriptWorld) check(a *Acquire, res AcquireResult, before keyState, trusted bool) string {
	ctx := context.Background()
	after := w.read()
	holder, follow := after.value.Holder, after.mode[FieldFollow]
	task := w.rdb.HGetAll(ctx, TaskKey(w.q, res.Task)).Val()
	switch res.Status {
	case StatusTaken:
		return w.checkTaken(a, res, before, after)
	case StatusHeld:
		if res.Task != holder && res.Task != follow {
			return fmt.Sprintf("held by %s, but the lock names %s (follow-up %q)", res.Task, holder, follow)
		}
		if res.Task == holder && !after.live(w.s.cfg.HealGrace) && !trusted {
			return "held by a holder that cannot run"
		}
	case StatusReplaced, StatusMerge:
		if res.Task != holder && res.Task != follow {
			return "folded into " + res.Task + ", which the key does not name (holder " + holder + ")"
		}
		if !Waiting(task["state"]) {
			return "folded into a task in state " + task["state"]
		}
		if _, p, _ := decodeTypePayload([]byte(task["msg"])); res.Status == StatusReplaced && string(p) != string(a.Payload) {
			return fmt.Sprintf("replaced, but the payload of %s is %q", res.Task, p)
		}
	case StatusDeferred:
		if res.Task != a.FollowID || follow != res.Task || task["state"] != StateScheduled {
			return fmt.Sprintf("deferred into %s (state %q), the key owes %q", res.Task, task["state"], follow)
		}
		if before.state != StateActive && !noteLive(before.mode[FieldOutlived]) { // (o: its handler still runs, asynq gave it up)
			return "deferred behind a holder in state " + before.state + ", not running"
		}
	case StatusCooling:
		if res.Task != before.value.Holder || !before.live(w.s.cfg.HealGrace) {
			return "cooling, but the key was not held on purpose by " + res.Task
		}
	case StatusReserved:
		if before.value.Kind != HoldWrap || before.state != "" {
			return "reserved, but the lock is not one taken before its task was stored"
		}
	case StatusSelf, StatusConflict:
		if !a.Caller && res.Status == StatusSelf && before.value.Holder != a.Ref.ID {
			return "self, but the lock names " + before.value.Holder
		}
	case StatusOver:
		if a.MaxPending == 0 || res.Waiting < int64(a.MaxPending) {
			return "over a bound the call did not set"
		}
	default:
		return "unexpected status"
	}
	return ""
}

func (w *scriptWorld) checkTaken(a *Acquire, res AcquireResult, before, after keyState) string {
	ctx := context.Background()
	if before.live(w.s.cfg.HealGrace) && before.value.Holder != a.Ref.ID {
		return "took a key held by " + before.value.Holder + " in state " + before.state
	}
	if v := w.rdb.Get(ctx, w.lock).Val(); v != a.Value {
		return fmt.Sprintf("taken, but the lock's value is %q", v)
	}
	if res.Stored != a.Direct {
		return "taken; stored " + fmt.Sprint(res.Stored)
	}
	if a.Direct {
		t := w.rdb.HGetAll(ctx, TaskKey(w.q, a.Ref.ID)).Val()
		want := map[bool]string{true: StateScheduled, false: StatePending}[a.DueAt != 0]
		if t["msg"] != string(a.Message.Encode()) || t["state"] != want {
			return fmt.Sprintf("taken, but the task stored is in state %q", t["state"])
		}
		if (t["unique_key"] == w.lock) != a.Unique {
			return fmt.Sprintf("taken; the task's unique key is %q (unique %v)", t["unique_key"], a.Unique)
		}
	}
	if a.MaxPending > 0 && w.rdb.ZScore(ctx, w.s.keys.Wait(w.q, "t"), w.fp).Err() != nil {
		return "taken under MaxPending, but not in the waiting set"
	}
	if a.Mode != nil && after.mode[FieldHolder] != a.Ref.ID {
		return "taken with a mode, but the mode record is about " + after.mode[FieldHolder]
	}
	return ""
}

// noteLive reports whether a mode record's FieldOutlived says a handler
// asynq gave up still runs.
func noteLive(o string) bool {
	until, err := strconv.ParseInt(o, 10, 64)
	return err == nil && until > time.Now().UnixMilli()
}
