package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Adversarial tests of Client.EnqueueBatch and of this package's options
// given to asynq.NewTask (round 13). Each asserts a documented promise, so
// it fails while the bug it names exists.

const batchJobType = "adv13:job"

func batchJob(key string, n int, opts ...asynq.Option) *asynq.Task {
	return asynq.NewTask(batchJobType, fmt.Appendf(nil, `{"key":%q,"n":%d}`, key, n), opts...)
}

func batchJobRules(r Rule) Config {
	r.Fields = []string{"key"}
	return Config{Rules: map[string]Rule{batchJobType: r}}
}

// Two tasks of a batch given the same caller-chosen asynq.TaskID in
// asynq.NewTask, with different keys: Submit one after the other creates the
// first (its key locked by it) and refuses the second with
// asynq.ErrTaskIDConflict, locking nothing. docs/batch.md: "A BatchResult is
// the Result and the error Submit would have returned for the task alone",
// "Each task stands alone ... never left half done".
func TestEnqueueBatchSameCallerIDTwiceRefusesTheSecond(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		for round := range 5 {
			id := fmt.Sprintf("adv13-id-%d", round)
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

// A key this process last saw held (it enqueued the holder) whose holder has
// since run and released it elsewhere (a worker in another process): a
// batch of a Replace and then a Reject of that key. The Replace's first
// call (the replace script, into the remembered holder) does not apply
// and it goes to a second round; the Reject takes the key in the first;
// then the Replace, settled first (inOrder), waits for the Reject's task
// to be stored, which is settled after it: up to maxReservedWaits polls,
// then it is answered as a duplicate of the later task. Submit one after the
// other: the Replace meets a free key and creates the task, the Reject is a
// duplicate of it. docs/batch.md: "Two tasks of one key are answered in
// order. The first takes the key; the later one meets it as its holder".
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
		if !errors.As(out[1].Err, &dup) || dup.TaskID != out[0].TaskID {
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

// batchChildEnv names the attack a child process of the test binary runs
// (runInChild), for one whose failure would take the process down.
const batchChildEnv = "ADV13_CHILD"

// runInChild runs the test named in the child process, and reports whether
// it ended well (exit status 0), with its output.
func runInChild(t *testing.T, name string) (bool, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), batchChildEnv+"="+name)
	out, err := cmd.CombinedOutput()
	return err == nil, string(out)
}

// A MergeFunc that panics: Submit lets the panic reach its caller, who may
// recover it (as net/http's server does for a handler). EnqueueBatch runs a
// Merge on a goroutine of its own (settleBatch, up to 16 at once), where the
// panic cannot be recovered by anyone: the whole process dies.
// docs/batch.md: "A BatchResult is the Result and the error Submit would
// have returned for the task alone"; "Each task stands alone".
func TestEnqueueBatchMergeFuncPanicDoesNotKillTheProcess(t *testing.T) {
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
// batch with the same caller-chosen asynq.TaskID: Submit one after the other
// creates the first and refuses the second (asynq.ErrTaskIDConflict). In a
// batch the tasks without a lock are enqueued after every lock call, at the
// same moment as the others: the later task may win the ID.
func TestEnqueueBatchSkippedTaskKeepsItsIDFromALaterTask(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		for round := range 10 {
			id := fmt.Sprintf("adv13-skip-%d", round)
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

// dedup.Headers given to asynq.NewTask as the task's only option of this
// package: Submit, Enqueue, EnqueueBatch (and Lookup, QueueOf) dereference
// a nil rule and panic (call.go ownOptions: applyOption adds the headers without making
// the rule copy, then endLayer is called on the nil *resolved). options.go:
// "Per-call options take effect ... given to the call or to the task's
// asynq.NewTask"; headers.go: Headers is how a wrapper adds a trace context.
func TestHeadersAsNewTasksOnlyOptionWorkEverywhere(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		try := func(what string, f func() error) {
			t.Helper()
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("%s panicked: %v", what, p)
				}
			}()
			if err := f(); err != nil {
				t.Errorf("%s: %v", what, err)
			}
		}
		hdr := map[string]string{"trace": "t-1"}
		try("Submit", func() error {
			r, err := h.client.Submit(ctx, batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue))
			if err == nil {
				if ti, gerr := h.insp.GetTaskInfo(h.queue, r.TaskID); gerr != nil || ti.Headers["trace"] != "t-1" {
					return fmt.Errorf("stored %+v, %v; want NewTask's headers", ti, gerr)
				}
			}
			return err
		})
		try("Enqueue", func() error {
			_, err := h.client.Enqueue(batchJob("e", 1, Headers(hdr)), asynq.Queue(h.queue))
			return err
		})
		try("EnqueueBatch", func() error {
			out := h.client.EnqueueBatch(ctx, []*asynq.Task{batchJob("b", 1), batchJob("b2", 1, Headers(hdr))}, asynq.Queue(h.queue))
			return errors.Join(out[0].Err, out[1].Err)
		})
		try("Skip", func() error {
			_, err := h.client.Submit(ctx, batchJob("k", 1, Headers(hdr)), asynq.Queue(h.queue), Skip())
			return err
		})
		try("Lookup", func() error {
			_, _, err := h.d.Lookup(ctx, batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue))
			return err
		})
		try("QueueOf", func() error {
			if q := h.d.QueueOf(batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue)); q != h.queue {
				return fmt.Errorf("QueueOf: %s, want %s", q, h.queue)
			}
			return nil
		})
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

func (c *afterFirstLockPipeline) DialHook(next redis.DialHook) redis.DialHook          { return next }
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
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		out := h.client.EnqueueBatch(ctx, tasks, asynq.Queue(h.queue), WaitForRoom())
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
// decision.go), so a hook written for one enqueuing goroutine needs no
// lock. EnqueueBatch calls it from the goroutines that settle its tasks
// (batch.go settleBatch, up to 16 at once), concurrently.
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

// sumMerge merges two adv13 payloads of one key: their n added.
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

// A Merge and then a Replace of a key whose task waits, in one batch.
// Submit one after the other: the merge adds 1 to the waiting task's n
// (0), then the Replace writes its payload (n 2): the task ends with n 2.
// In the batch the Replace's lock call (the first round, the replace
// script) runs before the Merge's compare-and-set (settled after the
// pipeline), which then fails, reads the replaced payload and merges into
// it: the task ends with n 3, the earlier task applied last.
// docs/batch.md: "Two tasks of one key are answered in order ... (a
// Replace leaves the last payload)".
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
			if !errors.As(out[i].Err, &dup) || dup.TaskID != out[0].TaskID {
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
// ErrTasksElsewhere" (client.go WrapClient), so that no live lock is left
// to heal after HealGrace and admit a duplicate. Submit one after the other
// stores one task elsewhere and refuses the rest; a batch begins every task
// before the first enqueue is probed, and stores them all elsewhere, each
// with a lock here that an owner check will heal.
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
			return asynq.NewTask("adv13:free", fmt.Appendf(nil, `{"key":%q,"n":%d}`, ns+key, n), opts...)
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
