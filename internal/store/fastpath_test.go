package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// begin and done are start's and finish's common cases: on random lock
// states, in the checked build, each either declines and changes nothing,
// or leaves Redis exactly as the general script would have (same reply
// meaning, same keys, same contents, same TTLs to the second).

// rawState is every key of a world's queue, dumped with its TTL, to put
// back.
type rawState map[string]struct {
	dump string
	pttl time.Duration
}

func (w *scriptWorld) raw() rawState {
	ctx := context.Background()
	out := rawState{}
	for _, pat := range []string{"asynq:{" + w.q + "}:*", w.s.keys.Prefix() + ":{" + w.q + "}:*"} {
		for _, key := range w.rdb.Keys(ctx, pat).Val() {
			out[key] = struct {
				dump string
				pttl time.Duration
			}{w.rdb.Dump(ctx, key).Val(), w.rdb.PTTL(ctx, key).Val()}
		}
	}
	return out
}

func (w *scriptWorld) restore(st rawState) {
	ctx := context.Background()
	for _, pat := range []string{"asynq:{" + w.q + "}:*", w.s.keys.Prefix() + ":{" + w.q + "}:*"} {
		if keys := w.rdb.Keys(ctx, pat).Val(); len(keys) > 0 {
			w.rdb.Del(ctx, keys...)
		}
	}
	for k, v := range st {
		ttl := v.pttl
		if ttl < 0 {
			ttl = 0
		}
		if err := w.rdb.Restore(ctx, k, ttl, v.dump).Err(); err != nil {
			w.t.Fatalf("restore %s: %v", k, err)
		}
	}
}

// canon is every key of the world's queue by its contents (not DUMP's
// bytes, which differ with the order of writes) and its TTL in seconds.
func (w *scriptWorld) canon() map[string]string {
	ctx := context.Background()
	out := map[string]string{}
	for _, pat := range []string{"asynq:{" + w.q + "}:*", w.s.keys.Prefix() + ":{" + w.q + "}:*"} {
		for _, key := range w.rdb.Keys(ctx, pat).Val() {
			var v any
			switch w.rdb.Type(ctx, key).Val() {
			case "hash":
				v = w.rdb.HGetAll(ctx, key).Val() // (fmt prints maps sorted)
			case "zset":
				v = w.rdb.ZRangeWithScores(ctx, key, 0, -1).Val()
			case "list":
				v = w.rdb.LRange(ctx, key, 0, -1).Val()
			default:
				v = w.rdb.Get(ctx, key).Val()
			}
			out[key] = fmt.Sprintf("%v ttl~%d", v, (w.rdb.PTTL(ctx, key).Val()+500*time.Millisecond)/time.Second)
		}
	}
	return out
}

// spice adds what build leaves out: a lock written with its task (v), a
// cooldown, a cooling mark; and makes the holder the task under test now
// and then.
func (w *scriptWorld) spice() {
	ctx := context.Background()
	if w.rdb.Exists(ctx, w.lock).Val() == 0 {
		return
	}
	for _, f := range []struct {
		name, val string
		odds      int
	}{{FieldStored, "1", 2}, {FieldCoolEnd, fmt.Sprint(time.Now().Add(time.Hour).UnixMilli()), 5}, {FieldCooling, "1", 8}} {
		if w.pick(f.odds) == 0 {
			w.rdb.HSet(ctx, w.lock, f.name, f.val)
			w.note("lock %s=%s", f.name, f.val)
		}
	}
}

func newFastWorld(t *testing.T, rdb *redis.Client, s *Store, rng *rand.Rand, i int) *scriptWorld {
	q := fmt.Sprintf("%s-%d", redistest.Uniq(t), i)
	fp := fmt.Sprintf("%016x", rng.Uint64())
	w := &scriptWorld{t: t, rdb: rdb, s: s, rng: rng, q: q, fp: fp, lock: s.keys.Lock(q, fp), ids: map[string]string{}}
	w.build()
	w.spice()
	return w
}

// subject is the task the attempt is of: mostly the lock's holder.
func (w *scriptWorld) subject() string {
	if id := w.ids["holder"]; id != "" && w.pick(4) != 0 {
		if fp, ok := ParseLockedID(id); ok && fp == w.fp {
			return id
		}
	}
	id := NewLockedID(w.fp)
	w.putTask(id, StateActive)
	return id
}

func TestBeginAgreesWithStart(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 6))
	took := 0
	for i := 0; i < 1200 && !t.Failed(); i++ {
		w := newFastWorld(t, rdb, s, rng, i)
		id := w.subject()
		if w.rdb.Exists(ctx, TaskKey(w.q, id)).Val() == 0 {
			w.putTask(id, StateActive) // a running task's record exists
		}
		r := Ref{Queue: w.q, FP: w.fp, ID: id, Type: "t"}
		before := w.raw()
		keys := []string{w.lock, s.keys.Follow(w.q, w.fp)}
		oks, err := s.runBegin(ctx, keys, []any{r.stored(), r.ID, "tok2", int64(30000)}, 1)
		if err != nil {
			t.Fatalf("case %d: begin: %v\n  %s", i, err, strings.Join(w.desc, "\n  "))
		}
		afterBegin := w.canon()
		w.restore(before)
		if !oks[0] {
			if d := diff(w.canon(), afterBegin); len(d) > 0 {
				t.Errorf("case %d: begin declined but changed %v\n  %s", i, d, strings.Join(w.desc, "\n  "))
			}
			continue
		}
		took++
		res, err := s.start(ctx, &Start{Ref: r, Token: "tok2", Lease: 30 * time.Second})
		if err != nil || res.Status != StatusTaken || res.Follow != "" || res.New {
			t.Errorf("case %d: begin took the lock, start says %+v, %v\n  %s", i, res, err, strings.Join(w.desc, "\n  "))
		}
		if d := diff(w.canon(), afterBegin); len(d) > 0 {
			t.Errorf("case %d: begin and start differ: %v\n  %s\n  start: %v\n  begin: %v", i, d, strings.Join(w.desc, "\n  "), w.canon(), afterBegin)
		}
	}
	if took < 15 {
		t.Errorf("begin took only %d of the locks: the test does not reach its common case", took)
	}
}

func TestDoneAgreesWithFinish(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 8))
	released := 0
	for i := 0; i < 1200 && !t.Failed(); i++ {
		w := newFastWorld(t, rdb, s, rng, i)
		id := w.subject()
		tok := []string{"tok", "other", ""}[w.pick(3)]
		if tok == "" {
			tok = "tok"
			if w.rdb.Exists(ctx, w.lock).Val() == 1 {
				w.rdb.HSet(ctx, w.lock, FieldToken, tok)
			}
		}
		r := Ref{Queue: w.q, FP: w.fp, ID: id, Type: "t"}
		succeeded := w.pick(2) == 0
		before := w.raw()
		rv, err := s.sc.done.Run(ctx, rdb, []string{w.lock}, r.stored(), r.ID, tok).Result()
		if err != nil {
			t.Fatalf("case %d: done: %v\n  %s", i, err, strings.Join(w.desc, "\n  "))
		}
		rs, err := parseDone(rv, 1)
		if err != nil {
			t.Fatal(err)
		}
		v := map[bool]int64{true: 1}[rs[0].Released]
		if rs[0].Finish {
			v = 2
		}
		afterDone := w.canon()
		w.restore(before)
		if v == int64(2) {
			if d := diff(w.canon(), afterDone); len(d) > 0 {
				t.Errorf("case %d: done passed on but changed %v\n  %s", i, d, strings.Join(w.desc, "\n  "))
			}
			continue
		}
		// The general script, as Finish would call it without the fast path.
		kl := newKeyList()
		kl.add(roleLock, w.lock)
		kl.add(roleScheduled, ScheduledKey(w.q))
		kl.add(rolePending, PendingKey(w.q))
		kl.add(roleFollow, s.keys.Follow(w.q, w.fp))
		args := []any{kl.roleString(), r.stored(), tok, "release", int64(1000), int64(1000), s.parkSeconds(), "", "", r.ID}
		if succeeded {
			args = append(args, "1", "t")
		}
		fv, err := s.sc.finish.Run(ctx, rdb, kl.keys, args...).Result()
		if err != nil {
			t.Fatalf("case %d: finish: %v", i, err)
		}
		rep, err := parseReply(fv)
		if err != nil {
			t.Fatal(err)
		}
		owned := rep.status == StatusTaken
		if owned != (v == int64(1)) || (owned && (rep.str(0) != "" || rep.str(1) != "")) {
			t.Errorf("case %d: done says %v, finish %v\n  %s", i, v, rep.strs, strings.Join(w.desc, "\n  "))
		}
		if owned {
			released++
		}
		if d := diff(w.canon(), afterDone); len(d) > 0 {
			t.Errorf("case %d: done and finish differ: %v\n  %s", i, d, strings.Join(w.desc, "\n  "))
		}
	}
	if released < 30 {
		t.Errorf("done released only %d locks: the test does not reach its common case", released)
	}
}

// beginCounter counts the begin script's calls through a client.
type beginCounter struct {
	sha   string
	calls atomic.Int64
}

func (c *beginCounter) count(cmd redis.Cmder) {
	if a := cmd.Args(); len(a) > 1 && a[1] == c.sha {
		c.calls.Add(1)
	}
}

// The attempts that begin at one moment share begin calls, and each gets
// exactly what a begin of its own gives: its lock under its own token for
// one lease, or, where the lock holds more (a follow-up), start's answer.
func TestBeginsOfConcurrentAttemptsShareCalls(t *testing.T) {
	rdb := redistest.Client(t)
	s := newTestStore(t, rdb)
	ctx := context.Background()
	counter := &beginCounter{sha: s.sc.begin.Hash()}
	rdb.AddHook(redistest.CmdHook(counter.count))
	q := redistest.Uniq(t)
	const n = 200
	refs := make([]Ref, n)
	for i := range refs {
		fp := fmt.Sprintf("%016x", i+1)
		r := Ref{Queue: q, FP: fp, ID: NewLockedID(fp), Type: "t"}
		refs[i] = r
		lock := s.keys.LockOf(&r)
		fields := []any{FieldOwner, r.stored(), "c", time.Now().Unix(), "v", "1"}
		if i%10 == 0 {
			fields = append(fields, "f", NewLockedID(fp)) // owes a follow-up: start settles it
		}
		rdb.HSet(ctx, lock, fields...)
		rdb.PExpire(ctx, lock, time.Hour)
		rdb.HSet(ctx, TaskKey(q, r.ID), "state", StateActive)
		t.Cleanup(func() { rdb.Del(context.Background(), lock, TaskKey(q, r.ID)) })
	}
	var wg sync.WaitGroup
	results := make([]StartResult, n)
	errs := make([]error, n)
	for i := range refs {
		wg.Go(func() {
			results[i], errs[i] = s.Start(ctx, &Start{Ref: refs[i], Token: fmt.Sprintf("tok-%d", i), Lease: 30 * time.Second})
		})
	}
	wg.Wait()
	for i, r := range refs {
		res, err := results[i], errs[i]
		owes := i%10 == 0
		if err != nil || res.Status != StatusTaken || res.Begun == owes || (res.Follow != "") != owes {
			t.Fatalf("attempt %d: %+v, %v; want taken (begun %v)", i, res, err, !owes)
		}
		lock := s.keys.LockOf(&r)
		if tok := rdb.HGet(ctx, lock, FieldToken).Val(); tok != fmt.Sprintf("tok-%d", i) {
			t.Fatalf("attempt %d: lock token %q", i, tok)
		}
		if pttl := rdb.PTTL(ctx, lock).Val(); pttl <= 0 || pttl > 30*time.Second {
			t.Fatalf("attempt %d: lock lives %v more, want the lease", i, pttl)
		}
	}
	if calls := counter.calls.Load(); calls >= n {
		t.Fatalf("%d begin calls for %d attempts at once: none shared", calls, n)
	} else {
		t.Logf("%d attempts began in %d begin calls", n, calls)
	}
}

// Close stops the beginner whether or not it ever ran, any number of times,
// and begins after it go straight to Redis.
func TestBeginnerStopsOnceOrTwice(t *testing.T) {
	rdb := redistest.Client(t)
	idle := newTestStore(t, rdb)
	idle.Close()
	idle.Close()
	s := newTestStore(t, rdb)
	q := redistest.Uniq(t)
	r := Ref{Queue: q, FP: "00000000000000aa", ID: NewLockedID("00000000000000aa"), Type: "t"}
	lock := s.keys.LockOf(&r)
	t.Cleanup(func() { rdb.Del(context.Background(), lock) })
	for i := 0; i < 2; i++ {
		rdb.HSet(context.Background(), lock, FieldOwner, r.stored(), "c", time.Now().Unix(), "v", "1")
		ok, err := s.bg.begin(context.Background(), &r, lock, s.keys.Follow(q, r.FP), "tok", time.Minute)
		if err != nil || !ok {
			t.Fatalf("begin %d: %v, %v", i, ok, err)
		}
		s.Close()
		s.Close()
	}
}
