package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/attempt"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

type counterPayload struct {
	Key string `json:"key"`
	N   int    `json:"n"`
	Seq int    `json:"seq"`
}

func counterTask(key string, n, seq int) *asynq.Task {
	b, _ := json.Marshal(counterPayload{Key: key, N: n, Seq: seq})
	return asynq.NewTask("counter", b)
}

func decodeCounter(t *asynq.Task) counterPayload {
	var p counterPayload
	_ = json.Unmarshal(t.Payload(), &p)
	return p
}

// addMerge adds the counters; seq keeps the newest.
func addMerge(old, new []byte) ([]byte, error) {
	var a, b counterPayload
	if err := json.Unmarshal(old, &a); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(new, &b); err != nil {
		return nil, err
	}
	a.N += b.N
	a.Seq = max(a.Seq, b.Seq)
	return json.Marshal(a)
}

func TestReplaceFoldsIntoWaitingTasks(t *testing.T) {
	t.Parallel()     // mostly waiting: beside the other waiting tests
	needRealRedis(t) // 10,000 Lua calls: seconds on redis-server, minutes on miniredis
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnConflict: Replace}}})
	const keys, perKey, producers = 1000, 10, 8
	var created, replaced atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each producer owns a set of keys, so "last enqueued" is defined.
			for seq := range perKey {
				for k := p; k < keys; k += producers {
					res, err := h.client.Submit(context.Background(), counterTask(strconv.Itoa(k), 1, seq), asynq.Queue(h.queue), asynq.Retention(time.Hour))
					if err != nil {
						errs <- err
						return
					}
					switch res.Outcome {
					case Created:
						created.Add(1)
					case Replaced:
						replaced.Add(1)
						if res.Info.Payload == nil || res.Info.State != asynq.TaskStatePending {
							errs <- fmt.Errorf("replaced result %+v", res.Info)
							return
						}
					default:
						errs <- fmt.Errorf("outcome %v", res.Outcome)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if created.Load() != keys || replaced.Load() != keys*(perKey-1) {
		t.Fatalf("created %d, replaced %d; want %d and %d", created.Load(), replaced.Load(), keys, keys*(perKey-1))
	}
	if n := h.queueSize(h.queue); n != keys {
		t.Fatalf("queue holds %d tasks, want %d", n, keys)
	}
	var (
		mu   sync.Mutex
		seen = map[string][]int{}
	)
	done := make(chan struct{})
	var processed atomic.Int64
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		p := decodeCounter(task)
		mu.Lock()
		seen[p.Key] = append(seen[p.Key], p.Seq)
		mu.Unlock()
		if _, err := task.ResultWriter().Write([]byte("seq=" + strconv.Itoa(p.Seq))); err != nil {
			return err
		}
		if processed.Add(1) == keys {
			close(done)
		}
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 20 })
	waitFor(t, done, "all keys processed")
	mu.Lock()
	defer mu.Unlock()
	for k := range keys {
		got := seen[strconv.Itoa(k)]
		if len(got) != 1 || got[0] != perKey-1 {
			t.Fatalf("key %d processed with seqs %v, want once with %d", k, got, perKey-1)
		}
	}
	// The handler's ResultWriter worked on the rewritten tasks.
	eventually(t, "results stored", func() bool {
		tasks, err := h.insp.ListCompletedTasks(h.queue, asynq.PageSize(10))
		return err == nil && len(tasks) > 0 && string(tasks[0].Result) == "seq="+strconv.Itoa(perKey-1)
	})
	if s := h.d.StatsByType()["counter"]; s.Replaced != keys*(perKey-1) || s.Locked != keys {
		t.Fatalf("stats %+v", s)
	}
}

// Every other enqueue repeats the stored payload exactly (the script then
// writes nothing, but the call is still a replacement and is counted).
func TestReplaceSameKeyHundredTimes(t *testing.T) {
	h := newHarness(t, Config{})
	var first string
	for i := range 100 {
		res, err := h.client.Submit(context.Background(), counterTask("hot", 1, i-i%2), asynq.Queue(h.queue), Fields("key"), OnConflict(Replace))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = res.TaskID
			if res.Outcome != Created {
				t.Fatalf("first outcome %v", res.Outcome)
			}
		} else if res.Outcome != Replaced || res.TaskID != first {
			t.Fatalf("enqueue %d: %v into %s, want replaced into %s", i, res.Outcome, res.TaskID, first)
		}
	}
	if n := h.queueSize(h.queue); n != 1 {
		t.Fatalf("queue holds %d", n)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, first)
	if err != nil {
		t.Fatal(err)
	}
	if p := decodeCounter(asynq.NewTask("", ti.Payload)); p.Seq != 98 {
		t.Fatalf("stored payload seq %d, want 98 (asynqmon and the Inspector see the new payload)", p.Seq)
	}
	key := h.keyOf(counterTask("hot", 1, 0), h.queue, Fields("key"))
	if n, _ := h.rdb.HGet(context.Background(), modeKeyOf(key), store.FieldFolds).Result(); n != "99" {
		t.Fatalf("lock counts %q folded enqueues, want 99", n)
	}
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	r := waitFor(t, rc.runs, "run")
	if p := decodeCounter(r.task); r.id != first || p.Seq != 98 {
		t.Fatalf("ran %s with seq %d", r.id, p.Seq)
	}
	eventually(t, "lock released", func() bool { return len(h.locks()) == 0 })
	select {
	case r := <-rc.runs:
		t.Fatalf("ran a second time: %s", r.id)
	default:
	}
}

// The rewrite of asynq's stored message changes the payload and nothing else.
func TestReplaceKeepsTaskOptions(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnConflict: Replace}}})
	deadline := time.Now().Add(time.Hour).Truncate(time.Second)
	opts := []asynq.Option{asynq.Queue(h.queue), asynq.MaxRetry(7), asynq.Timeout(time.Minute), asynq.Deadline(deadline), asynq.Retention(time.Hour)}
	task := asynq.NewTaskWithHeaders("counter", counterTask("k", 1, 1).Payload(), map[string]string{"trace": "abc"})
	info, err := h.client.Enqueue(task, opts...)
	if err != nil {
		t.Fatal(err)
	}
	before, _ := h.insp.GetTaskInfo(h.queue, info.ID)
	for _, payload := range [][]byte{counterTask("k", 1, 2).Payload(), []byte(`{"key":"k"}`), counterTask("k", 5, 300).Payload()} {
		if _, err := h.client.Enqueue(asynq.NewTask("counter", payload), opts...); err != nil {
			t.Fatal(err)
		}
		after, err := h.insp.GetTaskInfo(h.queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		if string(after.Payload) != string(payload) {
			t.Fatalf("payload %s, want %s", after.Payload, payload)
		}
		if after.ID != before.ID || after.Type != before.Type || after.Queue != before.Queue || after.MaxRetry != 7 ||
			after.Timeout != time.Minute || !after.Deadline.Equal(deadline) || after.Retention != time.Hour ||
			after.Headers["trace"] != "abc" || after.State != asynq.TaskStatePending {
			t.Fatalf("task changed beyond its payload:\nbefore %+v\nafter  %+v", before, after)
		}
	}
}

func TestMergeErrorKeepsPayload(t *testing.T) {
	h := newHarness(t, Config{})
	boom := errors.New("cannot merge")
	merge := func(old, new []byte) ([]byte, error) {
		if string(new) == `{"key":"k","n":0,"seq":0}` {
			return nil, boom
		}
		return addMerge(old, new)
	}
	info, err := h.client.Enqueue(counterTask("k", 2, 1), asynq.Queue(h.queue), Fields("key"), MergeWith(merge))
	if err != nil {
		t.Fatal(err)
	}
	res, err := h.client.Submit(context.Background(), counterTask("k", 3, 2), asynq.Queue(h.queue), Fields("key"), MergeWith(merge))
	if err != nil || res.Outcome != Merged || res.TaskID != info.ID {
		t.Fatalf("merge: %+v, %v", res, err)
	}
	if _, err := h.client.Enqueue(counterTask("k", 0, 0), asynq.Queue(h.queue), Fields("key"), MergeWith(merge)); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want the merge error", err)
	}
	// A merge that changes the key is refused.
	bad := func(old, new []byte) ([]byte, error) { return []byte(`{"key":"other"}`), nil }
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue), Fields("key"), MergeWith(bad)); !errors.Is(err, ErrInvalidPayload) {
		t.Fatalf("key-changing merge: err = %v", err)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
	if err != nil {
		t.Fatal(err)
	}
	if p := decodeCounter(asynq.NewTask("", ti.Payload)); p.N != 5 {
		t.Fatalf("stored n = %d, want 5 (failed merges leave it as it was)", p.N)
	}
}

func TestMergeConcurrentProducersWithDefer(t *testing.T) {
	t.Parallel()
	needRealRedis(t)
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {
		Fields: []string{"key"}, OnConflict: Merge, MergeFunc: addMerge, OnRunning: RunningDefer,
	}}})
	const producers, increments, keys = 8, 1000, 50
	var (
		mu        sync.Mutex
		sums      = map[string]int{}
		running   = map[string]int{}
		overlap   atomic.Int32
		processed atomic.Int64
	)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		p := decodeCounter(task)
		mu.Lock()
		running[p.Key]++
		if running[p.Key] > 1 {
			overlap.Add(1)
		}
		mu.Unlock()
		time.Sleep(time.Millisecond) // some work, so enqueues meet running keys
		mu.Lock()
		running[p.Key]--
		sums[p.Key] += p.N
		mu.Unlock()
		processed.Add(int64(p.N))
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 8 })

	var wg sync.WaitGroup
	var total atomic.Int64
	outcomes := make([]atomic.Int64, Deferred+1)
	errs := make(chan error, producers)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range increments / producers {
				n := 1 + (p+i)%5
				res, err := h.client.Submit(context.Background(), counterTask("k"+strconv.Itoa((p*7+i)%keys), n, i), asynq.Queue(h.queue))
				if err != nil {
					errs <- err
					return
				}
				total.Add(int64(n))
				outcomes[res.Outcome].Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	eventually(t, "every increment processed", func() bool { return processed.Load() >= total.Load() })
	eventually(t, "locks released", func() bool { return len(h.locks()) == 0 })
	if processed.Load() != total.Load() {
		t.Fatalf("processed %d, enqueued %d", processed.Load(), total.Load())
	}
	if overlap.Load() != 0 {
		t.Fatalf("%d overlapping runs of one key", overlap.Load())
	}
	t.Logf("outcomes: created %d, merged %d, deferred %d", outcomes[Created].Load(), outcomes[Merged].Load(), outcomes[Deferred].Load())
	if outcomes[Merged].Load() == 0 {
		t.Fatal("no merges happened: the test did not exercise Merge")
	}
}

func TestDeferHotKeyBurst(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {
		Fields: []string{"key"}, OnConflict: Replace, OnRunning: RunningDefer,
	}}})
	var (
		holding   atomic.Int32
		tripped   atomic.Int32
		lastSeq   atomic.Int64
		processed atomic.Int64
	)
	lastSeq.Store(-1)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		if holding.Add(1) != 1 {
			tripped.Add(1)
		}
		time.Sleep(2 * time.Millisecond)
		lastSeq.Store(int64(decodeCounter(task).Seq))
		processed.Add(1)
		holding.Add(-1)
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 6 })
	const n = 300
	deferred := 0
	for i := range n {
		res, err := h.client.Submit(context.Background(), counterTask("hot", 1, i), asynq.Queue(h.queue))
		if err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
		if res.Outcome == Deferred {
			deferred++
		}
	}
	eventually(t, "last payload processed", func() bool { return lastSeq.Load() == n-1 && len(h.locks()) == 0 })
	if tripped.Load() != 0 {
		t.Fatalf("two handlers held the key at once %d times", tripped.Load())
	}
	if deferred == 0 {
		t.Fatal("no enqueue met the running key: the test did not exercise Defer")
	}
	t.Logf("%d enqueues, %d processed, %d follow-ups created", n, processed.Load(), deferred)
}

func TestRunningAllow(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnRunning: RunningAllow}}})
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	first := h.enqueue(counterTask("k", 1, 0))
	if _, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("while waiting: err = %v, want duplicate", err)
	}
	h.serve(rc.handler(), nil) // only now: a started run drops the lock
	waitFor(t, rc.runs, "first run")
	eventually(t, "key free once running", func() bool { return len(h.locks()) == 0 })
	second := h.enqueue(counterTask("k", 1, 2))
	if r := waitFor(t, rc.runs, "second run, alongside the first"); r.id != second.ID || second.ID == first.ID {
		t.Fatalf("ran %s", r.id)
	}
	close(release)
}

func TestMaxPending(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Fields: []string{"key"}, OnConflict: Replace, MaxPending: 3}}})
	for k := range 3 {
		h.enqueue(counterTask(strconv.Itoa(k), 1, 0))
	}
	_, err := h.client.Enqueue(counterTask("new", 1, 0), asynq.Queue(h.queue))
	if !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("fourth key: err = %v, want ErrTooManyPending", err)
	}
	res, err := h.client.Submit(context.Background(), counterTask("1", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Replaced {
		t.Fatalf("waiting key over the bound: %+v %v, want replaced", res, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := h.client.EnqueueContext(ctx, counterTask("new", 1, 0), asynq.Queue(h.queue), WaitForRoom()); !errors.Is(err, ErrTooManyPending) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting for room: err = %v", err)
	}
	if n := h.queueSize(h.queue); n != 3 {
		t.Fatalf("queue holds %d, want 3", n)
	}
	// Room appears when a waiting key starts running.
	got := make(chan *asynq.TaskInfo, 1)
	go func() {
		info, err := h.client.EnqueueContext(context.Background(), counterTask("new", 1, 0), asynq.Queue(h.queue), WaitForRoom())
		if err != nil {
			t.Error(err)
		}
		got <- info
	}()
	h.serve(func(context.Context, *asynq.Task) error { return nil }, nil)
	if info := waitFor(t, got, "room"); info == nil {
		t.Fatal("no task")
	}
	if s := h.d.Stats(); s.OverBound != 2 {
		t.Fatalf("OverBound = %d, want 2", s.OverBound)
	}
}

func TestDeferFollowUpOwedAfterFailure(t *testing.T) {
	t.Parallel()
	for _, final := range []bool{true, false} {
		t.Run(fmt.Sprintf("final=%v", final), func(t *testing.T) {
			h := newHarness(t, Config{Rules: map[string]Rule{"counter": {
				Fields: []string{"key"}, OnConflict: Replace, OnRunning: RunningDefer,
			}}})
			release, releaseRetry := make(chan struct{}), make(chan struct{})
			var attempts atomic.Int32
			rc := newRecorder(func(r run) error {
				if decodeCounter(r.task).Seq != 0 {
					return nil // the follow-up succeeds
				}
				if attempts.Add(1) > 1 {
					<-releaseRetry
					return nil // the retry succeeds
				}
				<-release
				if final {
					return fmt.Errorf("gives up: %w", asynq.SkipRetry)
				}
				return errors.New("transient")
			})
			h.serve(rc.handler(), nil)
			first := h.enqueue(counterTask("k", 1, 0))
			waitFor(t, rc.runs, "first run")
			res, err := h.client.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("%+v %v", res, err)
			}
			close(release)
			next := waitFor(t, rc.runs, "next run")
			if !final {
				// The retry comes first; the follow-up waits for it.
				if next.id != first.ID {
					t.Fatalf("ran %s before the retry of %s", next.id, first.ID)
				}
				if ti, err := h.insp.GetTaskInfo(h.queue, res.TaskID); err != nil || ti.State != asynq.TaskStateScheduled {
					t.Fatalf("follow-up during the retry: %+v %v, want still parked", ti, err)
				}
				close(releaseRetry)
				next = waitFor(t, rc.runs, "follow-up run")
			}
			if next.id != res.TaskID || decodeCounter(next.task).Seq != 1 {
				t.Fatalf("ran %s seq %d, want the follow-up %s", next.id, decodeCounter(next.task).Seq, res.TaskID)
			}
			eventually(t, "locks released", func() bool { return len(h.locks()) == 0 })
		})
	}
}

// OnDecision hears every duplicate, fold and busy arrival, with the task
// involved and the lock key, never the payload; Result.FollowUp tells a
// fold into a follow-up from one into the waiting task.
func TestOnDecisionHearsDuplicatesFoldsAndBusy(t *testing.T) {
	var mu sync.Mutex
	var heard []Decision
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.OnDecision = func(dec Decision) { mu.Lock(); heard = append(heard, dec); mu.Unlock() }
	h := newHarness(t, cfg)
	ctx := context.Background()
	first := h.enqueue(counterTask("k", 1, 0))
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Replaced || res.FollowUp {
		t.Fatalf("replace into the waiting task: %+v %v", res, err)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), OnConflict(Reject)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("reject: %v", err)
	}
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	waitFor(t, rc.runs, "first run")
	d1, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || d1.Outcome != Deferred || !d1.FollowUp {
		t.Fatalf("defer: %+v %v", d1, err)
	}
	d2, err := h.client.Submit(ctx, counterTask("k", 1, 4), asynq.Queue(h.queue))
	if err != nil || d2.Outcome != Replaced || !d2.FollowUp || d2.TaskID != d1.TaskID {
		t.Fatalf("a later fold into the follow-up: %+v %v; want Replaced with FollowUp into %s", d2, err, d1.TaskID)
	}
	// A task that arrives without a lock and meets the busy key.
	if _, err := h.asynq.Enqueue(counterTask("k", 9, 9), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "busy heard", func() bool { mu.Lock(); defer mu.Unlock(); return heard[len(heard)-1].Event == "busy" })
	close(release)
	mu.Lock()
	defer mu.Unlock()
	key := h.keyOf(counterTask("k", 0, 0), h.queue)
	want := []Decision{
		{Event: "replaced", TaskID: first.ID},
		{Event: "duplicate", TaskID: first.ID},
		{Event: "deferred", TaskID: d1.TaskID, FollowUp: true},
		{Event: "replaced", TaskID: d1.TaskID, FollowUp: true},
		{Event: "busy", TaskID: first.ID},
	}
	if len(heard) != len(want) {
		t.Fatalf("heard %+v, want %d decisions", heard, len(want))
	}
	for i, w := range want {
		w.Type, w.Queue, w.Key = "counter", h.queue, key
		if heard[i] != w {
			t.Errorf("decision %d: %+v, want %+v", i, heard[i], w)
		}
	}
}

// A panicking OnDecision is logged; the call's answer stands.
func TestOnDecisionPanicDoesNotFailTheCall(t *testing.T) {
	h := newHarness(t, Config{OnDecision: func(Decision) { panic("hook") }})
	first := h.enqueue(userTask(1, ""))
	if dup := h.duplicateOf(userTask(1, "")); dup.Holder != first.ID {
		t.Fatalf("duplicate of %s, want %s", dup.Holder, first.ID)
	}
}

// A fold keeps the target task's options: Result.NotApplied names the
// call's asynq options that were not applied.
func TestFoldReportsOptionsNotApplied(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace}))
	h.enqueue(counterTask("k", 1, 0))
	res, err := h.client.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.MaxRetry(3), asynq.ProcessIn(time.Minute))
	if err != nil || res.Outcome != Replaced {
		t.Fatalf("%+v %v", res, err)
	}
	if got := fmt.Sprint(res.NotApplied); got != "[MaxRetry(3) ProcessIn(1m0s)]" {
		t.Fatalf("NotApplied = %s", got)
	}
	res, err = h.client.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.NotApplied != nil {
		t.Fatalf("a fold without asynq options: %+v %v", res, err)
	}
}

// With Reject + RunningDefer, an enqueue that meets a running key whose
// follow-up waits is refused as a duplicate OF THE FOLLOW-UP (README). The
// Decision then names the follow-up as TaskID: its FollowUp field must say
// so ("whether that task is a follow-up").
func TestOnDecisionMarksADuplicateOfAFollowUp(t *testing.T) {
	var rec decisions
	cfg := counterRules(Rule{OnConflict: Reject, OnRunning: RunningDefer})
	cfg.OnDecision = rec.hook
	h := newHarness(t, cfg)
	ctx := context.Background()
	h.enqueue(counterTask("k", 1, 0))
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	waitFor(t, rc.runs, "first run")
	d1, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || d1.Outcome != Deferred || !d1.FollowUp {
		t.Fatalf("defer: %+v %v", d1, err)
	}
	_, err = h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || dup.Holder != d1.TaskID {
		t.Fatalf("second enqueue: %v, want a duplicate of the follow-up %s", err, d1.TaskID)
	}
	heard := rec.all()
	last := heard[len(heard)-1]
	if last.Event != "duplicate" || last.TaskID != d1.TaskID || !last.FollowUp {
		t.Fatalf("decision %+v: TaskID is the follow-up %s, but FollowUp = %v", last, d1.TaskID, last.FollowUp)
	}
}

// Options given to asynq.NewTask are the call's options too: folded into
// another task, they are not applied, and NotApplied must name them.
func TestFoldNamesNewTaskOptionsNotApplied(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace}))
	h.enqueue(counterTask("k", 1, 0))
	task := asynq.NewTask("counter", counterTask("k", 1, 1).Payload(), asynq.MaxRetry(3))
	res, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue))
	if err != nil || res.Outcome != Replaced {
		t.Fatalf("%+v %v", res, err)
	}
	if got := fmt.Sprint(res.NotApplied); got != "[MaxRetry(3)]" {
		t.Fatalf("NotApplied = %s, want [MaxRetry(3)]: the holder kept its own MaxRetry", got)
	}
}

// README: "RunningDefer never runs two tasks of a key at once"; "After a
// failure with retries left it waits for the retry, so the newest payload
// still runs last". Under load: producers per key, handlers that fail a
// third of the time, Replace + RunningDefer on the direct path.
func TestDeferUnderLoadNeverOverlapsAndEndsWithTheNewest(t *testing.T) {
	t.Parallel()
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	var rmu sync.Mutex
	rng := rand.New(rand.NewPCG(6, 6))
	tr := newKeyTracker(counterKeyOf)
	h.serve(tr.handler(func(r keyRun) error {
		rmu.Lock()
		sleep, fail := time.Duration(rng.IntN(15))*time.Millisecond, rng.IntN(3) == 0
		rmu.Unlock()
		time.Sleep(sleep)
		if fail {
			return errors.New("flaky")
		}
		return nil
	}), func(c *asynq.Config) { c.Concurrency = 8 })
	const keys, n = 3, 60
	var wg sync.WaitGroup
	errs := make(chan error, keys*n)
	for k := range keys {
		wg.Go(func() {
			for s := 1; s <= n; s++ {
				_, err := h.client.Submit(ctx, counterTask(fmt.Sprint("k", k), 1, s), asynq.Queue(h.queue))
				var dup *DuplicateTaskError
				if err != nil && !errors.As(err, &dup) {
					errs <- err
				}
				time.Sleep(time.Duration(s%4) * time.Millisecond)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("enqueue: %v", err)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("runs of one key overlapped: %v", o)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	last := map[string]int{}
	for _, r := range tr.done {
		if r.err == nil {
			last[r.key] = r.seq
		}
	}
	for k := range keys {
		key := fmt.Sprint("k", k)
		if last[key] != n {
			t.Errorf("key %s: last successful run had seq %d, want the newest, %d", key, last[key], n)
		}
	}
}

// slowEnqueuer is an Enqueuer whose first call takes a while (a decorator
// that calls a slow service, a Redis hiccup with go-redis's retries).
type slowEnqueuer struct {
	c       *asynq.Client
	delay   time.Duration
	once    *sync.Once
	entered chan struct{}
}

func (s slowEnqueuer) Enqueue(t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	return s.EnqueueContext(context.Background(), t, o...)
}

func (s slowEnqueuer) EnqueueContext(ctx context.Context, t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	slow := false
	s.once.Do(func() { slow = true; close(s.entered) })
	if slow {
		time.Sleep(s.delay)
	}
	return s.c.EnqueueContext(ctx, t, o...)
}

// README: Merge: "concurrent producers never lose an update"; a Replace
// or Merge that meets a holder whose WrapClient producer has not stored it
// yet "waits for it, about 0.8 s in all, then is answered as a duplicate". A
// Merge that meets a holder its producer stores within the wait merges;
// one whose producer takes longer (a slow Enqueuer) is told it was not
// merged (a DuplicateTaskError naming the holder), never silently dropped.
func TestMergeIntoAHolderStillBeingStoredMergesOrSaysSo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		delay  time.Duration
		merged bool
	}{{200 * time.Millisecond, true}, {1500 * time.Millisecond, false}} {
		t.Run(tc.delay.String(), func(t *testing.T) { mergeIntoHolderBeingStored(t, tc.delay, tc.merged) })
	}
}

func mergeIntoHolderBeingStored(t *testing.T, delay time.Duration, merged bool) {
	h := newHarness(t, counterRules(Rule{OnConflict: Merge, MergeFunc: addMerge}))
	ctx := context.Background()
	se := slowEnqueuer{c: h.asynq, delay: delay, once: new(sync.Once), entered: make(chan struct{})}
	c := h.d.WrapClient(se)
	first := make(chan error, 1)
	go func() {
		_, err := c.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
		first <- err
	}()
	<-se.entered
	res, err := c.Submit(ctx, counterTask("k", 2, 2), asynq.Queue(h.queue))
	if err := <-first; err != nil {
		t.Fatalf("first: %v", err)
	}
	var dup *DuplicateTaskError
	switch {
	case merged && (err != nil || res.Outcome != Merged):
		t.Errorf("merge into the holder being stored: %+v, %v; want Merged (its n=2 is otherwise lost)", res, err)
	case !merged && !errors.As(err, &dup):
		t.Errorf("merge into a holder stored after the wait: %+v, %v; want a DuplicateTaskError (not merged, and told so)", res, err)
	}
}

// README: "A call under the caller-chosen ID of the task that holds its
// key meets that task as any call of the key does"; RunningDefer: "later
// ones are folded into it"; "After a failure with retries left it waits
// for the retry, so the newest payload still runs last"; "once no task with
// an ID exists the ID can be used again". Caller-chosen IDs on every call
// of a Replace + RunningDefer key whose holder fails once.
func TestDeferWithCallerIDsAndARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(func(r keyRun) error {
		if r.seq == 1 && r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	}), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	idA, idB, idC := "a-"+uniq(t), "b-"+uniq(t), "c-"+uniq(t)
	if _, err := h.client.Submit(ctx, counterTask("k", 1, 1), q, asynq.TaskID(idA)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, tr.starts, "the holder runs")
	fb, err := h.client.Submit(ctx, counterTask("k", 1, 2), q, asynq.TaskID(idB))
	if err != nil || fb.Outcome != Deferred {
		t.Fatalf("B: %+v %v, want Deferred", fb, err)
	}
	fc, err := h.client.Submit(ctx, counterTask("k", 1, 3), q, asynq.TaskID(idC))
	if err != nil || fc.Outcome != Replaced || fc.TaskID != fb.TaskID || !fc.FollowUp {
		t.Fatalf("C: %+v %v, want Replaced into the follow-up %s", fc, err, fb.TaskID)
	}
	tr.open(1)
	var runs []keyRun
	for len(runs) < 3 {
		runs = append(runs, waitFor(t, tr.ends, "runs"))
	}
	if runs[0].id != idA || runs[0].err == nil || runs[1].id != idA || runs[1].err != nil || runs[2].id != fb.TaskID || runs[2].seq != 3 {
		t.Fatalf("runs %+v: want %s failing, %s again succeeding, then the follow-up %s with seq 3", runs, idA, idA, fb.TaskID)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if extra := len(tr.ends); extra != 0 {
		t.Errorf("%d more runs", extra)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
	if n, _ := h.rdb.Keys(ctx, h.prefix+":*").Result(); len(n) != 0 {
		t.Errorf("keys left behind: %v", n)
	}
	// The IDs are free again, each for a new task.
	for i, id := range []string{idA, idB, idC} {
		if r, err := h.client.Submit(ctx, counterTask(fmt.Sprint("n", i), 1, 9), q, asynq.TaskID(id)); err != nil || r.TaskID != id {
			t.Errorf("ID %s reused: %+v %v", id, r, err)
		}
	}
}

// README: "RunningAllow frees the key when the task starts; the next
// enqueue creates a new task". A RunningAllow task whose first attempt
// failed starts its retry on a server of another process (with the type's
// rule, which a server of a RunningAllow type needs: the lock goes when the
// task starts, so a retry takes one by the server's own rule): the key is
// free while the retry runs, as it was while the first attempt ran.
func TestRunningAllowFreesTheKeyForARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnRunning: RunningAllow}))
	ctx := context.Background()
	ds, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: counterRules(Rule{OnRunning: RunningAllow}).Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	hold := make(chan struct{})
	tr := newKeyTracker(counterKeyOf)
	serveWith(t, h.rdb, ds, h.queue, tr.handler(func(r keyRun) error {
		if r.seq != 1 {
			return nil
		}
		if r.retry == 0 {
			return errors.New("flaky")
		}
		<-hold
		return nil
	}), nil)
	t.Cleanup(func() { close(hold) })
	h.enqueue(counterTask("k", 1, 1))
	for {
		r := waitFor(t, tr.starts, "the task runs")
		if r.retry == 0 {
			// While the first attempt runs, the key is free (RunningAllow).
			continue
		}
		break
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Created {
		t.Errorf("enqueue while the RunningAllow task's retry runs: %+v %v; want a new task (the key frees when the task starts)", res, err)
	}
}

// README (When the key is already taken): RunningDefer "never runs two
// tasks of a key at once. The first enqueue that meets a running key creates
// one follow-up task, and later ones are folded into it … When the run ends
// — success, revoke, or final failure — the follow-up is queued and takes
// the lock". For a task NewClient stored with its lock, whose attempt began
// before the follow-up was made: its end, however it ends, hands the key to
// the follow-up, which runs last with the newest payload; every lock is
// started and released once, none lost.
func TestDeferFollowUpMadeDuringADirectTasksRunGetsTheKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  error
	}{
		{"success", nil},
		{"RevokeTask", asynq.RevokeTask},
		{"SkipRetry", fmt.Errorf("no: %w", asynq.SkipRetry)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newDirectHarness(t, Rule{OnConflict: Replace, OnRunning: RunningDefer})
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 1)
			serveWith(t, h.rdb, h.d, h.queue, tr.handler(func(r keyRun) error {
				if r.seq == 1 {
					return tc.end
				}
				return nil
			}), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
			t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
			a := h.enqueue(counterTask("k", 1, 1))
			requirePlainID(t, a.ID)
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			waitFor(t, tr.starts, "A runs")
			if owner := h.lockOwner(key); owner != a.ID {
				t.Fatalf("A runs, its key held by %q", owner)
			}
			r2, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || r2.Outcome != Deferred {
				t.Fatalf("enqueue while A runs: %+v, %v; want Deferred", r2, err)
			}
			r3, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
			if err != nil || r3.TaskID != r2.TaskID {
				t.Fatalf("second enqueue while A runs: %+v, %v; want folded into %s", r3, err, r2.TaskID)
			}
			tr.open(1)
			waitFor(t, tr.ends, "A ends")
			next := waitFor(t, tr.starts, "the follow-up runs")
			if next.id != r2.TaskID || next.seq != 3 {
				t.Fatalf("after A ran %s seq %d, want the follow-up %s with seq 3", next.id, next.seq, r2.TaskID)
			}
			waitFor(t, tr.ends, "the follow-up ends")
			eventually(t, "the key free after the follow-up", func() bool {
				return h.rdb.Exists(ctx, key).Val() == 0 && h.rdb.Exists(ctx, modeKeyOf(key)).Val() == 0
			})
			if ov := tr.overlapsSeen(); len(ov) > 0 {
				t.Fatalf("overlaps: %v", ov)
			}
			// (The follow-up's settle frees the key before the middleware counts it.)
			eventually(t, "both releases counted", func() bool { return h.d.Stats().Released >= 2 })
			if st := h.d.Stats(); st.LockLost != 0 || st.Started != 2 || st.Released != 2 {
				t.Fatalf("stats %+v: want 2 started, 2 released, none lost", st)
			}
			select {
			case r := <-tr.starts:
				t.Fatalf("unexpected run %+v", r)
			default:
			}
		})
	}
}

// README (Lock lifecycle): "success | released, … — or, with a
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

// A Replace into a holder this process met (the fold fast path) lands only in
// a holder that still waits: one an operator archived, deleted or released
// since is not written into, and the call makes a new task. (Deleted: on the
// direct path; a wrapped enqueue's key, taken before its task was stored,
// reads a missing record as not stored yet until HealGrace has passed.)
func TestReplaceFoldFastPathSkipsAHolderArchivedDeletedOrReleasedSince(t *testing.T) {
	for _, how := range []string{"archive", "delete", "release"} {
		t.Run(how, func(t *testing.T) {
			paths := bothPaths
			if how == "delete" {
				paths = func(t *testing.T, cfg Config, test func(*testing.T, *harness)) {
					h := newHarness(t, cfg)
					h.client = h.d.NewClient()
					test(t, h)
				}
			}
			paths(t, counterRules(Rule{OnConflict: Replace}), func(t *testing.T, h *harness) {
				ctx := context.Background()
				submit := func(seq int) Result {
					t.Helper()
					res, err := h.client.Submit(ctx, counterTask("k", 1, seq), asynq.Queue(h.queue))
					if err != nil {
						t.Fatalf("submit %d: %v", seq, err)
					}
					return res
				}
				a := submit(1)
				if r := submit(2); r.Outcome != Replaced || r.TaskID != a.TaskID {
					t.Fatalf("second submit: %v into %s, want replaced into %s", r.Outcome, r.TaskID, a.TaskID)
				}
				var err error
				switch how {
				case "archive":
					err = h.insp.ArchiveTask(h.queue, a.TaskID)
				case "delete":
					err = h.insp.DeleteTask(h.queue, a.TaskID)
				case "release":
					var ok bool
					ok, err = h.d.Release(ctx, counterTask("k", 1, 0), a.TaskID, asynq.Queue(h.queue))
					if err == nil && !ok {
						t.Fatal("release: not released")
					}
				}
				if err != nil {
					t.Fatalf("%s: %v", how, err)
				}
				r := submit(3)
				if r.Outcome != Created || r.TaskID == a.TaskID {
					t.Fatalf("after %s: %v into %s, want a new task", how, r.Outcome, r.TaskID)
				}
				if how != "delete" {
					if p := decodeCounter(asynq.NewTask("counter", []byte(h.payloadOf(a.TaskID)))); p.Seq != 2 {
						t.Fatalf("the %sd holder's payload now has seq %d, want 2", how, p.Seq)
					}
				}
			})
		})
	}
}

// Under a key shared by two types, a Replace of one type into a waiting
// holder of the other (met before, so the fold fast path is tried) is a
// duplicate naming the holder, which keeps its payload.
func TestReplaceFoldFastPathRefusesAHolderOfAnotherTypeUnderASharedKey(t *testing.T) {
	r := Rule{OnConflict: Replace, Key: "one", Shared: true}
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": r, "other": r}})
	h.client = h.d.NewClient()
	ctx := context.Background()
	a, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // (the second meets the holder through the hint)
		_, err = h.client.Submit(ctx, asynq.NewTask("other", []byte(`{"seq":9}`)), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || dup.Holder != a.TaskID || dup.Type != "other" || dup.CoolingDown || dup.FailHeld {
			t.Fatalf("other type's replace %d: %v (%+v), want a duplicate of %s", i, err, dup, a.TaskID)
		}
	}
	if p := decodeCounter(asynq.NewTask("counter", []byte(h.payloadOf(a.TaskID)))); p.Seq != 1 {
		t.Fatalf("holder's payload has seq %d, want 1", p.Seq)
	}
}

// Every enum of the package prints a word for each of its values, its zero
// value included: a failed BatchResult prints its Outcome as "none", not
// "Outcome(0)".
func TestEnumsPrintAWordForEveryValueZeroIncluded(t *testing.T) {
	word := func(s string) bool {
		for _, r := range s {
			if (r < 'a' || r > 'z') && r != '_' {
				return false
			}
		}
		return s != ""
	}
	values := map[string][]fmt.Stringer{
		"Outcome":         {Outcome(0), Created, Replaced, Merged, Deferred},
		"Conflict":        {Conflict(0), Replace, Merge},
		"Running":         {Running(0), RunningAllow, RunningDefer},
		"Busy":            {Busy(0), BusyDrop, BusyFold},
		"Failure":         {Failure(0), FailHold, FailHoldUntilReleased},
		"breakerState":    {breakerState(0), breakerOpen, breakerProbing},
		"attempt.Outcome": {attempt.Outcome(0), attempt.Superseded},
	}
	for typ, vs := range values {
		for _, v := range vs {
			if s := v.String(); !word(s) {
				t.Errorf("%s %d prints %q, want a word", typ, v, s)
			}
		}
	}
	if s := Outcome(0).String(); s != "none" {
		t.Errorf("the zero Outcome prints %q, want \"none\"", s)
	}
	failed := BatchResult{Err: ErrUnavailable}
	if s := fmt.Sprintf("%v", failed); !strings.Contains(s, "none") || strings.Contains(s, "Outcome(") {
		t.Errorf("a failed BatchResult prints %s", s)
	}
}

// Merge: while the holder's given-up handler runs, an update is deferred (not
// merged into the holder's waiting retry, whose payload that handler already
// runs); a later one merges into the follow-up; the merged newest runs once.
func TestMergeWhileAGivenUpHandlerRunsIsDeferredNotMergedIntoItsRetry(t *testing.T) {
	t.Parallel()
	g := startGivenUp(t, Rule{OnConflict: Merge, MergeFunc: addMerge, OnRunning: RunningDefer}, true, 3*time.Second)
	res, err := g.submit(t, 2, 2)
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update: %v %+v, want deferred", err, res)
	}
	res3, err := g.submit(t, 3, 4)
	if err != nil || res3.Outcome != Merged || !res3.FollowUp || res3.TaskID != res.TaskID {
		t.Fatalf("second update: %v %+v, want merged into follow-up %s", err, res3, res.TaskID)
	}
	if p := decodeCounter(asynq.NewTask("", []byte(g.h.payloadOf(g.holder.ID)))); p.Seq != 1 || p.N != 1 {
		t.Fatalf("holder's retry now carries %+v, want seq 1 n 1", p)
	}
	g.settle(t, counterPayload{Key: "k", N: 6, Seq: 3})
}

// RunningReject with Replace (and with Merge): while the holder's given-up
// handler runs, an update is a duplicate, through the wrapped client and the
// direct one, and the retry keeps its payload; once the handler returns an
// update is taken and the newest runs once.
func TestRejectUpdateWhileAGivenUpHandlerRunsIsADuplicateUntilItReturns(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		rule   Rule
		direct bool
	}{
		{"replace-direct", Rule{OnConflict: Replace}, true},
		{"merge-direct", Rule{OnConflict: Merge, MergeFunc: addMerge}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			g := startGivenUp(t, tc.rule, tc.direct, 3*time.Second)
			res, err := g.submit(t, 2, 2)
			if !errors.Is(err, ErrDuplicateTask) {
				t.Fatalf("update while the given-up handler runs: %v %+v, want ErrDuplicateTask", err, res)
			}
			if p := decodeCounter(asynq.NewTask("", []byte(g.h.payloadOf(g.holder.ID)))); p.Seq != 1 {
				t.Fatalf("holder's retry now carries %+v, want seq 1", p)
			}
			close(g.release)
			var took Result
			eventually(t, "an update is taken once the handler returns", func() bool {
				r, err := g.submit(t, 3, 4)
				took = r
				return err == nil
			})
			t.Logf("update after the handler returned: %+v", took)
			g.release = make(chan struct{})
			want := counterPayload{Key: "k", N: 4, Seq: 3}
			if took.Outcome == Merged {
				want.N = 5
			}
			if n := g.settle(t, want); n != 1 {
				t.Logf("seq 1 ran %d times", n)
			}
		})
	}
}
