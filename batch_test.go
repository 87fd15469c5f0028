package dedup

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
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
	if r := out[1]; !errors.As(r.Err, &dup) || dup.TaskID != held.ID || !errors.Is(r.Err, asynq.ErrDuplicateTask) {
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
			if !errors.As(out[2].Err, &dup) || dup.TaskID != out[0].TaskID {
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
	if _, err := h.client.Submit(ctx, user(1, "b", Fields("user_id")), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != first.TaskID {
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
	if out[0].Err != nil || !errors.As(out[1].Err, &dup) || dup.TaskID != out[0].TaskID || out[2].Err != nil || out[2].Fingerprint != "" {
		t.Fatalf("batch of per-task options: %+v", out)
	}
}

// On Redis Cluster a batch's lock calls go as one pipeline per master for
// queues spread over three masters, each straight to its master. (Tasks
// given their queue in asynq.NewTask are then stored by asynq's client, as
// in Submit.)
func TestClusterEnqueueBatchOnePipelinePerMaster(t *testing.T) {
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
		if !errors.As(r.Err, &dup) || dup.TaskID != held[i] {
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
