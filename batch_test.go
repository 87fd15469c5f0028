package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// tripLog records the round trips clients make, by node: each pipeline
// with its commands' names, and each command sent alone (connection
// set-up, CLIENT and HELLO, left out).
type tripLog struct {
	mu    sync.Mutex
	trips []trip
}

type trip struct {
	addr  string
	cmds  []string
	first []string // each command's first key, for a script ("" for others)
}

// take returns the round trips made since the last take, and forgets them.
func (l *tripLog) take() []trip {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.trips
	l.trips = nil
	return out
}

func (l *tripLog) note(addr string, cmds []redis.Cmder) {
	tr := trip{addr: addr}
	for _, c := range cmds {
		n := c.Name()
		if n == "client" || n == "hello" {
			continue
		}
		first := ""
		if a := c.Args(); (n == "evalsha" || n == "eval") && len(a) > 3 && fmt.Sprint(a[2]) != "0" {
			first = fmt.Sprint(a[3])
		}
		tr.cmds, tr.first = append(tr.cmds, n), append(tr.first, first)
	}
	if len(tr.cmds) == 0 {
		return
	}
	l.mu.Lock()
	l.trips = append(l.trips, tr)
	l.mu.Unlock()
}

// locksOnly keeps the round trips of this package's scripts under prefix
// (the lock calls), leaving out asynq's own.
func locksOnly(trips []trip, prefix string) []trip {
	var out []trip
	for _, tr := range trips {
		if slices.ContainsFunc(tr.first, func(k string) bool { return strings.HasPrefix(k, prefix+":") }) {
			out = append(out, tr)
		}
	}
	return out
}

// tripHook is a go-redis hook that records a node's round trips in a
// tripLog.
type tripHook struct {
	log  *tripLog
	addr string
}

func (h tripHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h tripHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.log.note(h.addr, []redis.Cmder{cmd})
		return next(ctx, cmd)
	}
}
func (h tripHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.log.note(h.addr, cmds)
		return next(ctx, cmds)
	}
}

// batchRules: users keyed by user_id (rejected), counters by key (Replace).
func batchRules() Config {
	return Config{Rules: map[string]Rule{
		"user:reindex": {Fields: []string{"user_id"}},
		"counter":      {Fields: []string{"key"}, OnConflict: Replace},
	}}
}

// Each task of a batch gets what Submit would have given it alone: created,
// rejected with the holder, folded into the holder, or an error.
func TestEnqueueBatchAnswersEachTaskAsSubmitWould(t *testing.T) {
	h := newHarness(t, batchRules())
	h.client = h.d.NewClient()
	ctx := context.Background()
	held := h.enqueue(userTask(1, "a"), asynq.ProcessIn(time.Hour))
	waiting := h.enqueue(counterTask("w", 1, 1), asynq.ProcessIn(time.Hour))
	out := h.client.EnqueueBatch(ctx, []*asynq.Task{
		userTask(2, "a"),        // a new key
		userTask(1, "b"),        // the key held
		counterTask("w", 1, 2),  // folded into the waiting holder
		nil,                     // bad input
		counterTask("x", 1, 1),  // a new key
		asynq.NewTask("", nil),  // bad input
		userTask(3, "a"),        // a new key
		counterTask("w", 1, 3),  // folded again
		asynq.NewTask("t", nil), // a new key (the whole payload)
	}, asynq.Queue(h.queue))
	if len(out) != 9 {
		t.Fatalf("%d results for 9 tasks", len(out))
	}
	for _, i := range []int{0, 4, 6, 8} {
		if r := out[i]; r.Err != nil || r.Outcome != Created || r.Info == nil || r.Info.Queue != h.queue {
			t.Errorf("task %d: %+v, want created in %s", i, r, h.queue)
		}
	}
	var dup *DuplicateTaskError
	if r := out[1]; !errors.As(r.Err, &dup) || dup.Holder != held.ID || !errors.Is(r.Err, asynq.ErrDuplicateTask) {
		t.Errorf("held key: %+v, want a duplicate of %s", r, held.ID)
	}
	for _, i := range []int{2, 7} {
		if r := out[i]; r.Err != nil || r.Outcome != Replaced || r.TaskID != waiting.ID {
			t.Errorf("task %d: %+v, want replaced into %s", i, r, waiting.ID)
		}
	}
	for _, i := range []int{3, 5} {
		if r := out[i]; !errors.Is(r.Err, ErrInvalidOption) || r.Outcome != 0 || r.Info != nil {
			t.Errorf("task %d: %+v, want ErrInvalidOption and no result", i, r)
		}
	}
	if ti, err := h.insp.GetTaskInfo(h.queue, waiting.ID); err != nil || decodeCounter(asynq.NewTask("", ti.Payload)).Seq != 3 {
		t.Fatalf("the waiting holder: %+v, %v; want the batch's last payload (seq 3)", ti, err)
	}
	if n := h.queueSize(h.queue); n != 2+4 {
		t.Fatalf("queue holds %d tasks, want 6", n)
	}
	if out := h.client.EnqueueBatch(ctx, nil); out != nil {
		t.Fatalf("an empty batch: %v, want nil", out)
	}
}

// Bad input for some tasks of a batch gives each of them its own error
// (matching this package's sentinels, saying "dedup:"), takes no lock for
// them, and costs the good tasks nothing.
func TestEnqueueBatchBadInputLosesNothingAndLocksNothing(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			h := newHarness(t, batchRules())
			if direct {
				h.client = h.d.NewClient()
			}
			bad := map[int]error{
				1:  ErrInvalidOption,  // nil
				3:  ErrInvalidOption,  // blank type
				4:  ErrInvalidOption,  // an invalid option in NewTask
				6:  ErrFieldMissing,   // the rule's field missing
				7:  ErrInvalidOption,  // asynq.Unique in NewTask
				9:  ErrInvalidPayload, // not JSON
				10: ErrInvalidOption,  // Merge without a merge function
			}
			tasks := []*asynq.Task{
				userTask(1, ""), nil, userTask(2, ""), asynq.NewTask(" ", nil),
				asynq.NewTask("user:reindex", []byte(`{"user_id":9}`), TTL(-time.Second)), userTask(3, ""),
				asynq.NewTask("user:reindex", []byte(`{"trace_id":"x"}`)),
				asynq.NewTask("user:reindex", []byte(`{"user_id":8}`), asynq.Unique(time.Hour)), userTask(4, ""),
				asynq.NewTask("user:reindex", []byte(`not json`)),
				asynq.NewTask("counter", []byte(`{"key":"m"}`), OnConflict(Merge)), counterTask("c", 1, 1),
			}
			out := h.client.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
			var created []string
			for i, r := range out {
				if want, ok := bad[i]; ok {
					if !errors.Is(r.Err, want) || !strings.HasPrefix(r.Err.Error(), "dedup: ") || r.Outcome != 0 {
						t.Errorf("task %d: %+v; want an error matching %v, saying dedup:", i, r, want)
					}
					continue
				}
				if r.Err != nil || r.Outcome != Created {
					t.Errorf("task %d: %+v, want created", i, r)
					continue
				}
				created = append(created, r.TaskID)
			}
			if len(created) != 5 || h.queueSize(h.queue) != 5 {
				t.Fatalf("created %v, queue holds %d; want the 5 good tasks", created, h.queueSize(h.queue))
			}
			var owners []string
			for _, l := range h.locks() {
				owners = append(owners, h.lockOwner(l))
			}
			slices.Sort(owners)
			slices.Sort(created)
			if !slices.Equal(owners, created) {
				t.Fatalf("locks owned by %v, want only the created tasks' %v", owners, created)
			}
		})
	}
}

// Two tasks of one key in a batch: the first takes it, the later ones meet
// it as their holder, rejected or folded by their policy, on both paths (a
// WrapClient's later task waits for the first to be stored by asynq).
func TestEnqueueBatchSameKeyTwiceFirstWins(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			h := newHarness(t, batchRules())
			if direct {
				h.client = h.d.NewClient()
			}
			out := h.client.EnqueueBatch(context.Background(), []*asynq.Task{
				userTask(1, "first"), counterTask("k", 1, 1), userTask(1, "second"), counterTask("k", 1, 2), counterTask("k", 1, 3),
			}, asynq.Queue(h.queue))
			if out[0].Err != nil || out[0].Outcome != Created || out[1].Err != nil || out[1].Outcome != Created {
				t.Fatalf("first of each key: %+v, %+v; want created", out[0], out[1])
			}
			var dup *DuplicateTaskError
			if !errors.As(out[2].Err, &dup) || dup.Holder != out[0].TaskID {
				t.Fatalf("second user task: %+v, want a duplicate of the first, %s", out[2], out[0].TaskID)
			}
			for _, r := range out[3:] {
				if r.Err != nil || r.Outcome != Replaced || r.TaskID != out[1].TaskID {
					t.Fatalf("later counter task: %+v, want replaced into the first, %s", r, out[1].TaskID)
				}
			}
			ti, err := h.insp.GetTaskInfo(h.queue, out[1].TaskID)
			if err != nil || decodeCounter(asynq.NewTask("", ti.Payload)).Seq != 3 {
				t.Fatalf("the key's task: %+v, %v; want the last payload (seq 3)", ti, err)
			}
			if n := h.queueSize(h.queue); n != 2 {
				t.Fatalf("queue holds %d tasks, want 2", n)
			}
		})
	}
}

// On NewClient's direct path a batch of new keys on one node costs one
// round trip: one pipeline, nothing else.
func TestEnqueueBatchOfNewKeysIsOnePipeline(t *testing.T) {
	h := newHarness(t, batchRules())
	h.client = h.d.NewClient()
	log := &tripLog{}
	h.rdb.AddHook(tripHook{log: log})
	// A queue's first enqueue registers it (once per process) and loads
	// the script: do that before counting.
	h.enqueue(userTask(0, ""))
	const n = 50
	tasks := make([]*asynq.Task, n)
	for i := range tasks {
		tasks[i] = userTask(i+1, "")
	}
	log.take()
	out := h.client.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
	trips := log.take()
	for i, r := range out {
		if r.Err != nil || r.Outcome != Created || r.Info.State != asynq.TaskStatePending {
			t.Fatalf("task %d: %+v", i, r)
		}
	}
	if len(trips) != 1 || len(trips[0].cmds) != n {
		t.Fatalf("%d round trips (%v), want one pipeline of %d", len(trips), trips, n)
	}
	if h.queueSize(h.queue) != n+1 {
		t.Fatalf("queue holds %d, want %d", h.queueSize(h.queue), n+1)
	}
}

// A real asynq server drains a batch: every created task runs once, and
// its lock is released after.
func TestEnqueueBatchDrainedByAServerEachTaskOnce(t *testing.T) {
	h := newHarness(t, batchRules())
	h.client = h.d.NewClient()
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	var tasks []*asynq.Task
	for i := range 40 {
		tasks = append(tasks, userTask(i%30, fmt.Sprint(i))) // 10 keys twice
	}
	out := h.client.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
	want := map[string]bool{}
	for i, r := range out {
		switch {
		case i < 30 && (r.Err != nil || r.Outcome != Created):
			t.Fatalf("task %d: %+v, want created", i, r)
		case i < 30:
			want[r.TaskID] = true
		case !errors.Is(r.Err, ErrDuplicateTask):
			// (a key's first task may have run already: then the second is created)
			if r.Err != nil || r.Outcome != Created {
				t.Fatalf("task %d: %+v, want a duplicate or created", i, r)
			}
			want[r.TaskID] = true
		}
	}
	ran := map[string]int{}
	for len(ran) < len(want) {
		r := waitFor(t, rc.runs, "a run")
		if !want[r.id] {
			t.Fatalf("ran %s, which the batch did not create", r.id)
		}
		ran[r.id]++
	}
	eventually(t, "every lock released", func() bool { return len(h.locks()) == 0 })
	for id, n := range ran {
		if n != 1 {
			t.Fatalf("task %s ran %d times", id, n)
		}
	}
	if extra := len(rc.runs); extra != 0 {
		t.Fatalf("%d runs more than the batch's tasks", extra)
	}
}

// With the lock store unreachable each task of a batch gets what Submit
// would: ErrUnavailable (fail-closed), or enqueued without a lock
// (FailOpen); bad input still gets its own error.
func TestEnqueueBatchRedisDownPerTask(t *testing.T) {
	needRealRedis(t)
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%v", open), func(t *testing.T) {
			h := newHarness(t, Config{})
			lockRedis, d := proxiedLockStore(t, h, Config{FailOpen: open})
			c := d.WrapClient(h.asynq) // locks through the proxy, tasks direct
			lockRedis.close()
			out := c.EnqueueBatch(context.Background(), []*asynq.Task{userTask(1, ""), nil, userTask(2, ""), userTask(3, "")}, asynq.Queue(h.queue))
			if !errors.Is(out[1].Err, ErrInvalidOption) {
				t.Fatalf("nil task: %+v", out[1])
			}
			for _, i := range []int{0, 2, 3} {
				r := out[i]
				if open && (r.Err != nil || r.Outcome != Created || !r.FailOpen) {
					t.Fatalf("task %d: %+v, want created without a lock", i, r)
				}
				if !open && (!errors.Is(r.Err, ErrUnavailable) || errors.Is(r.Err, ErrOutcomeUnknown)) {
					t.Fatalf("task %d: %+v, want ErrUnavailable", i, r)
				}
			}
			want := 0
			if open {
				want = 3
			}
			if n := h.queueSize(h.queue); n != want {
				t.Fatalf("queue holds %d, want %d", n, want)
			}
		})
	}
}

// A batch whose tasks the direct path carried in a pipeline that was lost
// cannot say they were not stored: each is ErrOutcomeUnknown (matching
// ErrUnavailable), never enqueued a second time by FailOpen.
func TestEnqueueBatchDirectPipelineLostIsUnknownPerTask(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{})
	lockRedis, d := proxiedLockStore(t, h, Config{FailOpen: true, LockTimeout: 300 * time.Millisecond})
	c := d.NewClient()
	h.enqueueWith(c, userTask(0, "")) // the queue registered, the script loaded
	lockRedis.stall()
	out := c.EnqueueBatch(context.Background(), []*asynq.Task{userTask(1, ""), userTask(2, "")}, asynq.Queue(h.queue))
	for i, r := range out {
		if !errors.Is(r.Err, ErrOutcomeUnknown) || !errors.Is(r.Err, ErrUnavailable) {
			t.Fatalf("task %d: %+v, want ErrOutcomeUnknown", i, r)
		}
	}
	if n := h.queueSize(h.queue); n != 1 {
		t.Fatalf("queue holds %d, want 1 (nothing enqueued again)", n)
	}
}

// A context already done gives every task its error, which is not an
// outage, and sends nothing.
func TestEnqueueBatchContextDoneGivesEveryTaskItsError(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	log := &tripLog{}
	h.rdb.AddHook(tripHook{log: log})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	out := h.client.EnqueueBatch(ctx, []*asynq.Task{userTask(1, ""), nil, userTask(2, "")}, asynq.Queue(h.queue))
	for i, r := range out {
		if !errors.Is(r.Err, context.Canceled) || errors.Is(r.Err, ErrUnavailable) || !strings.HasPrefix(r.Err.Error(), "dedup: ") {
			t.Fatalf("task %d: %+v, want the context's error", i, r)
		}
	}
	if trips := log.take(); len(trips) != 0 {
		t.Fatalf("sent %v", trips)
	}
}

// This package's options given to asynq.NewTask apply to that task, in
// Submit as in EnqueueBatch, under the call's (which override them), and
// keep NewClient's direct path.
func TestNewTaskDedupOptionsApplyToTheTask(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	ctx := context.Background()
	log := &tripLog{}
	h.rdb.AddHook(tripHook{log: log})
	user := func(id int, trace string, opts ...asynq.Option) *asynq.Task {
		return asynq.NewTask("user:reindex", fmt.Appendf(nil, `{"user_id":%d,"trace_id":%q}`, id, trace), opts...)
	}
	h.enqueue(user(0, "")) // registers the queue
	log.take()
	first, err := h.client.Submit(ctx, user(1, "a", Fields("user_id"), Headers(map[string]string{"h": "1"})), asynq.Queue(h.queue))
	if err != nil || first.Outcome != Created {
		t.Fatalf("first: %+v, %v", first, err)
	}
	if trips := log.take(); len(trips) != 1 || len(trips[0].cmds) != 1 {
		t.Fatalf("round trips %v: want the direct path's one call", trips)
	}
	if ti, err := h.insp.GetTaskInfo(h.queue, first.TaskID); err != nil || ti.Headers["h"] != "1" {
		t.Fatalf("stored task %+v, %v; want NewTask's dedup.Headers", ti, err)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Submit(ctx, user(1, "b", Fields("user_id")), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != first.TaskID {
		t.Fatalf("same user, NewTask's Fields: %v, want a duplicate of %s", err, first.TaskID)
	}
	if _, err := h.client.Submit(ctx, user(1, "c", Fields("user_id")), asynq.Queue(h.queue), Key("k")); err != nil {
		t.Fatalf("the call's Key over NewTask's Fields: %v, want a key of its own", err)
	}
	if r, err := h.client.Submit(ctx, user(1, "d", Key("k"), OnConflict(Replace)), asynq.Queue(h.queue), Key("k2"), OnConflict(Reject)); err != nil || r.Outcome != Created || r.Conflict != Reject {
		t.Fatalf("the call's Key and OnConflict over NewTask's: %+v, %v; want created under k2, rejecting", r, err)
	}
	if _, err := h.client.Submit(ctx, user(2, "e", Key("k2")), asynq.Queue(h.queue)); !errors.As(err, &dup) {
		t.Fatalf("NewTask's Key k2: %v, want a duplicate", err)
	}
	if r, err := h.client.Submit(ctx, user(1, "a", Skip()), asynq.Queue(h.queue)); err != nil || r.Fingerprint != "" {
		t.Fatalf("NewTask's Skip: %+v, %v; want enqueued without deduplication", r, err)
	}
	_, err = h.client.Submit(ctx, user(3, "", TTL(-1)), asynq.Queue(h.queue))
	if !errors.Is(err, ErrInvalidOption) || !strings.Contains(err.Error(), "NewTask") {
		t.Fatalf("NewTask's invalid option: %v, want ErrInvalidOption naming NewTask", err)
	}
	out := h.client.EnqueueBatch(ctx, []*asynq.Task{user(5, "a", Key("five")), user(6, "b", Key("five")), user(7, "c", Skip())}, asynq.Queue(h.queue))
	if out[0].Err != nil || !errors.As(out[1].Err, &dup) || dup.Holder != out[0].TaskID || out[2].Err != nil || out[2].Fingerprint != "" {
		t.Fatalf("batch of per-task options: %+v", out)
	}
}

// On Redis Cluster a batch's lock calls go as one pipeline per master for
// queues spread over three masters, each straight to its master. (Tasks
// given their queue in asynq.NewTask are then stored by asynq's client, as
// in Submit.)
func TestClusterEnqueueBatchOnePipelinePerMaster(t *testing.T) {
	t.Parallel()
	clusterClient(t) // skips without a cluster
	log := &tripLog{}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(os.Getenv("DEDUP_TEST_CLUSTER"), ","), PoolSize: 32,
		NewClient: func(o *redis.Options) *redis.Client {
			n := redis.NewClient(o)
			n.AddHook(tripHook{log: log, addr: o.Addr})
			return n
		}})
	t.Cleanup(func() { _ = c.Close() })
	h := newHarnessOn(t, c, Config{})
	h.client = h.d.NewClient()
	queues := queuesOnEveryMaster(t, c, h.queue)
	var tasks []*asynq.Task
	var queueOf []string
	for i, q := range queues {
		// The queue's first enqueue registers it and loads the script on its master.
		h.enqueueWith(h.client, asynq.NewTask("user:reindex", fmt.Appendf(nil, `{"user_id":%d}`, 1000+i), asynq.Queue(q)))
		for j := range 10 {
			tasks = append(tasks, asynq.NewTask("user:reindex", fmt.Appendf(nil, `{"user_id":%d}`, 10*i+j), asynq.Queue(q)))
			queueOf = append(queueOf, q)
		}
	}
	log.take()
	out := h.client.EnqueueBatch(context.Background(), tasks)
	trips := locksOnly(log.take(), h.prefix)
	for i, r := range out {
		if r.Err != nil || r.Outcome != Created || r.Info.Queue != queueOf[i] {
			t.Fatalf("task %d: %+v, want created in %s", i, r, queueOf[i])
		}
		if ti, err := h.insp.GetTaskInfo(queueOf[i], r.TaskID); err != nil || h.lockOwner(h.keyOf(tasks[i], queueOf[i])) != ti.ID {
			t.Fatalf("task %d: stored %+v (%v), or not its key's holder", i, ti, err)
		}
	}
	byMaster := map[string]int{}
	for _, tr := range trips {
		if len(tr.cmds) != 10 {
			t.Fatalf("lock round trip %v: want a pipeline of one queue's 10 acquires", tr)
		}
		byMaster[tr.addr]++
	}
	if len(trips) != 3 || len(byMaster) != 3 {
		t.Fatalf("lock round trips %v, want one pipeline to each of 3 masters", trips)
	}
	for _, q := range queues {
		_ = h.insp.DeleteQueue(q, true)
	}
}

// enqueueWith enqueues task through c in the harness queue (or opts'),
// failing the test on an error.
func (h *harness) enqueueWith(c *Client, task *asynq.Task, opts ...asynq.Option) *asynq.TaskInfo {
	h.t.Helper()
	info, err := c.Enqueue(task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
	if err != nil {
		h.t.Fatalf("enqueue: %v", err)
	}
	return info
}

// A batch meeting keys held by tasks this process has not met (another
// process enqueued them, long enough ago that their records must be read)
// takes a second pipelined round, not a call per task: two round trips.
func TestEnqueueBatchOfKeysHeldElsewhereIsTwoPipelines(t *testing.T) {
	h := newHarness(t, batchRules())
	h.client = h.d.NewClient()
	const n = 20
	var held []string
	for i := range n {
		info := h.enqueue(userTask(i, "first"))
		h.ageLock(h.keyOf(userTask(i, ""), h.queue))
		held = append(held, info.ID)
	}
	other := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix, Rules: batchRules().Rules}) // another process
	other.client = other.d.NewClient()
	log := &tripLog{}
	other.rdb.AddHook(tripHook{log: log})
	other.enqueueWith(other.client, userTask(n, ""), asynq.Queue(h.queue)) // registers the queue in this process
	var tasks []*asynq.Task
	for i := range n {
		tasks = append(tasks, userTask(i, "second"))
	}
	log.take()
	out := other.client.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
	trips := locksOnly(log.take(), h.prefix)
	for i, r := range out {
		var dup *DuplicateTaskError
		if !errors.As(r.Err, &dup) || dup.Holder != held[i] {
			t.Fatalf("task %d: %+v, want a duplicate of %s", i, r, held[i])
		}
	}
	if len(trips) != 2 || len(trips[0].cmds) != n || len(trips[1].cmds) != n {
		t.Fatalf("round trips %v, want two pipelines of %d", trips, n)
	}
}

// The tasks of a batch that share a lock key or a caller-chosen task ID,
// directly or through others, are one group, in batch order; a task
// begin answered shares nothing.
func TestEnqueueBatchGroupsByKeyAndTaskID(t *testing.T) {
	h := newHarness(t, batchRules())
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	type in struct {
		task *asynq.Task
		opts []asynq.Option
	}
	ins := []in{
		{userTask(1, "a"), nil},                                           // 0: key 1
		{userTask(2, "b"), []asynq.Option{asynq.TaskID("grp-x")}},         // 1: key 2, ID x
		{userTask(3, "c"), nil},                                           // 2: key 3
		{userTask(1, "d"), []asynq.Option{asynq.TaskID("grp-x")}},         // 3: key 1 and ID x: joins 0 and 1
		{userTask(4, "e"), []asynq.Option{asynq.TaskID("grp-y"), Skip()}}, // 4: ID y, undeduplicated
		{userTask(5, "f"), []asynq.Option{asynq.TaskID("grp-y")}},         // 5: ID y
		{nil, nil},              // 6: answered by begin
		{userTask(6, "g"), nil}, // 7
		{userTask(3, "h"), []asynq.Option{asynq.TaskID("grp-z"), Skip()}}, // 8: undeduplicated: its key is none
	}
	b := &batch{c: h.client, ctx: ctx, calls: make([]batchCall, len(ins))}
	for i, x := range ins {
		bc := &b.calls[i]
		bc.locks, bc.err = h.client.begin(ctx, &bc.k, x.task, append([]asynq.Option{q}, x.opts...))
	}
	got := fmt.Sprint(b.groups())
	if want := "[[0 1 3] [2] [4 5] [6] [7] [8]]"; got != want {
		t.Fatalf("groups %s, want %s", got, want)
	}
}

// batchUserTask is userTask with options given to asynq.NewTask.
func batchUserTask(user int, trace string, opts ...asynq.Option) *asynq.Task {
	return asynq.NewTask("user:reindex", userTask(user, trace).Payload(), opts...)
}

// batchPanicky is an Enqueuer that panics for a task whose payload holds
// "boom", and enqueues the others through next.
type batchPanicky struct{ next Enqueuer }

func (p batchPanicky) Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return p.EnqueueContext(context.Background(), task, opts...)
}

func (p batchPanicky) EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	if strings.Contains(string(task.Payload()), "boom") {
		panic("enqueue boom")
	}
	return p.next.EnqueueContext(ctx, task, opts...)
}

// A panic in a task's steps (the Enqueuer, a MergeFunc), with and without
// Config.OnDecision: it reaches the caller of EnqueueBatch, with its value,
// once the other groups are answered (their tasks stored with their
// locks); the later tasks of its group are not sent; no goroutine is left.
func TestEnqueueBatchPanicReachesTheCaller(t *testing.T) {
	for _, hook := range []bool{false, true} {
		for _, where := range []string{"enqueue", "merge"} {
			t.Run(fmt.Sprintf("hook=%v/%s", hook, where), func(t *testing.T) {
				cfg := batchRules()
				if hook {
					cfg.OnDecision = func(Decision) {}
				}
				h := newHarness(t, cfg)
				c := h.d.WrapClient(batchPanicky{next: h.asynq})
				h.enqueueWith(c, userTask(0, "warm")) // placement found: no task goes alone first
				holder := h.enqueue(userTask(2, "holder"), asynq.ProcessIn(time.Hour))
				// The panicking task, and a later task of its key, which would
				// replace the key's task's payload if it were sent.
				boom := batchUserTask(2, "x", MergeWith(func(old, new []byte) ([]byte, error) { panic("merge boom") }))
				later := batchUserTask(2, "later", OnConflict(Replace))
				if where == "enqueue" {
					boom, later = batchUserTask(7, "boom"), batchUserTask(7, "later", OnConflict(Replace))
				}
				tasks := []*asynq.Task{userTask(1, "a"), boom, userTask(3, "b"), later}
				for i := 10; i < 40; i++ {
					tasks = append(tasks, userTask(i, "more"))
				}
				leak := goleak.IgnoreCurrent()
				var got any
				func() {
					defer func() { got = recover() }()
					c.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
				}()
				if want := where + " boom"; got != want {
					t.Fatalf("recovered %v, want %q", got, want)
				}
				goleak.VerifyNone(t, leak)
				for _, i := range []int{0, 2, 4, 20, len(tasks) - 1} {
					if owner := h.lockOwner(h.keyOf(tasks[i], h.queue)); owner == "" {
						t.Errorf("task %d: its key is free, want it created", i)
					} else if ti, err := h.insp.GetTaskInfo(h.queue, owner); err != nil || string(ti.Payload) != string(tasks[i].Payload()) {
						t.Errorf("task %d: its key's task %s: %+v, %v", i, owner, ti, err)
					}
				}
				if where == "merge" {
					if ti, err := h.insp.GetTaskInfo(h.queue, holder.ID); err != nil || !strings.Contains(string(ti.Payload), "holder") {
						t.Errorf("the waiting holder: %+v, %v; want its own payload (the later Replace not sent)", ti, err)
					}
				}
			})
		}
	}
}

const batchJobType = "batch:job"

func batchJob(key string, n int, opts ...asynq.Option) *asynq.Task {
	return asynq.NewTask(batchJobType, fmt.Appendf(nil, `{"key":%q,"n":%d}`, key, n), opts...)
}

func batchJobRules(r Rule) Config {
	r.Fields = []string{"key"}
	return Config{Rules: map[string]Rule{batchJobType: r}}
}

// docs/batch.md: "A BatchResult is the Result and the error Submit would
// have returned for the task alone", "Each task stands alone ... never left
// half done". Two tasks of a batch given the same caller-chosen
// asynq.TaskID in asynq.NewTask, with different keys, are answered as Submit
// one after the other answers them: the first is created (its key locked by
// it), the second refused with asynq.ErrTaskIDConflict, locking nothing.
func TestEnqueueBatchSameCallerIDTwiceRefusesTheSecond(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		for round := range 5 {
			id := fmt.Sprintf("batch-id-%d", round)
			first := batchJob(fmt.Sprint("a", round), 1, asynq.TaskID(id))
			second := batchJob(fmt.Sprint("b", round), 2, asynq.TaskID(id))
			out := h.client.EnqueueBatch(ctx, []*asynq.Task{first, second}, asynq.Queue(h.queue))
			if out[0].Err != nil || out[0].Outcome != Created || out[0].TaskID != id {
				t.Errorf("round %d: first task: %+v, want created as %s", round, out[0], id)
			}
			if !errors.Is(out[1].Err, asynq.ErrTaskIDConflict) {
				t.Errorf("round %d: second task: %+v, want asynq.ErrTaskIDConflict", round, out[1])
			}
			if l, found, err := h.d.Lookup(ctx, first, asynq.Queue(h.queue)); err != nil || !found || l.Holder != id {
				t.Errorf("round %d: the first task's key: %+v found=%v %v; want held by %s", round, l, found, err, id)
			}
			if l, found, err := h.d.Lookup(ctx, second, asynq.Queue(h.queue)); err != nil || found {
				t.Errorf("round %d: the second task's key: %+v found=%v %v; want free", round, l, found, err)
			}
			if ti, err := h.insp.GetTaskInfo(h.queue, id); err != nil || string(ti.Payload) != string(first.Payload()) {
				t.Errorf("round %d: task %s: %+v, %v; want the first task's payload", round, id, ti, err)
			}
		}
	})
}

// docs/batch.md: "Two tasks of one key are answered in order. The first
// takes the key; the later one meets it as its holder". A key this process
// last saw held (it enqueued the holder) whose holder has since run and
// released it elsewhere (a worker in another process): a batch of a Replace
// and then a Reject of that key is answered as Submit one after the other
// answers it: the Replace meets a free key and creates the task, the Reject
// is a duplicate of it. (Once, the Replace's call into the remembered holder
// did not apply and went to a second round while the Reject took the key in
// the first: the later task won.)
func TestEnqueueBatchFirstTaskOfAKeyWinsOverAStaleHolder(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{OnConflict: Replace}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		// A worker in another process runs the holder, and its success
		// frees the key; this process still remembers the holder.
		other := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix, Rules: batchJobRules(Rule{OnConflict: Replace}).Rules})
		other.queue = h.queue
		ran := make(chan string, 1)
		srv := other.serve(func(ctx context.Context, task *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			ran <- id
			return nil
		}, nil)
		old, err := h.client.Submit(ctx, batchJob("k", 0), asynq.Queue(h.queue))
		if err != nil {
			t.Fatal(err)
		}
		if id := waitFor(t, ran, "the holder's run"); id != old.TaskID {
			t.Fatalf("ran %s, want %s", id, old.TaskID)
		}
		eventually(t, "the key free", func() bool {
			_, found, err := h.d.Lookup(ctx, batchJob("k", 0), asynq.Queue(h.queue))
			return err == nil && !found
		})
		srv.Shutdown()
		start := time.Now()
		out := h.client.EnqueueBatch(ctx, []*asynq.Task{batchJob("k", 1), batchJob("k", 2, OnConflict(Reject))}, asynq.Queue(h.queue))
		took := time.Since(start)
		if out[0].Err != nil || out[0].Outcome != Created {
			t.Errorf("first task (Replace, the key free): %+v, want created", out[0])
		}
		var dup *DuplicateTaskError
		if !errors.As(out[1].Err, &dup) || dup.Holder != out[0].TaskID {
			t.Errorf("second task (Reject): %+v, want a duplicate of the first (%s)", out[1], out[0].TaskID)
		}
		l, found, err := h.d.Lookup(ctx, batchJob("k", 0), asynq.Queue(h.queue))
		if err != nil || !found {
			t.Fatalf("lookup: %+v %v %v", l, found, err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, l.Holder)
		if err != nil || string(ti.Payload) != string(batchJob("k", 1).Payload()) {
			t.Errorf("the key's task %s: %+v, %v; want the first task's payload (n 1)", l.Holder, ti, err)
		}
		t.Logf("the batch of two tasks took %v", took)
	})
}

// batchChildEnv names the test a child process of the test binary runs
// (runInChild), for a test whose failure would take the process down.
const batchChildEnv = "DEDUP_BATCH_CHILD"

// runInChild runs the test named in the child process, and reports whether
// it ended well (exit status 0), with its output.
func runInChild(t *testing.T, name string) (bool, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), batchChildEnv+"="+name)
	out, err := cmd.CombinedOutput()
	return err == nil, string(out)
}

// docs/batch.md: "A BatchResult is the Result and the error Submit would
// have returned for the task alone"; "Each task stands alone". A MergeFunc
// that panics: Submit lets the panic reach its caller, who may recover it
// (as net/http's server does for a handler), and so does EnqueueBatch,
// though it settles merges on goroutines of its own. The test runs in a
// child process, whose death would otherwise take the test binary down.
func TestEnqueueBatchMergeFuncPanicDoesNotKillTheProcess(t *testing.T) {
	t.Parallel()
	if os.Getenv(batchChildEnv) == "merge-panic" {
		mergePanicChild(t)
		return
	}
	needRealRedis(t)
	ok, out := runInChild(t, "merge-panic")
	if !ok {
		if i := strings.Index(out, "panic: "); i >= 0 {
			out = out[i:min(len(out), i+600)]
		}
		t.Fatalf("a panicking MergeFunc in a batch took the process down, though the caller recovers panics:\n%s", out)
	}
}

func mergePanicChild(t *testing.T) {
	boom := MergeWith(func(old, new []byte) ([]byte, error) { panic("merge boom") })
	h := newHarness(t, batchJobRules(Rule{}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	var tasks []*asynq.Task
	for i := range 32 {
		h.enqueue(batchJob(fmt.Sprint("m", i), 0), asynq.ProcessIn(time.Hour)) // a waiting holder
		tasks = append(tasks, batchJob(fmt.Sprint("m", i), 1, boom))
	}
	func() {
		defer func() { t.Logf("Submit's panic reaches its caller: %v", recover()) }()
		_, _ = h.client.Submit(ctx, tasks[0], asynq.Queue(h.queue))
	}()
	func() {
		defer func() { t.Logf("the batch's panic reaches its caller: %v", recover()) }()
		h.client.EnqueueBatch(ctx, tasks, asynq.Queue(h.queue))
	}()
}

// A task enqueued without deduplication (Skip) and a later task of the same
// batch with the same caller-chosen asynq.TaskID (skipped too, or
// deduplicated) are answered as Submit one after the other answers them:
// the first is created under the ID, the second refused
// (asynq.ErrTaskIDConflict) and its key left free. (Once, the tasks without
// a lock were enqueued after every lock call, and the later task could win
// the ID.)
func TestEnqueueBatchSkippedTaskKeepsItsIDFromALaterTask(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		for round := range 10 {
			id := fmt.Sprintf("batch-skip-%d", round)
			for _, second := range []*asynq.Task{
				batchJob(fmt.Sprint("b", round), 2, asynq.TaskID(id+"-a"), Skip()), // skipped too
				batchJob(fmt.Sprint("c", round), 2, asynq.TaskID(id+"-b")),         // deduplicated
			} {
				sid, _ := newTaskID(second)
				first := batchJob(fmt.Sprint("a", round), 1, asynq.TaskID(sid), Skip())
				out := h.client.EnqueueBatch(ctx, []*asynq.Task{first, second}, asynq.Queue(h.queue))
				if out[0].Err != nil || out[0].Outcome != Created {
					t.Errorf("round %d, %s: first task: %+v, want created", round, sid, out[0])
				}
				if !errors.Is(out[1].Err, asynq.ErrTaskIDConflict) {
					t.Errorf("round %d, %s: second task: %+v, want asynq.ErrTaskIDConflict", round, sid, out[1])
				}
				if ti, err := h.insp.GetTaskInfo(h.queue, sid); err != nil || string(ti.Payload) != string(first.Payload()) {
					t.Errorf("round %d: task %s: %v; want the first task's payload", round, sid, err)
				}
				if l, found, _ := h.d.Lookup(ctx, second, asynq.Queue(h.queue)); found {
					t.Errorf("round %d, %s: the second task's key is held by %s, want free", round, sid, l.Holder)
				}
			}
		}
	})
}

// newTaskID is the asynq.TaskID given to NewTask, if any.
func newTaskID(task *asynq.Task) (string, bool) {
	opts, _ := taskOpts(task)
	for _, o := range opts {
		if o != nil && o.Type() == asynq.TaskIDOpt {
			return o.Value().(string), true
		}
	}
	return "", false
}

// storedByPayload lists the tasks waiting in q (pending and scheduled), by
// payload.
func storedByPayload(t *testing.T, h *harness, q string) map[string][]*asynq.TaskInfo {
	t.Helper()
	out := map[string][]*asynq.TaskInfo{}
	for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){h.insp.ListPendingTasks, h.insp.ListScheduledTasks} {
		for page := 1; ; page++ {
			tis, err := list(q, asynq.PageSize(1000), asynq.Page(page))
			if err != nil && strings.Contains(err.Error(), "NOT_FOUND") {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, ti := range tis {
				out[string(ti.Payload)] = append(out[string(ti.Payload)], ti)
			}
			if len(tis) < 1000 {
				break
			}
		}
	}
	return out
}

// checkBatchAtomic checks a batch of tasks with distinct payloads, each
// deduplicated in q: a task reported created is stored once and holds its
// key; a task that failed (neither a duplicate nor of unknown outcome) is
// stored nowhere and holds no key. It returns how many were created.
func checkBatchAtomic(t *testing.T, h *harness, q string, tasks []*asynq.Task, out []BatchResult, opts ...asynq.Option) int {
	t.Helper()
	ctx := context.Background()
	stored := storedByPayload(t, h, q)
	created := 0
	for i, r := range out {
		tis := stored[string(tasks[i].Payload())]
		l, held, err := h.d.Lookup(ctx, tasks[i], opts...)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case len(tis) > 1:
			t.Errorf("task %d (%+v) is stored %d times", i, r, len(tis))
		case r.Err == nil && r.Outcome == Created:
			created++
			if len(tis) != 1 || tis[0].ID != r.TaskID || !held || l.Holder != r.TaskID {
				t.Errorf("task %d created as %s: stored %d times, its key held=%v by %q", i, r.TaskID, len(tis), held, l.Holder)
			}
		case r.Err != nil && !errors.Is(r.Err, ErrDuplicateTask) && !errors.Is(r.Err, ErrOutcomeUnknown):
			if len(tis) != 0 || (held && l.Holder != "" && len(stored[""]) == 0 && heldByNone(out, l.Holder)) {
				t.Errorf("task %d failed (%v) but is stored %d times, its key held=%v by %q", i, r.Err, len(tis), held, l.Holder)
			}
		}
	}
	return created
}

// heldByNone reports whether no task of the batch was created as id.
func heldByNone(out []BatchResult, id string) bool {
	for _, r := range out {
		if r.Err == nil && r.TaskID == id {
			return false
		}
	}
	return true
}

// Many goroutines enqueue overlapping batches (each key several times,
// from several batches and within one): under Reject every key ends with
// exactly one live task, and exactly one result in all reports it created.
func TestEnqueueBatchConcurrentOverlappingBatchesMakeOneTaskPerKey(t *testing.T) {
	t.Parallel()
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		const goroutines, perBatch, keys = 8, 60, 40
		h.enqueueWith(h.client, batchJob("warm", 0))
		var wg sync.WaitGroup
		outs := make([][]BatchResult, goroutines)
		batches := make([][]*asynq.Task, goroutines)
		for g := range goroutines {
			for i := range perBatch {
				batches[g] = append(batches[g], batchJob(fmt.Sprint("o", (g*7+i*13)%keys), g*1000+i))
			}
			wg.Go(func() { outs[g] = h.client.EnqueueBatch(context.Background(), batches[g], asynq.Queue(h.queue)) })
		}
		wg.Wait()
		created := map[string][]string{} // key → task IDs reported created
		for g := range goroutines {
			for i, r := range outs[g] {
				k := fmt.Sprint("o", (g*7+i*13)%keys)
				switch {
				case r.Err == nil && r.Outcome == Created:
					created[k] = append(created[k], r.TaskID)
				case !errors.Is(r.Err, ErrDuplicateTask):
					t.Errorf("batch %d task %d: %+v, want created or a duplicate", g, i, r)
				}
			}
		}
		live := map[string][]string{}
		for _, tis := range storedByPayload(t, h, h.queue) {
			for _, ti := range tis {
				var p struct{ Key string }
				_ = json.Unmarshal(ti.Payload, &p)
				live[p.Key] = append(live[p.Key], ti.ID)
			}
		}
		for i := range keys {
			k := fmt.Sprint("o", i)
			if len(created[k]) != 1 || len(live[k]) != 1 || live[k][0] != created[k][0] {
				t.Errorf("key %s: reported created %v, live tasks %v; want one, the same", k, created[k], live[k])
			}
		}
	})
}

// asynq's own options given to asynq.NewTask (a queue, MaxRetry, Timeout,
// Deadline, Retention, ProcessIn), with a call option over one of them: a
// batch's task is stored as asynq's own client stores the same task, and
// its lock lives in that queue and lasts past the delay.
func TestEnqueueBatchStoresNewTaskOptionsAsAsynqWould(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{TTL: time.Minute}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		q := h.queue + "-own"
		deadline := time.Now().Add(3 * time.Hour).Truncate(time.Second)
		own := func(key string, extra ...asynq.Option) *asynq.Task {
			return batchJob(key, 1, append([]asynq.Option{asynq.Queue(q), asynq.MaxRetry(3), asynq.Timeout(90 * time.Second),
				asynq.Deadline(deadline), asynq.Retention(2 * time.Hour), asynq.ProcessIn(time.Hour), Headers(map[string]string{"h": "1"}), TTL(time.Minute)}, extra...)...)
		}
		plain, err := h.asynq.Enqueue(own("plain"), asynq.MaxRetry(7))
		if err != nil {
			t.Fatal(err)
		}
		tasks := []*asynq.Task{own("a"), own("b", Key("b")), nil, own("c", OnConflict(Replace))}
		out := h.client.EnqueueBatch(ctx, tasks, asynq.MaxRetry(7))
		for _, i := range []int{0, 1, 3} {
			r := out[i]
			if r.Err != nil || r.Outcome != Created {
				t.Errorf("task %d: %+v, want created", i, r)
				continue
			}
			ti, err := h.insp.GetTaskInfo(q, r.TaskID)
			if err != nil {
				t.Errorf("task %d: %v", i, err)
				continue
			}
			if ti.Queue != plain.Queue || ti.MaxRetry != plain.MaxRetry || ti.Timeout != plain.Timeout || !ti.Deadline.Equal(plain.Deadline) ||
				ti.Retention != plain.Retention || ti.State != plain.State || ti.NextProcessAt.Sub(plain.NextProcessAt).Abs() > 2*time.Second {
				t.Errorf("task %d stored as %+v\nasynq stores %+v", i, ti, plain)
			}
			if r.Info == nil || r.Info.Queue != q || r.Info.MaxRetry != 7 || r.Info.State != asynq.TaskStateScheduled {
				t.Errorf("task %d: Info %+v", i, r.Info)
			}
			if ti.Headers["h"] != "1" {
				t.Errorf("task %d: headers %v, want NewTask's dedup.Headers", i, ti.Headers)
			}
			l, found, err := h.d.Lookup(ctx, tasks[i])
			if err != nil || !found || l.Queue != q || l.Holder != r.TaskID || l.TTL < time.Hour {
				t.Errorf("task %d: its lock %+v (found %v, %v); want in %s, held by it past the delay", i, l, found, err, q)
			}
		}
		if !errors.Is(out[2].Err, ErrInvalidOption) {
			t.Errorf("nil task: %+v", out[2])
		}
		_ = h.insp.DeleteQueue(q, true)
	})
}

// RunningDefer: tasks of keys whose task is running, in one batch, are
// answered as Submit answers them one after the other (the first makes the
// follow-up, the later are replaced into it), and each key's follow-up runs
// once, with its last payload, after the run ends.
func TestEnqueueBatchRunningDeferAnswersAsSubmits(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		release := make(chan struct{})
		started := make(chan string, 10)
		ran := make(chan string, 100)
		h.serve(func(ctx context.Context, task *asynq.Task) error {
			var p struct {
				Key string
				N   int
			}
			_ = json.Unmarshal(task.Payload(), &p)
			if p.N == 0 {
				started <- p.Key
				<-release
			}
			ran <- fmt.Sprint(p.Key, "=", p.N)
			return nil
		}, nil)
		for _, k := range []string{"batch", "submit"} {
			h.enqueue(batchJob(k, 0))
			waitFor(t, started, "the holder of "+k+" running")
		}
		var want []Result
		for n := 1; n <= 3; n++ {
			r, err := h.client.Submit(ctx, batchJob("submit", n), asynq.Queue(h.queue))
			if err != nil {
				t.Fatalf("submit %d: %v", n, err)
			}
			want = append(want, r)
		}
		out := h.client.EnqueueBatch(ctx, []*asynq.Task{batchJob("batch", 1), batchJob("batch", 2), batchJob("batch", 3)}, asynq.Queue(h.queue))
		for i, r := range out {
			if r.Err != nil || r.Outcome != want[i].Outcome || r.FollowUp != want[i].FollowUp || (i > 0 && r.TaskID != out[0].TaskID) {
				t.Errorf("batch task %d: %+v; Submit gave %+v", i, r, want[i])
			}
		}
		close(release)
		got := map[string]int{}
		for len(got) < 4 {
			got[waitFor(t, ran, "a run")]++
		}
		for _, w := range []string{"batch=0", "submit=0", "batch=3", "submit=3"} {
			if got[w] != 1 {
				t.Errorf("runs %v: want %s once", got, w)
			}
		}
		eventually(t, "every lock released", func() bool { return len(h.locks()) == 0 })
		if len(ran) != 0 {
			t.Errorf("more runs: %d", len(ran))
		}
	})
}

// afterFirstLockPipeline is a go-redis hook that calls do once, after the first
// pipeline of lock calls (scripts on keys under prefix) is answered.
type afterFirstLockPipeline struct {
	prefix string
	once   sync.Once
	do     func()
}

func (c *afterFirstLockPipeline) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *afterFirstLockPipeline) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (c *afterFirstLockPipeline) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		var tr tripLog
		tr.note("", cmds)
		if len(locksOnly(tr.take(), c.prefix)) > 0 {
			c.once.Do(c.do)
		}
		return err
	}
}

// Redis stalls after the first of a batch's pipelines (a batch over 1,000
// lock calls sends several) and comes back after the batch has answered:
// no task is reported failed yet stored, none is stored twice (FailOpen
// never enqueues again a task its lost pipeline carried), and a task
// reported created is stored with its lock.
func TestEnqueueBatchRedisStallBetweenPipelinesLosesNothing(t *testing.T) {
	t.Parallel()
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			h := newHarness(t, batchJobRules(Rule{}))
			proxy, d := proxiedLockStore(t, h, Config{FailOpen: true, LockTimeout: 300 * time.Millisecond, Rules: batchJobRules(Rule{}).Rules})
			c := d.WrapClient(h.asynq)
			if direct {
				c = d.NewClient()
			}
			if _, err := c.Enqueue(batchJob("warm", 0), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
			d.rdb.AddHook(&afterFirstLockPipeline{prefix: h.prefix, do: proxy.stall})
			var tasks []*asynq.Task
			for i := range 1500 {
				tasks = append(tasks, batchJob(fmt.Sprint("s", i), i))
			}
			out := c.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
			proxy.resume()
			counts := map[string]int{}
			for _, r := range out {
				switch {
				case r.Err == nil:
					counts[fmt.Sprint(r.Outcome, " failopen=", r.FailOpen)]++
				case errors.Is(r.Err, ErrOutcomeUnknown):
					counts["unknown"]++
				default:
					counts["failed"]++
				}
			}
			t.Logf("answers: %v", counts)
			// Let whatever the stalled connections carried land.
			eventually(t, "Redis answers through the proxy", func() bool { return d.rdb.Ping(context.Background()).Err() == nil })
			stored := storedByPayload(t, h, h.queue)
			for i, r := range out {
				tis := stored[string(tasks[i].Payload())]
				switch {
				case len(tis) > 1:
					t.Errorf("task %d (%+v) stored %d times", i, r, len(tis))
				case r.Err == nil && (len(tis) != 1 || tis[0].ID != r.TaskID):
					t.Errorf("task %d reported %v as %s, stored %d times", i, r.Outcome, r.TaskID, len(tis))
				case r.Err != nil && !errors.Is(r.Err, ErrOutcomeUnknown) && len(tis) != 0:
					t.Errorf("task %d failed (%v) but is stored", i, r.Err)
				}
			}
		})
	}
}

// MaxPending with WaitForRoom: a batch of more new keys than the bound
// neither deadlocks nor loses a task. With a server draining the queue
// every task is created, once; with none, those over the bound end with
// ErrTooManyPending when ctx does, and hold no key.
func TestEnqueueBatchMaxPendingWaitForRoom(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{MaxPending: 2}), func(t *testing.T, h *harness) {
		var tasks []*asynq.Task
		for i := range 6 {
			tasks = append(tasks, batchJob(fmt.Sprint("w", i), i))
		}
		// The calls wait for room far longer than ctx lives, so that its end
		// falls while they wait, not inside a script call (that end is an
		// unknown outcome), however slow the machine.
		polls := roomBackoff
		roomBackoff = backoff{Min: 24 * time.Hour, Max: 24 * time.Hour}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		out := h.client.EnqueueBatch(ctx, tasks, asynq.Queue(h.queue), WaitForRoom())
		roomBackoff = polls
		for i, r := range out {
			switch {
			case i < 2 && (r.Err != nil || r.Outcome != Created):
				t.Errorf("task %d: %+v, want created", i, r)
			case i >= 2 && !errors.Is(r.Err, ErrTooManyPending):
				t.Errorf("task %d: %+v, want ErrTooManyPending", i, r)
			}
		}
		checkBatchAtomic(t, h, h.queue, tasks, out, asynq.Queue(h.queue))
		// Now a server drains the queue: a second batch waits for room and
		// gets it.
		ran := make(chan string, 100)
		h.serve(func(ctx context.Context, task *asynq.Task) error { ran <- string(task.Payload()); return nil }, nil)
		var more []*asynq.Task
		for i := range 6 {
			more = append(more, batchJob(fmt.Sprint("v", i), i))
		}
		ctx2, cancel2 := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel2()
		out = h.client.EnqueueBatch(ctx2, more, asynq.Queue(h.queue), WaitForRoom())
		for i, r := range out {
			if r.Err != nil || r.Outcome != Created {
				t.Errorf("task %d with a server draining: %+v, want created", i, r)
			}
		}
		seen := map[string]int{}
		for len(seen) < 8 {
			seen[waitFor(t, ran, "a run")]++
		}
		for p, n := range seen {
			if n != 1 {
				t.Errorf("%s ran %d times", p, n)
			}
		}
	})
}

// goroutineID is the running goroutine's number.
func goroutineID() string {
	b := make([]byte, 64)
	b = b[:runtime.Stack(b, false)]
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return ""
	}
	return f[1]
}

// Config.OnDecision "runs on the calling goroutine" (docs/operations.md,
// decision.go), so a hook written for one enqueuing goroutine needs no lock:
// EnqueueBatch calls it on the caller's goroutine, one call at a time,
// though it settles its tasks on goroutines of its own.
func TestEnqueueBatchCallsOnDecisionOnTheCallingGoroutine(t *testing.T) {
	var (
		caller                     string
		elsewhere, overlaps, calls atomic.Int64
		inFlight                   atomic.Int64
	)
	cfg := batchJobRules(Rule{})
	cfg.OnDecision = func(Decision) {
		if inFlight.Add(1) > 1 {
			overlaps.Add(1)
		}
		calls.Add(1)
		if goroutineID() != caller {
			elsewhere.Add(1)
		}
		time.Sleep(time.Millisecond) // a hook that does a little work
		inFlight.Add(-1)
	}
	bothPaths(t, cfg, func(t *testing.T, h *harness) {
		elsewhere.Store(0)
		overlaps.Store(0)
		calls.Store(0)
		var tasks []*asynq.Task
		for i := range 40 {
			tasks = append(tasks, batchJob(fmt.Sprint("d", i%20), i)) // 20 duplicates
		}
		caller = goroutineID()
		out := h.client.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
		for i, r := range out[20:] {
			if !errors.Is(r.Err, ErrDuplicateTask) {
				t.Fatalf("task %d: %+v, want a duplicate", 20+i, r)
			}
		}
		if calls.Load() != 20 || elsewhere.Load() != 0 || overlaps.Load() != 0 {
			t.Errorf("OnDecision called %d times for 20 duplicates: %d on another goroutine than the caller's, %d while another call ran",
				calls.Load(), elsewhere.Load(), overlaps.Load())
		}
	})
}

// sumMerge merges two batchJob payloads of one key: their n added.
func sumMerge(old, new []byte) ([]byte, error) {
	var a, b struct {
		Key string `json:"key"`
		N   int    `json:"n"`
	}
	if err := json.Unmarshal(old, &a); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(new, &b); err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, `{"key":%q,"n":%d}`, a.Key, a.N+b.N), nil
}

// docs/batch.md: "Two tasks of one key are answered in order ... (a Replace
// leaves the last payload)". A Merge and then a Replace of a key whose task
// waits, in one batch: as Submit one after the other, the merge adds 1 to
// the waiting task's n (0), then the Replace writes its payload (n 2): the
// task ends with n 2. (Once, the Replace's lock call ran before the Merge's
// compare-and-set, which then merged into the replaced payload: n 3, the
// earlier task applied last.)
func TestEnqueueBatchAppliesMergeThenReplaceInOrder(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		holder := h.enqueue(batchJob("m", 0), asynq.ProcessIn(time.Hour))
		out := h.client.EnqueueBatch(ctx, []*asynq.Task{
			batchJob("m", 1, MergeWith(sumMerge)),
			batchJob("m", 2, OnConflict(Replace)),
		}, asynq.Queue(h.queue))
		if out[0].Err != nil || out[0].Outcome != Merged || out[1].Err != nil || out[1].Outcome != Replaced {
			t.Fatalf("answers %+v, want merged then replaced", out)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, holder.ID)
		if err != nil {
			t.Fatal(err)
		}
		if want := `{"key":"m","n":2}`; string(ti.Payload) != want {
			t.Errorf("the key's task holds %s, want the Replace's %s (the Merge, earlier, applied first)", ti.Payload, want)
		}
	})
}

// The same task pointer several times in one batch, nil options among the
// call's and the task's: the first creates, the later are duplicates of it
// (or replaced into it); a plain asynq.Client given the same tasks ignores
// this package's options in NewTask.
func TestEnqueueBatchSameTaskTwiceAndNilOptions(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		same := batchJob("p", 1, nil, Key("p"), nil)
		repl := batchJob("r", 1, OnConflict(Replace), nil)
		out := h.client.EnqueueBatch(ctx, []*asynq.Task{same, repl, same, repl, same}, nil, asynq.Queue(h.queue), nil)
		var dup *DuplicateTaskError
		if out[0].Err != nil || out[0].Outcome != Created || out[1].Err != nil || out[1].Outcome != Created {
			t.Fatalf("first of each: %+v", out[:2])
		}
		for _, i := range []int{2, 4} {
			if !errors.As(out[i].Err, &dup) || dup.Holder != out[0].TaskID {
				t.Errorf("task %d: %+v, want a duplicate of %s", i, out[i], out[0].TaskID)
			}
		}
		if out[3].Err != nil || out[3].Outcome != Replaced || out[3].TaskID != out[1].TaskID {
			t.Errorf("task 3: %+v, want replaced into %s", out[3], out[1].TaskID)
		}
		if n := h.queueSize(h.queue); n != 2 {
			t.Errorf("queue holds %d, want 2", n)
		}
		for _, task := range []*asynq.Task{same, repl, batchJob("x", 1, MergeWith(sumMerge), Headers(map[string]string{"a": "b"}), Skip())} {
			if ti, err := h.asynq.Enqueue(task, asynq.Queue(h.queue)); err != nil || len(ti.Headers) != 0 {
				t.Errorf("plain asynq client: %+v, %v; want enqueued, this package's options ignored", ti, err)
			}
		}
	})
}

// WrapClient over an asynq client on another Redis (a misconfiguration the
// Client detects): "once one is found in another Redis, its task stays
// enqueued and locked, and every later deduplicated call fails with
// ErrTasksElsewhere" (client.go WrapClient), so that no live lock is left to
// heal after HealGrace and admit a duplicate. A batch does as Submit one
// after the other does: it stores one task elsewhere, with one lock here,
// and refuses the rest. (Once, a batch began every task before the first
// enqueue was probed, and stored them all elsewhere.)
func TestEnqueueBatchToAnotherRedisStoresOneTaskThenRefuses(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, batchJobRules(Rule{}))
	_, other := ownRedis(t, nil)
	c := h.d.WrapClient(asynq.NewClientFromRedisClient(other))
	var tasks []*asynq.Task
	for i := range 10 {
		tasks = append(tasks, batchJob(fmt.Sprint("e", i), i))
	}
	out := c.EnqueueBatch(context.Background(), tasks, asynq.Queue(h.queue))
	accepted := 0
	for i, r := range out {
		switch {
		case r.Err == nil:
			accepted++
		case !errors.Is(r.Err, ErrTasksElsewhere):
			t.Errorf("task %d: %+v, want created or ErrTasksElsewhere", i, r)
		}
	}
	n, _ := other.LLen(context.Background(), "asynq:{"+h.queue+"}:pending").Result()
	if accepted != 1 || n != 1 || len(h.locks()) != 1 {
		t.Errorf("%d tasks accepted, %d stored in the other Redis, %d locks here; want 1 of each, the rest refused with ErrTasksElsewhere", accepted, n, len(h.locks()))
	}
}

// A batch mixing per-task options (Debounce, Cooldown, Period, OnFailure,
// Merge, Skip, Headers, asynq's Queue in NewTask, an OptIn type without a
// rule, opted in or not) is answered task by task as the same tasks are by
// Submit one after the other, and leaves the same payloads stored.
func TestEnqueueBatchOfMixedOptionsAnswersAsSubmits(t *testing.T) {
	cfg := batchJobRules(Rule{})
	cfg.OptIn = true
	bothPaths(t, cfg, func(t *testing.T, h *harness) {
		ctx := context.Background()
		q2 := h.queue + "-2"
		free := func(ns, key string, n int, opts ...asynq.Option) *asynq.Task {
			return asynq.NewTask("batch:free", fmt.Appendf(nil, `{"key":%q,"n":%d}`, ns+key, n), opts...)
		}
		seq := func(ns string) []*asynq.Task {
			k := func(s string) string { return ns + s }
			deb := []asynq.Option{OnConflict(Replace), Debounce(time.Hour)}
			return []*asynq.Task{
				batchJob(k("a"), 1), batchJob(k("a"), 2),
				batchJob(k("r"), 1, deb...), batchJob(k("r"), 2, deb...),
				batchJob(k("c"), 1, Cooldown(time.Hour)), batchJob(k("c"), 2),
				batchJob(k("p"), 1, Period(24*time.Hour, nil)), batchJob(k("p"), 2, Period(24*time.Hour, nil)),
				batchJob(k("f"), 1, OnFailure(FailHold, time.Hour)),
				free(ns, "x", 1), free(ns, "y", 1, Key(k("free"))), free(ns, "y", 2, Key(k("free"))),
				batchJob(k("h"), 1, Headers(map[string]string{"a": "1"}), TTL(time.Hour)),
				batchJob(k("a"), 3, Skip()),
				batchJob(k("m"), 1, MergeWith(sumMerge)), batchJob(k("m"), 2, MergeWith(sumMerge)),
				batchJob(k("q"), 1, asynq.Queue(q2)), batchJob(k("q"), 2, asynq.Queue(q2)), batchJob(k("q"), 3),
				batchJob(k("r"), 3, deb...),
			}
		}
		subs := seq("s-")
		var want []BatchResult
		for _, task := range subs {
			r, err := h.client.Submit(ctx, task, asynq.Queue(h.queue))
			want = append(want, BatchResult{Result: r, Err: err})
		}
		tasks := seq("b-")
		out := h.client.EnqueueBatch(ctx, tasks, asynq.Queue(h.queue))
		class := func(err error) string {
			switch {
			case err == nil:
				return "ok"
			case errors.Is(err, ErrDuplicateTask):
				return "duplicate"
			}
			return err.Error()
		}
		for i, r := range out {
			w := want[i]
			if class(r.Err) != class(w.Err) || r.Outcome != w.Outcome || r.FollowUp != w.FollowUp || r.Conflict != w.Conflict ||
				r.Running != w.Running || (r.Fingerprint == "") != (w.Fingerprint == "") || fmt.Sprint(r.NotApplied) != fmt.Sprint(w.NotApplied) ||
				(r.Info == nil) != (w.Info == nil) || (r.Info != nil && (r.Info.State != w.Info.State || r.Info.Queue != w.Info.Queue)) {
				t.Errorf("task %d: batch %+v (%v)\nSubmit gave %+v (%v)", i, r.Result, r.Err, w.Result, w.Err)
			}
		}
		norm := func(p []byte, ns string) string { return strings.ReplaceAll(string(p), ns, "") }
		for _, i := range []int{2, 14, 16} { // the key's task: replaced, merged, in q2
			if out[i].Err != nil || want[i].Err != nil {
				continue
			}
			q := out[i].Info.Queue
			bt, err1 := h.insp.GetTaskInfo(q, out[i].TaskID)
			st, err2 := h.insp.GetTaskInfo(q, want[i].TaskID)
			if err1 != nil || err2 != nil || norm(bt.Payload, "b-") != norm(st.Payload, "s-") || bt.State != st.State || len(bt.Headers) != len(st.Headers) {
				t.Errorf("task %d's key: batch stored %+v (%v), Submit %+v (%v)", i, bt, err1, st, err2)
			}
		}
		_ = h.insp.DeleteQueue(q2, true)
	})
}
