package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Random lock states × random calls × random hints, in the checked build.
// For every acquire/start/finish call: a statusNeed reply must have changed
// nothing (no key written, no TTL moved), and no call may fail (an
// undeclared key fails in the checked build). The full Acquire loop must
// end in a final answer consistent with what is stored.

type scriptWorld struct {
	t    *testing.T
	rdb  *redis.Client
	s    *Store
	rng  *rand.Rand
	q    string
	fp   string
	lock string
	desc []string
	ids  map[string]string // role → ID
}

func (w *scriptWorld) note(f string, a ...any) { w.desc = append(w.desc, fmt.Sprintf(f, a...)) }

func (w *scriptWorld) pick(n int) int { return w.rng.IntN(n) }

var taskStates = []string{"", StatePending, StateScheduled, StateRetry, StateActive, StateCompleted, StateArchived}

func (w *scriptWorld) putTask(id, state string) {
	ctx := context.Background()
	if state == "" {
		return
	}
	m := &Message{Type: "t", Payload: []byte(`{"p":"` + id + `"}`), ID: id, Queue: w.q, Retry: 25, Timeout: time.Minute}
	w.rdb.HSet(ctx, TaskKey(w.q, id), "msg", m.Encode(), "state", state)
	switch state {
	case StatePending:
		w.rdb.LPush(ctx, PendingKey(w.q), id)
	case StateScheduled:
		w.rdb.ZAdd(ctx, ScheduledKey(w.q), redis.Z{Score: float64(time.Now().Add(time.Hour).Unix()), Member: id})
	}
}

// build makes a random lock state.
func (w *scriptWorld) build() {
	ctx := context.Background()
	k := w.s.keys
	// holder
	switch w.pick(5) {
	case 0:
		w.note("no holder")
	default:
		var id, stored string
		switch w.pick(4) {
		case 0:
			id = NewLockedID(w.fp)
			stored = PackOwner(id, w.fp)
		case 1:
			id = "cid-" + w.q
			stored = PackOwner(id, w.fp)
			w.rdb.Set(ctx, k.Index(w.q, id), w.fp, time.Hour)
		case 2:
			id = NewLockedID(w.fp)
			stored = id // earlier layout: whole ID
		case 3:
			id = NewLockedID("ffffffffffffffff") // a task of another key (moved lock)
			stored = PackOwner(id, w.fp)
		}
		w.ids["holder"] = id
		st := taskStates[w.pick(len(taskStates))]
		w.putTask(id, st)
		c := time.Now().Unix()
		if w.pick(2) == 0 {
			c = 1
		}
		fields := []any{FieldOwner, stored, FieldCreated, c}
		if w.pick(3) == 0 {
			fields = append(fields, FieldToken, "tok")
		}
		rp := []string{"", "d", "a"}[w.pick(3)]
		if rp != "" {
			fields = append(fields, FieldRunning, rp)
		}
		if w.pick(3) == 0 {
			fields = append(fields, FieldBounded, "1")
			w.rdb.ZAdd(ctx, k.Wait(w.q, "t"), redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: w.fp})
		}
		if w.pick(2) == 0 {
			fields = append(fields, FieldFolds, w.pick(5))
		}
		f := ""
		if w.pick(2) == 0 {
			f = NewLockedID(w.fp)
			fields = append(fields, FieldFollow, f)
			fst := taskStates[w.pick(len(taskStates))]
			w.putTask(f, fst)
			w.ids["follow"] = f
			w.note("follow %s state %q", f, fst)
			if w.pick(2) == 0 {
				w.rdb.Set(ctx, k.Follow(w.q, w.fp), f, time.Hour)
				w.note("F → follow")
			}
		}
		w.rdb.HSet(ctx, w.lock, fields...)
		w.rdb.Expire(ctx, w.lock, time.Hour)
		w.note("holder %s (stored %q) state %q fields %v", id, stored, st, fields)
	}
	// an orphan follow-up pointer
	if w.pick(3) == 0 && w.rdb.Exists(ctx, k.Follow(w.q, w.fp)).Val() == 0 {
		o := NewLockedID(w.fp)
		st := taskStates[w.pick(len(taskStates))]
		w.putTask(o, st)
		w.rdb.Set(ctx, k.Follow(w.q, w.fp), o, time.Hour)
		w.ids["orphan"] = o
		w.note("orphan F %s state %q", o, st)
	}
}

// snapshot is every key of the world's queue (and its index/wait/follow
// keys), dumped, with its TTL.
func (w *scriptWorld) snapshot() map[string]string {
	ctx := context.Background()
	out := map[string]string{}
	for _, pat := range []string{"asynq:{" + w.q + "}:*", w.s.keys.Prefix() + ":{" + w.q + "}:*"} {
		keys, _ := w.rdb.Keys(ctx, pat).Result()
		for _, key := range keys {
			d := w.rdb.Dump(ctx, key).Val()
			ttl := w.rdb.PTTL(ctx, key).Val()
			out[key] = fmt.Sprintf("%x ttl~%d", d, (ttl+30*time.Second)/time.Minute)
		}
	}
	return out
}

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

// call makes a random acquire call.
func (w *scriptWorld) call() (*Acquire, hint) {
	id := NewLockedID(w.fp)
	indexed := w.pick(4) == 0
	if indexed {
		id = "new-" + w.q
		if w.pick(3) == 0 {
			w.putTask(id, taskStates[1+w.pick(len(taskStates)-1)])
			w.note("new caller ID already in asynq")
		}
	}
	a := &Acquire{Ref: Ref{Queue: w.q, FP: w.fp, ID: id, Type: "t", Indexed: indexed},
		OnWaiting: []Fold{FoldReject, FoldReplace, FoldMerge}[w.pick(3)],
		OnRunning: []Running{RunReject, RunAllow, RunDefer}[w.pick(3)],
		TTL:       time.Hour, Now: time.Now(), Payload: []byte(`{"p":"new"}`)}
	if a.OnRunning == RunDefer {
		a.FollowID = NewLockedID(w.fp)
	}
	if w.pick(3) == 0 {
		a.MaxPending = 1 + w.pick(2)
	}
	if w.pick(2) == 0 {
		a.Direct, a.Message = true, Message{Type: "t", Payload: a.Payload, ID: id, Queue: w.q, Retry: 25, Timeout: time.Minute}
		if w.pick(3) == 0 {
			a.DueAt = time.Now().Add(time.Hour).Unix()
		}
	}
	// hint
	var h hint
	switch w.pick(5) {
	case 0:
	case 1: // right
		stored := w.rdb.HGet(context.Background(), w.lock, FieldOwner).Val()
		h = newHint(&a.Ref, stored, w.rdb.HGet(context.Background(), w.lock, FieldFollow).Val())
	case 2: // stale holder
		h = newHint(&a.Ref, PackOwner(NewLockedID(w.fp), w.fp), "")
	case 3: // stale follow
		h = newHint(&a.Ref, w.rdb.HGet(context.Background(), w.lock, FieldOwner).Val(), NewLockedID(w.fp))
	case 4: // orphan hint
		h = newHint(&a.Ref, "", w.ids["orphan"])
	}
	h.read = w.pick(2) == 0
	w.note("call %+v msg=%v hint holder=%q follow=%q read=%v", *a, a.Direct, h.holder, h.follow, h.read)
	return a, h
}

func TestAcquireNeedIsPure(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	fails := 0
	for i := 0; i < 3000 && fails < 15; i++ {
		q := fmt.Sprintf("%s-%d", redistest.Uniq(t), i)
		fp := fmt.Sprintf("%016x", rng.Uint64())
		w := &scriptWorld{t: t, rdb: rdb, s: s, rng: rng, q: q, fp: fp, lock: s.keys.Lock(q, fp), ids: map[string]string{}}
		w.build()
		a, h := w.call()
		before := w.snapshot()
		for round := 0; round < 2; round++ {
			keys, args := a.build(s, w.lock, &h, round > 0)
			v, err := s.sc.acquire.Run(ctx, rdb, keys, args...).Result()
			if err != nil {
				fails++
				t.Errorf("case %d round %d: script error %v\n  %s\n  keys %v", i, round, err, strings.Join(w.desc, "\n  "), keys)
				break
			}
			rep, err := parseReply(v)
			if err != nil {
				fails++
				t.Errorf("case %d: reply %v: %v", i, v, err)
				break
			}
			if rep.status != statusNeed {
				break
			}
			if d := diff(before, w.snapshot()); len(d) > 0 {
				fails++
				t.Errorf("case %d round %d: need %v changed %v\n  %s", i, round, rep.strs, d, strings.Join(w.desc, "\n  "))
				break
			}
			h = newHint(&a.Ref, rep.str(1), rep.str(2))
			h.read = true
		}
	}
}

// The full Acquire loop on random states ends in a final answer, never an
// error, and what it answers is what is stored.
func TestAcquireAnswersAgree(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	fails := 0
	for i := 0; i < 2000 && fails < 15; i++ {
		s := newTestStore(t, rdb)
		q := fmt.Sprintf("%s-%d", redistest.Uniq(t), i)
		fp := fmt.Sprintf("%016x", rng.Uint64())
		w := &scriptWorld{t: t, rdb: rdb, s: s, rng: rng, q: q, fp: fp, lock: s.keys.Lock(q, fp), ids: map[string]string{}}
		w.build()
		a, h := w.call()
		if h.holder != "" || h.follow != "" {
			s.hints.put(w.lock, h)
		}
		res, err := s.Acquire(ctx, a)
		if err != nil {
			fails++
			t.Errorf("case %d: %v\n  %s", i, err, strings.Join(w.desc, "\n  "))
			continue
		}
		owner := UnpackOwner(rdb.HGet(ctx, w.lock, FieldOwner).Val(), fp)
		bad := ""
		switch res.Status {
		case StatusTaken:
			if owner != a.Ref.ID {
				bad = "taken, but the lock names " + owner
			}
			if res.Stored && rdb.HGet(ctx, TaskKey(q, a.Ref.ID), "state").Val() == "" {
				bad = "stored, but no task record"
			}
			if !res.Stored && a.Direct && rdb.Exists(ctx, TaskKey(q, a.Ref.ID)).Val() == 1 && w.ids["newExisting"] == "" {
				// the caller will enqueue through asynq: a record that exists is a conflict asynq reports
			}
			if a.Ref.Indexed && rdb.Get(ctx, s.keys.Index(q, a.Ref.ID)).Val() != fp {
				bad = "taken with a caller-chosen ID, but no index key"
			}
			if a.MaxPending > 0 && rdb.ZScore(ctx, s.keys.Wait(q, "t"), fp).Err() != nil {
				bad = "taken under MaxPending, but not in the waiting set"
			}
		case StatusHeld:
			follow := rdb.HGet(ctx, w.lock, FieldFollow).Val()
			if res.Task != owner && res.Task != follow {
				bad = fmt.Sprintf("held by %s, but the lock names %s (follow %q)", res.Task, owner, follow)
			}
		case StatusReplaced:
			p := rdb.HGet(ctx, TaskKey(q, res.Task), "msg").Val()
			if !strings.Contains(p, `{"p":"new"}`) {
				bad = "replaced, but the payload of " + res.Task + " is not the new one"
			}
			if st := rdb.HGet(ctx, TaskKey(q, res.Task), "state").Val(); !Waiting(st) {
				bad = "replaced into a task in state " + st
			}
			if res.Task != owner && res.Task != rdb.HGet(ctx, w.lock, FieldFollow).Val() {
				bad = "replaced into " + res.Task + ", which the lock does not name (owner " + owner + ")"
			}
		case StatusDeferred:
			if st := rdb.HGet(ctx, TaskKey(q, res.Task), "state").Val(); st != StateScheduled {
				bad = "deferred into a follow-up in state " + st
			}
		case StatusMerge:
			if st := rdb.HGet(ctx, TaskKey(q, res.Task), "state").Val(); !Waiting(st) {
				bad = "merge target in state " + st
			}
		}
		if bad != "" {
			fails++
			t.Errorf("case %d: %+v: %s\n  %s", i, res, bad, strings.Join(w.desc, "\n  "))
		}
	}
}
