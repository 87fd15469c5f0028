package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Adversarial tests, round 8: the worker's fast path (begin.lua/done.lua)
// for tasks locked at enqueue, and the seams of 1db4e7a (RunningAllow
// retries, locked tasks meeting a cooling key). Public API only, on a real
// asynq server and redis-server.

// trackedAttempt is one handler run.
type trackedAttempt struct {
	id    string
	seq   int
	retry int
	ctx   context.Context
}

// attemptTracker records runs, notes overlaps per key, and holds runs of gated
// (seq, retry) pairs until opened.
type attemptTracker struct {
	mu       sync.Mutex
	active   map[string]int
	overlaps []string
	gates    map[string]chan struct{}
	result   func(trackedAttempt) error
	starts   chan trackedAttempt
	ends     chan trackedAttempt
}

func newAttemptTracker(result func(trackedAttempt) error) *attemptTracker {
	return &attemptTracker{active: map[string]int{}, gates: map[string]chan struct{}{}, result: result,
		starts: make(chan trackedAttempt, 1000), ends: make(chan trackedAttempt, 1000)}
}

func attemptGateKey(seq, retry int) string { return fmt.Sprintf("%d/%d", seq, retry) }

// gate holds the run of seq at retry until open.
func (tr *attemptTracker) gate(seq, retry int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.gates[attemptGateKey(seq, retry)] = make(chan struct{})
}

func (tr *attemptTracker) open(seq, retry int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if g, ok := tr.gates[attemptGateKey(seq, retry)]; ok {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

func (tr *attemptTracker) openAll() {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, g := range tr.gates {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

func (tr *attemptTracker) handler() asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		p := decodeCounter(t)
		r := trackedAttempt{id: id, seq: p.Seq, retry: n, ctx: ctx}
		tr.mu.Lock()
		if tr.active[p.Key] > 0 {
			tr.overlaps = append(tr.overlaps, fmt.Sprintf("%s (seq %d retry %d) started beside another run of key %q", id, p.Seq, n, p.Key))
		}
		tr.active[p.Key]++
		g := tr.gates[attemptGateKey(p.Seq, n)]
		tr.mu.Unlock()
		tr.starts <- r
		if g != nil {
			<-g // (ignores ctx on purpose: a leftover handler)
		}
		var err error
		if tr.result != nil {
			err = tr.result(r)
		}
		tr.mu.Lock()
		tr.active[p.Key]--
		tr.mu.Unlock()
		tr.ends <- r
		return err
	}
}

func (tr *attemptTracker) overlapsSeen() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]string(nil), tr.overlaps...)
}

// waitAttemptOf waits up to d for a start of seq; nil if none.
func waitAttemptOf(ch <-chan trackedAttempt, seq int, d time.Duration) *trackedAttempt {
	deadline := time.After(d)
	for {
		select {
		case r := <-ch:
			if r.seq == seq {
				return &r
			}
		case <-deadline:
			return nil
		}
	}
}

func lookupState(t *testing.T, h *harness, task *asynq.Task, opts ...asynq.Option) string {
	t.Helper()
	l, found, err := h.d.Lookup(context.Background(), task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	if !found {
		return ""
	}
	return l.State + ":" + l.Holder
}

// 1. README (lock lifecycle; Benchmarks, "Worker side"): a task locked at
// enqueue by NewClient runs through begin/done; the lock must be held
// (Lookup: running) while it runs, held across a retry (retry-wait,
// duplicates refused), and released on success.
func TestFastPathHoldsTheKeyWhileRunningAndAcrossARetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(func(r trackedAttempt) error {
		if r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	})
	tr.gate(1, 0)
	tr.gate(1, 1)
	t.Cleanup(tr.openAll)
	h.serve(tr.handler(), nil)
	a := h.enqueue(counterTask("k", 1, 1))
	// (The fast path's precondition: a lock written with its task, field v.)
	if v, _ := h.rdb.HGet(context.Background(), h.keyOf(counterTask("k", 1, 1), h.queue), "v").Result(); v != "1" && len(tr.starts) == 0 {
		t.Logf("lock has no v field (%q): begin may not be exercised", v)
	}
	waitFor(t, tr.starts, "first attempt")
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("during the first attempt Lookup says %q, want running:%s", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue during the run: %v, want duplicate", err)
	}
	tr.open(1, 0)
	r := waitFor(t, tr.starts, "the retry")
	if r.id != a.ID || r.retry != 1 {
		t.Fatalf("ran %s retry %d", r.id, r.retry)
	}
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("during the retry Lookup says %q, want running:%s", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue during the retry: %v, want duplicate", err)
	}
	tr.open(1, 1)
	waitFor(t, tr.ends, "first end")
	waitFor(t, tr.ends, "retry end")
	eventually(t, "the lock is released after success", func() bool { return lookupState(t, h, counterTask("k", 1, 1)) == "" })
	if _, err := h.client.Enqueue(counterTask("k", 1, 4), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after success: %v", err)
	}
}

// 2. README (lock lifecycle): a key is free again after SkipRetry and
// exhausted retries (healed at its next enqueue) and after a revoke; a
// per-call Cooldown keeps the key after success — all on the fast path
// (NewClient, a lock holding nothing else, or a cd field).
func TestFastPathFreesOrCoolsTheKeyAtEachEnding(t *testing.T) {
	cases := []struct {
		name    string
		result  error
		opts    []asynq.Option
		cooling bool
	}{
		{"SkipRetry", fmt.Errorf("no: %w", asynq.SkipRetry), nil, false},
		{"exhausted", errors.New("boom"), []asynq.Option{asynq.MaxRetry(0)}, false},
		{"revoked", asynq.RevokeTask, nil, false},
		{"success with per-call Cooldown", nil, []asynq.Option{Cooldown(time.Minute)}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, counterRules(Rule{}))
			h.client = h.d.NewClient()
			tr := newAttemptTracker(func(trackedAttempt) error { return c.result })
			h.serve(tr.handler(), nil)
			a := h.enqueue(counterTask("k", 1, 1), c.opts...)
			waitFor(t, tr.ends, "the run")
			if c.cooling {
				eventually(t, "the key cools", func() bool { return lookupState(t, h, counterTask("k", 1, 1)) == "cooling:"+a.ID })
				_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
				var dup *DuplicateTaskError
				if !errors.As(err, &dup) || !dup.CoolingDown {
					t.Fatalf("enqueue while cooling: %v, want a cooling duplicate", err)
				}
				return
			}
			// asynq's archive keeps the key named in the task's record: it
			// is orphaned, and the key's next enqueue heals it.
			eventually(t, "the lock is released or orphaned", func() bool {
				s := lookupState(t, h, counterTask("k", 1, 1))
				return s == "" || c.result != asynq.RevokeTask && s == store.LockOrphaned+":"+a.ID
			})
			if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("enqueue after the end: %v", err)
			}
		})
	}
}

// 3. README (RunningDefer): a follow-up attached DURING a fast-path run
// (begin saw no follow-up) is queued when the run ends and runs last with
// the newest payload, never beside the run.
func TestFastPathQueuesAFollowUpAttachedDuringTheRun(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	t.Cleanup(tr.openAll)
	h.serve(tr.handler(), nil)
	a := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v %v, want a follow-up", res, err)
	}
	if r2, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil || r2.TaskID != res.TaskID {
		t.Fatalf("%+v %v, want folded into %s", r2, err, res.TaskID)
	}
	tr.open(1, 0)
	r := waitAttemptOf(tr.starts, 3, 10*time.Second)
	if r == nil || r.id != res.TaskID {
		t.Fatalf("the follow-up (seq 3, %s) never ran after %s: %+v", res.TaskID, a.ID, r)
	}
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Fatalf("overlaps: %v", o)
	}
	eventually(t, "no lock left", func() bool { return len(h.locks()) == 0 })
}

// 4. README (Lock API): an operator Release during a fast-path run frees
// the key; a new task takes it; the old run's end (done.lua) must not
// release the new holder's lock.
func TestFastPathRunReleasedMidwayLeavesTheNewHoldersLock(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	t.Cleanup(tr.openAll)
	h.serve(tr.handler(), nil)
	h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	b := h.enqueue(counterTask("k", 1, 2), asynq.ProcessIn(time.Hour))
	tr.open(1, 0)
	waitFor(t, tr.ends, "the old run ends")
	eventually(t, "the old run settled", func() bool { return h.d.Stats().Processed >= 1 })
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "waiting:"+b.ID {
		t.Fatalf("after the released run ended Lookup says %q, want waiting:%s", s, b.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue while %s waits: %v, want duplicate", b.ID, err)
	}
}

// 5. README (matrix): "a leftover handler of an old attempt … its renewals
// and release carry an old token and change nothing". Attempt 0 outlives
// its Timeout; asynq retries; attempt 1 (begin again) holds the lock; the
// leftover returns nil and must not release attempt 1's lock.
func TestFastPathLeftoverAttemptLeavesTheRetrysLock(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	tr.gate(1, 1)
	t.Cleanup(tr.openAll)
	h.serve(tr.handler(), nil)
	a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second))
	waitFor(t, tr.starts, "attempt 0")
	r := waitFor(t, tr.starts, "attempt 1 after the timeout")
	if r.id != a.ID || r.retry != 1 {
		t.Fatalf("ran %s retry %d, want %s retry 1", r.id, r.retry, a.ID)
	}
	tr.open(1, 0) // the leftover returns nil
	waitFor(t, tr.ends, "the leftover ends")
	eventually(t, "the leftover settled", func() bool { return h.d.Stats().Processed >= 1 })
	if s := lookupState(t, h, counterTask("k", 1, 1)); s != "running:"+a.ID {
		t.Fatalf("after the leftover returned Lookup says %q, want running:%s (attempt 1 runs)", s, a.ID)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue while attempt 1 runs: %v, want duplicate", err)
	}
	tr.open(1, 1)
}

// 6. README (MaxPending): entries "leave when their task starts" — also a
// task whose first attempt goes through the fast path decision.
func TestFastPathMaxPendingEntryLeavesAtStart(t *testing.T) {
	h := newHarness(t, counterRules(Rule{MaxPending: 1}))
	h.client = h.d.NewClient()
	tr := newAttemptTracker(nil)
	tr.gate(1, 0)
	t.Cleanup(tr.openAll)
	h.serve(tr.handler(), nil)
	h.enqueue(counterTask("a", 1, 1))
	waitFor(t, tr.starts, "a runs")
	if _, err := h.client.Enqueue(counterTask("b", 1, 2), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("a second key while the first runs: %v, want room (the first left the waiting set at start)", err)
	}
	tr.open(1, 0)
}

// 7. README (RunningAllow): "A retry that finds the key taken since runs
// beside a task that waits, and is retried behind one that runs"; (busy)
// "A task locked at enqueue is never dropped or folded"; Caveats: on its
// last attempt "the middleware schedules a copy of it … Code that tracks
// such a task by its ID sees it completed and the copy run". The retry is
// the task's last attempt (MaxRetry 1) and meets a running holder (a task
// of another type on a shared key, RunningReject): it must be retried and
// run once the holder is done, even where its type's OnBusy is BusyDrop.
func TestRunningAllowLastRetryBehindARunningHolderIsNotDropped(t *testing.T) {
	for _, maxRetry := range []int{1, 5} {
		t.Run(fmt.Sprintf("MaxRetry=%d", maxRetry), func(t *testing.T) {
			var mu sync.Mutex
			var heard []Decision
			cfg := Config{heartbeat: (time.Second) / 3, Rules: map[string]Rule{
				"counter":  {Key: "t8", Shared: true, OnRunning: RunningAllow, OnBusy: BusyDrop},
				"a8:other": {Key: "t8", Shared: true},
			}, OnDecision: func(d Decision) { mu.Lock(); heard = append(heard, d); mu.Unlock() }}
			h := newHarness(t, cfg)
			h.client = h.d.NewClient()
			ctx := context.Background()
			retryGate := make(chan struct{})
			tr := newAttemptTracker(func(r trackedAttempt) error {
				if r.seq == 1 && r.retry == 0 {
					return errors.New("first attempt fails")
				}
				return nil
			})
			tr.gate(2, 0)
			t.Cleanup(tr.openAll)
			var once sync.Once
			h.serve(tr.handler(), func(c *asynq.Config) {
				c.RetryDelayFunc = func(n int, err error, _ *asynq.Task) time.Duration {
					if IsFailure(err) {
						once.Do(func() { <-retryGate })
					}
					return 100 * time.Millisecond
				}
			})
			first := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(maxRetry))
			waitFor(t, tr.starts, "the first attempt")
			// The key is free while the first waits for its retry: a task of
			// another type takes it, and runs (held).
			second, err := h.client.Submit(ctx, asynq.NewTask("a8:other", []byte(`{"key":"k","seq":2}`)), asynq.Queue(h.queue))
			if err != nil || second.Outcome != Created {
				t.Fatalf("second: %+v %v", second, err)
			}
			if r := waitAttemptOf(tr.starts, 2, 10*time.Second); r == nil {
				t.Fatal("the second never ran")
			}
			close(retryGate)
			eventually(t, "the retry meets the running holder", func() bool { return h.d.Stats().Busy >= 1 })
			if maxRetry == 1 {
				// The last-attempt copy (due one Lease later) meets the
				// still-running holder too.
				eventually(t, "the copy meets the running holder", func() bool { return h.d.Stats().Busy >= 2 })
			}
			tr.open(2, 0)
			if r := waitAttemptOf(tr.starts, 1, 10*time.Second); r == nil {
				s := h.d.Stats()
				mu.Lock()
				defer mu.Unlock()
				t.Fatalf("the work of %s (seq 1, accepted at enqueue, RunningAllow) never ran again after it met the running holder %s: busy %d; decisions %+v",
					first.ID, second.TaskID, s.Busy, heard)
			}
			if o := tr.overlapsSeen(); len(o) > 0 {
				t.Fatalf("overlaps: %v", o)
			}
		})
	}
}
