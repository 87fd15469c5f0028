package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Adversarial tests of the promises of commit 691eebc (issue 11).

// Promise 3: asynq's client refuses asynq.TaskID("") ("task ID cannot be
// empty"). The wrapper treats an empty caller ID as "no caller ID" (call.go
// chooseQueue only refuses a non-empty blank ID).
//
// Expected: ErrInvalidOption, nothing locked, nothing stored, on both paths.
// Observed: on the direct path (NewClient) the task is stored under a dd- ID
// and returned as created, where asynq's client would have refused it; on
// the wrap path the lock is taken, asynq refuses, the lock is rolled back,
// and the error is not ErrInvalidOption.
func TestAdversaryEmptyTaskIDOption(t *testing.T) {
	bothPaths(t, Config{}, func(t *testing.T, h *harness) {
		if _, err := h.asynq.Enqueue(userTask(9, ""), asynq.Queue(h.queue), asynq.TaskID("")); err == nil {
			t.Fatal("asynq's own client accepts TaskID(\"\")?")
		}
		for i, opts := range [][]asynq.Option{
			{asynq.TaskID("")},
			{asynq.TaskID("mine"), asynq.TaskID("")}, // the last one wins in asynq too, and is refused
		} {
			info, err := h.client.Enqueue(userTask(i+1, ""), append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
			if !errors.Is(err, ErrInvalidOption) {
				id := ""
				if info != nil {
					id = info.ID
				}
				t.Errorf("case %d: TaskID(\"\"): err = %v (task %q), want ErrInvalidOption as asynq refuses it", i, err, id)
			}
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Errorf("%d tasks stored for calls asynq's client refuses", n)
		}
	})
}

// Promise 3 / "no panic": asynq.NewTask keeps a nil option, and asynq's
// client ignores it (composeOptions' type switch has no case for nil). The
// wrapper skips nil options given to the call, but checkTask (call.go) calls
// o.Value() on every option of NewTask.
//
// Expected: the same answer as asynq's client (enqueued), or an error.
// Observed: a nil-pointer panic in checkTask.
func TestAdversaryNilOptionInNewTask(t *testing.T) {
	bothPaths(t, Config{}, func(t *testing.T, h *harness) {
		var nilOpt asynq.Option
		if _, err := h.asynq.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":7}`), nilOpt), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("asynq's client: %v", err)
		}
		var (
			err      error
			panicked any
		)
		func() {
			defer func() { panicked = recover() }()
			_, err = h.client.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":8}`), nilOpt), asynq.Queue(h.queue))
		}()
		if panicked != nil {
			t.Fatalf("Enqueue of a task with a nil NewTask option panicked: %v", panicked)
		}
		if err != nil {
			t.Logf("refused: %v", err)
		}
	})
}

// A handler that returns nil a hair before its Timeout: asynq's select
// (processor.exec) may then find its context done before the handler's
// result and retry the task. A lock the middleware released at that
// success would leave a task waiting for its retry with its key free.
//
// Expected: every task asynq retries still holds its key, and every task it
// completed frees it (the key's next enqueue heals a lock whose holder asynq
// has completed). A control task, far from its deadline, is released at its
// end.
func TestAdversaryHandlerReturnsAtDeadline(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (600 * time.Millisecond) / 3, Rules: counterRules(Rule{}).Rules})
	const n = 30
	rc := newRecorder(func(r run) error {
		dl, _ := r.ctx.Deadline()
		seq := decodeCounter(r.task).Seq
		if seq >= 1000 { // control: returns nil well before the deadline
			return nil
		}
		// Return nil between 0 and ~3 ms before the deadline.
		time.Sleep(time.Until(dl) - time.Duration(seq)*100*time.Microsecond)
		return nil
	})
	h.serve(rc.handler(), func(c *asynq.Config) {
		c.Concurrency = n
		retryInAnHour(c)
	})
	ids := make([]string, n)
	for i := range n {
		ids[i] = h.enqueue(counterTask(fmt.Sprint("k", i), 1, i), asynq.Timeout(time.Second), asynq.Retention(time.Hour)).ID
	}
	ctl := h.enqueue(counterTask("control", 1, 1000), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
	for range n + 1 {
		waitFor(t, rc.runs, "run")
	}
	h.settled(n + 1)
	eventually(t, "the control task completes", func() bool { return h.taskState(ctl.ID) == asynq.TaskStateCompleted })
	eventually(t, "the control task's key is free", func() bool {
		return h.lockOwner(h.keyOf(counterTask("control", 1, 1000), h.queue)) == ""
	})
	eventually(t, "asynq moved every task on", func() bool {
		for _, id := range ids {
			if st := h.taskState(id); st != asynq.TaskStateRetry && st != asynq.TaskStateCompleted {
				return false
			}
		}
		return true
	})
	eventually(t, "completed tasks free their keys", func() bool {
		for i, id := range ids {
			key := h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
			if h.taskState(id) == asynq.TaskStateCompleted && h.lockOwner(key) == id && h.lockState(key) != store.LockOrphaned {
				return false
			}
		}
		return true
	})
	var retried, lost, stuck int
	for i, id := range ids {
		key := h.keyOf(counterTask(fmt.Sprint("k", i), 1, i), h.queue)
		owner := h.lockOwner(key)
		switch h.taskState(id) {
		case asynq.TaskStateRetry:
			retried++
			if owner != id {
				lost++
				info, err := h.client.Enqueue(counterTask(fmt.Sprint("k", i), 1, 100+i), asynq.Queue(h.queue))
				t.Errorf("task %s (returned nil %dµs before its deadline) waits for asynq's retry, but its lock owner is %q; a new enqueue of its key: %v %v",
					id, i*100, owner, info != nil, err)
			}
		case asynq.TaskStateCompleted:
			if owner == id && h.lockState(key) != store.LockOrphaned {
				stuck++
				t.Errorf("task %s (returned nil %dµs before its deadline) completed, but still holds its key", id, i*100)
			}
		}
	}
	t.Logf("%d of %d tasks retried by asynq; %d of them lost their lock; %d completed tasks still hold theirs", retried, n, lost, stuck)
}

// Promise 6: asynq's client decides "scheduled or pending" once; the direct
// path decides it in prepareDirect (stores a scheduled task, DueAt) and
// again in storedInfo after the round trip (k.scheduled() compares with a
// later time.Now()). A ProcessIn shorter than the round trip is stored as
// scheduled and returned as pending.
//
// Expected: the returned TaskInfo's State equals what is stored (and what
// asynq's client returns: scheduled). Observed: for ProcessIn of ~150-250µs
// the task is stored scheduled (with the direct path's single command) but
// the TaskInfo returned says pending, NextProcessAt now.
func TestAdversaryDirectTinyProcessIn(t *testing.T) {
	h := newHarness(t, Config{})
	c := h.d.NewClient()
	bad := 0
	for i := range 40 {
		d := time.Duration(100+i*50) * time.Microsecond
		info, err := c.Enqueue(userTask(i, ""), asynq.Queue(h.queue), asynq.ProcessIn(d))
		if err != nil {
			t.Fatal(err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		// A scheduled task may become pending by itself only through asynq's
		// forwarder; no server runs here.
		if ti.State != info.State {
			bad++
			if bad <= 3 {
				t.Errorf("ProcessIn(%v): returned state %v, stored state %v", d, info.State, ti.State)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of 40 direct enqueues returned a state other than the one stored", bad)
	}
}

// oneDelayProxy forwards TCP to Redis; armed with a marker, it holds back
// the first client chunk containing it for a while (one slow connection),
// while other connections pass at once.
type oneDelayProxy struct {
	l      net.Listener
	target string
	mu     sync.Mutex
	marker []byte
	delay  time.Duration
	hit    chan struct{}
}

func newOneDelayProxy(t *testing.T, target string) *oneDelayProxy {
	p := &oneDelayProxy{target: target}
	p.l = serveProxy(t, target, func(c, up net.Conn) {
		go func() { _, _ = io.Copy(c, up); c.Close() }()
		var hit chan struct{}
		copyChunks(up, c, func(b []byte) {
			p.mu.Lock()
			hold := p.marker != nil && bytes.Contains(b, p.marker)
			d := p.delay
			if hold {
				p.marker, hit = nil, p.hit
			}
			p.mu.Unlock()
			if hold {
				time.Sleep(d) // the delay under test: this call's bytes arrive late
			}
		}, func() {
			if hit != nil {
				close(hit)
				hit = nil
			}
		})
	})
	return p
}

func (p *oneDelayProxy) arm(marker string, d time.Duration) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.marker, p.delay, p.hit = []byte(marker), d, make(chan struct{})
	return p.hit
}

// Promise 7: a direct-path lock call that carried the task and timed out
// "never reports failed for a stored task". After the timeout, landed()
// asks the Inspector whether the task is stored *now*; but the lock call is
// still in flight (here: its bytes are slow on their connection, the
// Inspector's query on another connection overtakes them). The Inspector
// says "not found", so the call answers a plain ErrUnavailable (fail-closed)
// or enqueues the task again through asynq (fail-open); then the late
// script runs and stores the task (again).
//
// Expected: ErrOutcomeUnknown (the call was sent and never answered), and
// with fail-open one stored task, once in asynq's pending list.
// Observed: fail-closed answers a plain "redis unavailable: acquire: context
// deadline exceeded" and the task is stored anyway. Fail-open answers
// created (asynq's enqueue stored dd-...), then the late acquire script
// finds the key free, takes it and stores the same task again with a second
// LPUSH (acquire.lua take() only checks EXISTS for a caller-chosen ID): the
// ID is twice in asynq's pending list and the server runs it twice at once.
func TestAdversaryLateScriptAfterNotFound(t *testing.T) {
	needRealRedis(t)
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("failOpen=%v", failOpen), func(t *testing.T) {
			proxy := newOneDelayProxy(t, redistest.Addr())
			lrdb := redis.NewClient(&redis.Options{Addr: proxy.l.Addr().String(), PoolSize: 8, MaxRetries: -1})
			t.Cleanup(func() { _ = lrdb.Close() })
			h := newHarness(t, Config{})
			d, err := New(context.Background(), lrdb, Config{Prefix: h.prefix, LockTimeout: 100 * time.Millisecond,
				FailOpen: failOpen, BreakerThreshold: -1, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Close() })
			c := d.NewClient()
			if _, err := c.Enqueue(userTask(0, ""), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err) // warm: queue registered, scripts loaded
			}
			hit := proxy.arm("late-marker", 400*time.Millisecond)
			res, err := c.Submit(context.Background(), userTask(1, "late-marker"), asynq.Queue(h.queue))
			t.Logf("answer: %+v, err %v", res, err)
			<-hit
			time.Sleep(50 * time.Millisecond)
			stored := h.queueSize(h.queue) - 1
			pend := h.rdb.LRange(context.Background(), "asynq:{"+h.queue+"}:pending", 0, -1).Val()
			t.Logf("tasks stored for the call: %d; pending list %v", stored, pend)
			seen := map[string]int{}
			for _, id := range pend {
				seen[id]++
				if seen[id] > 1 {
					t.Errorf("task %s is twice in asynq's pending list: it will be run twice", id)
				}
			}
			if failOpen {
				// Run the queue: the doubled entry runs the same task twice, at once.
				var mu sync.Mutex
				active, overlap := map[string]int{}, 0
				runs := make(chan string, 10)
				h.serve(func(ctx context.Context, tk *asynq.Task) error {
					id, _ := asynq.GetTaskID(ctx)
					mu.Lock()
					active[id]++
					if active[id] > 1 {
						overlap++
					}
					mu.Unlock()
					runs <- id
					time.Sleep(300 * time.Millisecond)
					mu.Lock()
					active[id]--
					mu.Unlock()
					return nil
				}, nil)
				for range len(pend) {
					waitFor(t, runs, "run")
				}
				time.Sleep(400 * time.Millisecond)
				mu.Lock()
				if overlap > 0 {
					t.Errorf("the task ran twice at the same time (%d overlapping runs of one ID, one key)", overlap)
				}
				mu.Unlock()
			}
			switch {
			case err != nil && stored > 0 && !errors.Is(err, ErrOutcomeUnknown):
				t.Errorf("answered %v (not ErrOutcomeUnknown), but the task was stored", err)
			case err == nil && res.Outcome == Created && stored == 0:
				t.Errorf("answered created, nothing stored")
			}
		})
	}
}
