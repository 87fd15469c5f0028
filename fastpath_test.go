package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"strconv"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// freeJob is a task keyed by user_id.
func freeJob(user int, mode string) *asynq.Task {
	b, _ := json.Marshal(faultJob{UserID: user, Mode: mode})
	return asynq.NewTask("free:job", b)
}

var freeRules = map[string]Rule{"free:job": {Fields: []string{"user_id"}}}

// A task NewClient stored with its lock starts free: its first attempt
// runs with the lock exactly as the producer wrote it (no start script, no
// token), the lock still reads as running and refuses duplicates, the
// heartbeat renews it for a Lease but never shortens it, and the release
// lands after the handler returns.
func TestFreeStartRunsOnTheProducersLock(t *testing.T) {
	h := newHarness(t, Config{Rules: freeRules})
	c := h.d.NewClient()
	ctx := context.Background()
	info, err := c.Enqueue(freeJob(42, ""), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := store.LockedUntil(info.ID); !ok {
		t.Fatalf("NewClient's task ID %q says nothing of its lock's lifetime", info.ID)
	}
	key := h.keyOf(freeJob(42, ""), h.queue)
	written := h.rdb.HGetAll(ctx, key).Val()

	started, release := make(chan map[string]string, 1), make(chan struct{})
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		started <- h.rdb.HGetAll(ctx, key).Val()
		<-release
		return nil
	}, nil)
	if during := waitFor(t, started, "the first attempt"); !maps.Equal(during, written) {
		t.Fatalf("the lock changed as its task started: %v, written %v", during, written)
	}
	if l, found, err := h.d.Lookup(ctx, freeJob(42, ""), asynq.Queue(h.queue)); err != nil || !found || l.State != "running" || l.Holder != info.ID {
		t.Fatalf("Lookup while it runs: %+v, %v, %v; want running, held by %s", l, found, err, info.ID)
	}
	var dup *DuplicateTaskError
	if _, err := c.Enqueue(freeJob(42, "again"), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != info.ID {
		t.Fatalf("duplicate while it runs: %v; want a DuplicateTaskError naming %s", err, info.ID)
	}
	h.d.hb.beat()
	if pttl := h.rdb.PTTL(ctx, key).Val(); pttl <= h.d.cfg.Lease {
		t.Fatalf("after a beat the lock lives %v more: a beat shortened what its task ID promises (TTL %v)", pttl, h.d.cfg.TTL)
	}
	h.rdb.PExpire(ctx, key, time.Second) // (as if most of its TTL had passed)
	h.d.hb.beat()
	if pttl := h.rdb.PTTL(ctx, key).Val(); pttl <= time.Second || pttl > h.d.cfg.Lease {
		t.Fatalf("after a beat the lock lives %v more, want the running lease (1s, %v]", pttl, h.d.cfg.Lease)
	}
	if h.rdb.HExists(ctx, key, "tok").Val() {
		t.Fatal("the beat gave the lock a token")
	}
	close(release)
	eventually(t, "the release", func() bool { return h.d.Stats().Released == 1 })
	if n := h.rdb.Exists(ctx, key).Val(); n != 0 {
		t.Fatal("lock still there after its release was counted")
	}
	if st := h.d.Stats(); st.Started != 1 || st.Processed != 1 || st.LockLost != 0 {
		t.Fatalf("stats %+v; want one started, processed and released, none lost", st)
	}
	if _, err := c.Enqueue(freeJob(42, "later"), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after the release: %v", err)
	}
}

// An attempt starts free only where nothing but its lock's owner can be
// met: every other attempt starts as before, under a token of its own.
func TestFreeStartOnlyWhereNothingElseCanBeMet(t *testing.T) {
	cases := []struct {
		name    string
		cfg     Config
		wrap    bool // enqueue through WrapClient (the lock before the task)
		failFor int  // attempts that fail first
		free    []bool
	}{
		{name: "first attempt", free: []bool{true}},
		{name: "retry", failFor: 1, free: []bool{true, false}},
		{name: "WrapClient", wrap: true, free: []bool{false}},
		{name: "Lease under asynq's", cfg: Config{Lease: 10 * time.Second}, free: []bool{false}},
		{name: "TTL within a Lease", cfg: Config{TTL: 20 * time.Second}, free: []bool{false}},
		{name: "Cooldown", cfg: Config{Rules: map[string]Rule{"free:job": {Fields: []string{"user_id"}, Cooldown: time.Millisecond}}}, free: []bool{false}},
		{name: "MaxPending", cfg: Config{Rules: map[string]Rule{"free:job": {Fields: []string{"user_id"}, MaxPending: 10}}}, free: []bool{false}},
		{name: "RunningAllow", cfg: Config{Rules: map[string]Rule{"free:job": {Fields: []string{"user_id"}, OnRunning: RunningAllow}}}, free: nil},
		{name: "RunningDefer", cfg: Config{Rules: map[string]Rule{"free:job": {Fields: []string{"user_id"}, OnRunning: RunningDefer}}}, free: []bool{true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.cfg.Rules == nil {
				tc.cfg.Rules = freeRules
			}
			h := newHarness(t, tc.cfg)
			if !tc.wrap {
				h.client = h.d.NewClient()
			}
			ctx := context.Background()
			key := h.keyOf(freeJob(7, ""), h.queue)
			type attempt struct {
				tok  bool
				lock bool
			}
			attempts := make(chan attempt, 4)
			h.serve(func(ctx context.Context, _ *asynq.Task) error {
				n, _ := asynq.GetRetryCount(ctx)
				attempts <- attempt{tok: h.rdb.HExists(ctx, key, "tok").Val(), lock: h.rdb.Exists(ctx, key).Val() == 1}
				if n < tc.failFor {
					return errors.New("flaky")
				}
				return nil
			}, nil)
			info := h.enqueue(freeJob(7, ""))
			_, timed := store.LockedUntil(info.ID)
			runs := max(len(tc.free), 1)
			for i := 0; i < runs; i++ {
				a := waitFor(t, attempts, "attempt "+strconv.Itoa(i))
				switch {
				case tc.free == nil: // RunningAllow: no lock while it runs
					if a.lock {
						t.Fatal("a RunningAllow task runs with its lock")
					}
				case tc.free[i] && (a.tok || !a.lock || !timed):
					t.Fatalf("attempt %d: token %v, lock %v, timed ID %v; want a free start", i, a.tok, a.lock, timed)
				case !tc.free[i] && (!a.tok || !a.lock):
					t.Fatalf("attempt %d: token %v, lock %v; want a start under a token", i, a.tok, a.lock)
				}
			}
			eventually(t, "the task completes and its key is free", func() bool {
				return h.taskState(info.ID) == 0 && h.rdb.Exists(ctx, key).Val() == 0
			})
		})
	}
}

// A worker killed while a free attempt runs leaves its lock as the producer
// wrote it: duplicates are refused while asynq's lease on the task lasts,
// and the key is free once that lease has lapsed (the worker is dead); the
// task asynq recovers then waits for the task that took the key, never
// running beside it.
func TestFreeStartWorkerKilledFreesTheKeyWhenAsynqsLeaseLapses(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, Config{RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return faultRetryDelay }})
	recheckAlways(h.d) // (else this process answers from the lock alone for a second after reading the owner's record)
	h.client = h.d.NewClient()
	ctx := context.Background()
	_, seen := faultRecords(t, h)
	job := func(mode string) *asynq.Task {
		b, _ := json.Marshal(faultJob{UserID: 9, Mode: mode})
		return asynq.NewTask(faultTaskType, b)
	}
	keyOpt := Fields("user_id")
	a := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, DefaultLease, "A")
	first := h.enqueue(job("block"), keyOpt, asynq.Retention(time.Hour))
	key := h.keyOf(job("block"), h.queue, keyOpt)
	faultPoll(t, 30*time.Second, "worker A runs the first task", func() bool { return seen("start", "A", first.ID) })
	if h.rdb.HExists(ctx, key, "tok").Val() {
		t.Fatal("the first attempt did not start free")
	}
	a.kill()
	if l, _, _ := h.d.Lookup(ctx, job("x"), asynq.Queue(h.queue), keyOpt); l.Holder != first.ID || l.State != "running" {
		t.Fatalf("Lookup while asynq's lease lasts: %+v, want running", l)
	}

	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(job("dup"), asynq.Queue(h.queue), keyOpt); !errors.As(err, &dup) || dup.TaskID != first.ID {
		t.Fatalf("enqueue while asynq's lease lasts: %v, want a duplicate of %s", err, first.ID)
	}
	// Time passes: asynq's lease on the task lapsed a minute ago (its
	// server died with the worker, so nothing renews it), long enough for
	// a recoverer to take the task back.
	if err := h.rdb.ZAdd(ctx, "asynq:{"+h.queue+"}:lease", redis.Z{Score: float64(time.Now().Add(-time.Minute).Unix()), Member: first.ID}).Err(); err != nil {
		t.Fatal(err)
	}
	if l, _, _ := h.d.Lookup(ctx, job("x"), asynq.Queue(h.queue), keyOpt); l.Holder != first.ID || l.State != "orphaned" {
		t.Fatalf("Lookup before the next enqueue: %+v, want the dead worker's lock, orphaned", l)
	}
	second := h.enqueue(job("hold"), keyOpt, asynq.Retention(time.Hour))
	if owner := h.lockOwner(key); owner != second.ID {
		t.Fatalf("lock owner %q after the lease lapsed, want the new task %s", owner, second.ID)
	}
	// B's recoverer runs as B starts: the killed task goes to retry, and
	// its retry finds the key held by the new task.
	b := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, DefaultLease, "B")
	faultPoll(t, 60*time.Second, "the recovered task is deferred by the held key", func() bool { return seen("busy", "B", first.ID) })
	if seen("end", "B", second.ID) || seen("start", "B", first.ID) {
		t.Fatal("the recovered task ran while the new task held the key")
	}
	if err := h.rdb.Set(ctx, faultReleaseKey(h.prefix, second.ID), "1", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.rdb.Del(context.Background(), faultReleaseKey(h.prefix, second.ID)) })
	faultPoll(t, 30*time.Second, "both tasks completed", func() bool {
		return h.taskState(second.ID) == asynq.TaskStateCompleted && h.taskState(first.ID) == asynq.TaskStateCompleted
	})
	faultPoll(t, 10*time.Second, "lock released", func() bool { return h.rdb.Exists(ctx, key).Val() == 0 })
	b.stop(t)
}

// README (Dedup.Release): a holder whose lock an operator released still
// runs, and takes the key again when it starts if the key is free; if a task
// of its type took the key since, it gives way. A waiting task NewClient
// stored, which would otherwise start free, does the same.
func TestFreeStartReleasedByAnOperatorTakesOrGivesWay(t *testing.T) {
	t.Run("key free: it takes the key", func(t *testing.T) {
		h := newHarness(t, counterRules(Rule{}))
		h.client = h.d.NewClient()
		ctx := context.Background()
		opts := []asynq.Option{asynq.Queue(h.queue)}
		a := h.enqueue(counterTask("k", 1, 1))
		if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", opts...); err != nil || !ok {
			t.Fatalf("forced release: %v %v", ok, err)
		}
		tr := newA6Tracker(a6CounterKey, 1)
		h.serve(tr.handler(nil), nil)
		t.Cleanup(tr.openAll)
		waitFor(t, tr.starts, "the released task runs")
		if l, found, err := h.d.Lookup(ctx, counterTask("k", 1, 1), opts...); err != nil || !found || l.Holder != a.ID || l.State != "running" {
			t.Fatalf("Lookup while the released task runs: %+v, %v, %v; want running, held by %s", l, found, err, a.ID)
		}
		var dup *DuplicateTaskError
		if _, err := h.client.Enqueue(counterTask("k", 1, 2), opts...); !errors.As(err, &dup) || dup.TaskID != a.ID {
			t.Fatalf("duplicate while the released task runs: %v; want one naming %s", err, a.ID)
		}
	})
	t.Run("key taken since: it gives way", func(t *testing.T) {
		h := newHarness(t, counterRules(Rule{}))
		h.client = h.d.NewClient()
		ctx := context.Background()
		opts := []asynq.Option{asynq.Queue(h.queue)}
		a := h.enqueue(counterTask("k", 1, 1))
		if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", opts...); err != nil || !ok {
			t.Fatalf("forced release: %v %v", ok, err)
		}
		b := h.enqueue(counterTask("k", 1, 2))
		tr := newA6Tracker(a6CounterKey, 1, 2)
		h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
		t.Cleanup(tr.openAll)
		first := waitFor(t, tr.starts, "the key's first run")
		tr.noSecondStart(t, first, 3*time.Second, "tasks "+a.ID+" and "+b.ID+" of one key")
	})
}
