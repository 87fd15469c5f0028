package dedup

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Adversarial tests, round 10, on the worker's Redis calls, through the
// public API on a real asynq server and redis-server. Each test quotes the
// promise it attacks.

// 1. A task whose key's policy acts only at enqueue costs the worker no
// Redis call of the library's: with the library's own Redis connection
// stalled, its attempt still runs, succeeds, and asynq's own done script
// releases its key.
func TestPlainTaskRunsWhileTheLibrarysRedisStalls(t *testing.T) {
	h := newDirectHarness(t, Rule{})
	proxy, sd := proxiedLockStore(t, h, Config{Rules: counterRules(Rule{}).Rules, LockTimeout: 3 * time.Second})
	ran := make(chan string, 4)
	serveRaw(t, h.rdb, h.queue, sd.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		return nil
	})), nil)
	task := counterTask("k", 1, 1)
	a := h.enqueue(task)
	requirePlainID(t, a.ID)
	proxy.stall()
	t.Cleanup(proxy.resume)
	if id := waitFor(t, ran, "A runs while the library's Redis stalls"); id != a.ID {
		t.Fatalf("ran %s", id)
	}
	key := h.keyOf(task, h.queue)
	eventually(t, "asynq completes A and releases its key", func() bool { return h.rdb.Exists(context.Background(), key).Val() == 0 })
	if st := sd.Stats(); st.RedisErrors != 0 || st.Released != 1 {
		t.Errorf("stats %+v: want one release, no Redis error (the middleware made no call)", st)
	}
}

// 2. README (Lock lifecycle): "success | released, … — or, with a
// follow-up owed (RunningDefer), handed to it and the follow-up queued";
// (Diagnostics) counters count each event once.
//
// A follow-up made while the holder runs: the holder's end (RunningDefer:
// one settle call) must hand the key over and queue the follow-up; every
// release counted once.
func TestDeferFollowUpQueuedByTheHoldersBatchedRelease(t *testing.T) {
	h := newDirectHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
	gate := make(chan struct{})
	started := make(chan int, 4)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		seq := decodeCounter(task).Seq
		started <- seq
		if seq == 1 {
			<-gate
		}
		return nil
	}, nil)
	a := h.enqueue(counterTask("k", 1, 1))
	requirePlainID(t, a.ID)
	if seq := waitFor(t, started, "A runs"); seq != 1 {
		t.Fatalf("ran %d first", seq)
	}
	b, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil {
		t.Fatalf("enqueue while A runs (RunningDefer): %v", err)
	}
	close(gate)
	if seq := waitFor(t, started, "the follow-up runs"); seq != 2 {
		t.Fatalf("ran %d after A, want the follow-up (2)", seq)
	}
	eventually(t, "both releases counted", func() bool { return h.d.Stats().Released >= 2 })
	if st := h.d.Stats(); st.Released != 2 || st.LockLost != 0 || st.RedisErrors != 0 || st.Started != 2 {
		t.Errorf("stats %+v; want 2 started and released, no loss, no errors", st)
	}
	eventually(t, "no lock left", func() bool { return len(h.locks()) == 0 })
	t.Logf("A %s, follow-up %s", a.ID, b.ID)
}

// 3. (Failure modes) "a Cluster master dies | its queue's calls fail …;
// the other masters' queues go on | errors on that queue only".
//
// On a Cluster, one master hangs just as a task of its queue succeeds
// under a Cooldown, so that task's settle call (its cooling hold) hangs
// (until LockTimeout). A task of a queue on a healthy master then succeeds:
// its settle must not wait behind the hung one, so its key cools at once.
func TestClusterSettleOnAHealthyMasterDoesNotWaitForAHungOne(t *testing.T) {
	_, c := redistest.OwnCluster(t, 3, false)
	ctx := context.Background()
	queues := queuesOnEveryMaster(t, c, "a10")
	hungQ, okQ := queues[0], queues[1]
	prefix := "dd-" + uniq(t)
	d, err := New(ctx, c, Config{Prefix: prefix, LockTimeout: 3 * time.Second, Logger: quietLogger(), Rules: counterRules(Rule{Cooldown: time.Hour}).Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	hungNode, err := c.MasterForKey(ctx, "{"+hungQ+"}")
	if err != nil {
		t.Fatal(err)
	}
	seen := &scriptSeen{mark: lockKeyHex(prefix, hungQ, ""), seen: make(chan struct{})}
	c.AddHook(redistest.CmdHook(seen.check))
	// The hung queue's handler pauses its master, then succeeds.
	_, _ = serveRaw(t, c, hungQ, d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if err := hungNode.Do(context.Background(), "CLIENT", "PAUSE", 5000, "ALL").Err(); err != nil {
			t.Errorf("CLIENT PAUSE: %v", err)
		}
		seen.armed.Store(true)
		return nil
	})), nil)
	returned := make(chan time.Time, 1)
	okMW := func(next asynq.Handler) asynq.Handler { // outside dedup's: runs after its settle
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			err := next.ProcessTask(ctx, t)
			returned <- time.Now()
			return err
		})
	}
	_, _ = serveRaw(t, c, okQ, okMW(d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))), nil)
	client := d.NewClient()
	// The healthy queue is published in asynq's registry of queues now:
	// that key (asynq:queues) has one slot, which may be the hung master's.
	if err := d.store.PublishQueue(ctx, okQ); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(counterTask("h", 1, 1), asynq.Queue(hungQ)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, seen.seen, "the hung master's settle sent")
	sentAt := time.Now()
	okTask := counterTask("o", 1, 1)
	if _, err := client.Enqueue(okTask, asynq.Queue(okQ)); err != nil {
		t.Fatal(err)
	}
	at := waitFor(t, returned, "the healthy queue's task succeeds")
	fp, err := d.fingerprintHex(okTask.Type(), okTask.Payload(), ptr(d.ruleFor(okTask.Type())))
	if err != nil {
		t.Fatal(err)
	}
	key := lockKeyHex(prefix, okQ, fp)
	cooling := func() bool { return strings.HasPrefix(c.Get(ctx, key).Val(), "~c:") }
	// The settle is written before the handler's result reaches asynq: by
	// the time the outer middleware sees the handler return, it is done.
	took := time.Since(at)
	t.Logf("the healthy queue's handler returned %v after the hung settle was sent", at.Sub(sentAt).Round(time.Millisecond))
	if at.Sub(sentAt) > 2*time.Second {
		t.Skip("the healthy queue's task itself ran late (asynq's own calls met the hung master): inconclusive")
	}
	if !cooling() {
		t.Errorf("the key of a task on a healthy master does not cool %v after its handler returned: its settle waited behind the hung master's", took.Round(time.Millisecond))
	}
}

func ptr[T any](v T) *T { return &v }

// scriptSeen signals the first script call carrying a key with mark once armed.
type scriptSeen struct {
	mark  string
	armed atomic.Bool
	once  sync.Once
	seen  chan struct{}
}

func (h *scriptSeen) check(cmd redis.Cmder) {
	if !h.armed.Load() {
		return
	}
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && strings.HasPrefix(s, h.mark) {
			h.once.Do(func() { close(h.seen) })
			return
		}
	}
}

var _ = fmt.Sprint
