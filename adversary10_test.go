package dedup

import (
	"context"
	"errors"
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

// Adversarial tests, round 10: begins shared between attempts
// (internal/store/begin.go) and releases sent off the handler's path
// (releaser.go), through the public API on a real asynq server and
// redis-server. Each test quotes the README promise it attacks.

// 1. README (Lock lifecycle): "other error or panic, retries left | held,
// not running, for RetryDelayFunc(n) + TTL"; (Failure modes) "Redis down
// when a task starts | fail-closed: the handler does not run, asynq retries
// it"; the matrix: "Timeout or Deadline passed … | retry | duplicate".
//
// Redis stalls while an attempt begins; asynq's Timeout ends the attempt's
// context while its begin call is out, so the attempt returns at once (its
// begin "may still land: the attempt's retry replaces its token") and asynq
// schedules a retry. The begin then lands: it sets the attempt's token and
// shortens the lock to one Lease, and nothing settles the attempt (it never
// ran). The lock expires while the task waits for its retry, and the key's
// next enqueue is accepted beside the live task.
func TestAdversary10AbandonedBeginLetsTheLockOfARetryingTaskExpire(t *testing.T) {
	h := a9NewClientHarness(t, Rule{})
	ctx := context.Background()
	proxy, sd := proxiedLockStore(t, h, Config{Rules: counterRules(Rule{}).Rules, LockTimeout: 3 * time.Second, Lease: time.Second})
	ran := make(chan string, 4)
	a9Server(t, h.rdb, h.queue, sd.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		return nil
	})), func(c *asynq.Config) {
		c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return 6 * time.Second }
	})
	proxy.stall()
	t.Cleanup(proxy.resume)
	task := counterTask("k", 1, 1)
	a := h.enqueue(task, asynq.Timeout(300*time.Millisecond))
	a9Timed(t, a.ID)
	key := h.keyOf(task, h.queue)
	eventually(t, "A's attempt given up by its Timeout, a retry scheduled", func() bool { return h.taskState(a.ID) == asynq.TaskStateRetry })
	ti, err := h.insp.GetTaskInfo(h.queue, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	proxy.resume() // the begin call lands now
	eventually(t, "the abandoned begin landed", func() bool { return h.rdb.HGet(ctx, key, "tok").Val() != "" })
	pttl := h.rdb.PTTL(ctx, key).Val()
	t.Logf("after the abandoned begin landed: lock lives %v more; A's retry is due in %v", pttl.Round(time.Millisecond), time.Until(ti.NextProcessAt).Round(time.Millisecond))
	// Wait (bounded: until shortly before A's retry) for the lock to lapse.
	for time.Until(ti.NextProcessAt) > time.Second && h.rdb.Exists(ctx, key).Val() == 1 {
		time.Sleep(50 * time.Millisecond)
	}
	if st := h.taskState(a.ID); st != asynq.TaskStateRetry {
		t.Fatalf("A is %v, want still waiting for its retry", st)
	}
	select {
	case id := <-ran:
		t.Fatalf("handler ran (%s) though its start was abandoned", id)
	default:
	}
	info, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err == nil {
		t.Errorf("duplicate of the key accepted as %s while A (%s) waits for its retry: A's lock, shortened to one Lease (%v) by its abandoned begin, lapsed", info.ID, a.ID, sd.cfg.Lease)
	} else if !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Errorf("enqueue while A waits for its retry: %v, want a duplicate", err)
	}
}

// 2. README (Lock lifecycle): "success | released, … — or, with a
// follow-up owed (RunningDefer), handed to it and the follow-up queued";
// (Diagnostics) counters count each event once.
//
// A follow-up made while the holder runs (the attempt did not know of it
// when it began, so its release goes through the releaser): the batched
// done call finds the follow-up and leaves the lock to finish, which must
// hand the key over and queue the follow-up; every release counted once.
func TestAdversary10FollowUpMadeWhileRunningQueuedByTheBatchedRelease(t *testing.T) {
	h := a9NewClientHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
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
	a9Timed(t, a.ID)
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

// 3. README (Lock lifecycle): "success | released, just after the handler
// returns, in one call with the other releases of that moment (a few ms …)";
// (Failure modes) "a Cluster master dies | its queue's calls fail …; the
// other masters' queues go on | errors on that queue only".
//
// On a Cluster, one master hangs just as a task of its queue succeeds, so
// that task's release call hangs (until LockTimeout). A task of a queue on a
// healthy master then succeeds: its release waits in the releaser behind
// the hung call (one batch at a time), and its key stays held for up to
// LockTimeout instead of a few ms.
func TestAdversary10ReleaseOnHealthyMasterWaitsForHungMaster(t *testing.T) {
	_, c := redistest.OwnCluster(t, 3, false)
	ctx := context.Background()
	queues := queuesOnEveryMaster(t, c, "a10")
	hungQ, okQ := queues[0], queues[1]
	prefix := "dd-" + uniq(t)
	d, err := New(ctx, c, Config{Prefix: prefix, LockTimeout: 3 * time.Second, Logger: quietLogger(), Rules: counterRules(Rule{}).Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	hungNode, err := c.MasterForKey(ctx, "{"+hungQ+"}")
	if err != nil {
		t.Fatal(err)
	}
	seen := &a10Seen{mark: prefix + ":{" + hungQ + "}:l:", seen: make(chan struct{})}
	c.AddHook(redistest.CmdHook(seen.check))
	// The hung queue's handler pauses its master, then succeeds.
	_, _ = a9Server(t, c, hungQ, d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
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
	_, _ = a9Server(t, c, okQ, okMW(d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))), nil)
	client := d.NewClient()
	// The healthy queue is published in asynq's registry of queues now:
	// that key (asynq:queues) has one slot, which may be the hung master's.
	if err := d.store.PublishQueue(ctx, okQ); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(counterTask("h", 1, 1), asynq.Queue(hungQ)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, seen.seen, "the hung master's release sent")
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
	for time.Since(at) < 5*time.Second && c.Exists(ctx, key).Val() == 1 {
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(at)
	t.Logf("the healthy queue's handler returned %v after the hung release was sent; its lock went %v after that", at.Sub(sentAt).Round(time.Millisecond), took.Round(time.Millisecond))
	if at.Sub(sentAt) > 2*time.Second {
		t.Skip("the healthy queue's task itself ran late (asynq's own calls met the hung master): inconclusive")
	}
	if c.Exists(ctx, key).Val() == 1 || took > time.Second {
		t.Errorf("the lock of a task on a healthy master was released %v after its handler returned (want a few ms): it waited behind the hung master's release", took.Round(time.Millisecond))
	}
}

func ptr[T any](v T) *T { return &v }

// a10Seen signals the first script call carrying a key with mark once armed.
type a10Seen struct {
	mark  string
	armed atomic.Bool
	once  sync.Once
	seen  chan struct{}
}

func (h *a10Seen) check(cmd redis.Cmder) {
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
