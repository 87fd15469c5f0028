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
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Promises that hold under what asynq really does to an attempt, rather
// than what its handler returns (issue 11). Each runs on both enqueue
// paths: WrapClient and NewClient's direct path.

// bothPaths runs test once per enqueue path, on its own harness.
func bothPaths(t *testing.T, cfg Config, test func(t *testing.T, h *harness)) {
	t.Run("wrap", func(t *testing.T) { test(t, newHarness(t, cfg)) })
	t.Run("direct", func(t *testing.T) {
		h := newHarness(t, cfg)
		h.client = h.d.NewClient()
		test(t, h)
	})
}

func counterRules(r Rule) Config {
	r.Fields = []string{"key"}
	return Config{Rules: map[string]Rule{"counter": r}}
}

// retryInAnHour keeps asynq's retry out of the test's way.
func retryInAnHour(c *asynq.Config) {
	c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Hour }
}

// cancelUntil sends Inspector.CancelProcessing for task id until asynq has
// moved it to state: the server hears cancellations over Pub/Sub, and a
// message published before its subscription is set up is lost.
func (h *harness) cancelUntil(id, what string, state asynq.TaskState) {
	h.t.Helper()
	eventually(h.t, what, func() bool {
		if err := h.insp.CancelProcessing(id); err != nil {
			h.t.Fatal(err)
		}
		return h.taskState(id) == state
	})
}

// asynqDone waits until no task of the harness's queue is active: asynq has
// recorded every attempt's end (its done script, after the middleware
// returned, drops a plain task's lock; its archive keeps one for the key's
// next enqueue to heal).
func (h *harness) asynqDone() {
	h.t.Helper()
	eventually(h.t, "asynq records every attempt's end", func() bool {
		qi, err := h.insp.GetQueueInfo(h.queue)
		return err == nil && qi.Active == 0
	})
}

// settled waits until the middleware has settled n attempts (held, released or cooling).
func (h *harness) settled(n uint64) {
	h.t.Helper()
	eventually(h.t, "attempt settled", func() bool { s := h.d.Stats(); return s.Held+s.Released+s.Cooling+s.FailHeld >= n })
}

// heldAfterGiveUp runs a task whose handler ignores its context and
// returns nil once released; giveUp makes asynq give the attempt up and
// waits until asynq has moved the task on. Then the key must still be held
// by the task, which asynq will run again.
func heldAfterGiveUp(t *testing.T, tweak func(*asynq.Config), opt asynq.Option, giveUp func(t *testing.T, h *harness, srv *asynq.Server, id string)) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		release := make(chan struct{})
		rc := newRecorder(func(r run) error { <-release; return nil })
		srv := h.serve(rc.handler(), tweak)
		first := h.enqueue(counterTask("k", 1, 0), opt)
		waitFor(t, rc.runs, "run")
		giveUp(t, h, srv, first.ID)
		close(release) // the handler reports success after asynq gave up on it
		h.settled(1)
		if dup := h.duplicateOf(counterTask("k", 1, 1)); dup.Holder != first.ID {
			t.Fatalf("duplicate of %s, want %s, which asynq runs again", dup.Holder, first.ID)
		}
	})
}

func TestPromiseKeyHeldWhenHandlerSucceedsAfterTimeout(t *testing.T) {
	t.Parallel()
	heldAfterGiveUp(t, retryInAnHour, asynq.Timeout(time.Second), func(t *testing.T, h *harness, _ *asynq.Server, id string) {
		eventually(t, "asynq retries the timed-out task", func() bool { return h.taskState(id) == asynq.TaskStateRetry })
	})
}

func TestPromiseKeyHeldWhenHandlerSucceedsAfterCancelProcessing(t *testing.T) {
	heldAfterGiveUp(t, retryInAnHour, asynq.MaxRetry(3), func(t *testing.T, h *harness, _ *asynq.Server, id string) {
		h.cancelUntil(id, "asynq retries the cancelled task", asynq.TaskStateRetry)
	})
}

// On the task's last attempt: shutdown puts it back in the queue anyway.
func TestPromiseKeyHeldWhenHandlerOutlivesShutdown(t *testing.T) {
	t.Parallel()
	short := func(c *asynq.Config) { c.ShutdownTimeout = 200 * time.Millisecond }
	heldAfterGiveUp(t, short, asynq.MaxRetry(0), func(t *testing.T, h *harness, srv *asynq.Server, id string) {
		srv.Shutdown()
		if st := h.taskState(id); st != asynq.TaskStatePending {
			t.Fatalf("task state %v after shutdown, want pending (requeued)", st)
		}
	})
}

// A holder cancelled on its last attempt is archived by asynq; the
// follow-up it owed is queued at once, not parked for the holder's retry
// (nor left for a heartbeat to find: there is none within the test).
func TestPromiseFollowUpQueuedWhenHolderEndsForGood(t *testing.T) {
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.heartbeat = time.Hour
	bothPaths(t, cfg, func(t *testing.T, h *harness) {
		rc := newRecorder(func(r run) error {
			if decodeCounter(r.task).Seq == 0 {
				<-r.ctx.Done()
				return r.ctx.Err()
			}
			return nil
		})
		h.serve(rc.handler(), retryInAnHour)
		holder := h.enqueue(counterTask("k", 1, 0), asynq.MaxRetry(0))
		waitFor(t, rc.runs, "holder runs")
		res, err := h.client.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("%+v, %v, want a follow-up", res, err)
		}
		h.cancelUntil(holder.ID, "asynq archives the cancelled holder", asynq.TaskStateArchived)
		r := waitFor(t, rc.runs, "the follow-up, at once")
		if r.id != res.TaskID || decodeCounter(r.task).Seq != 2 {
			t.Fatalf("ran %s seq %d, want the follow-up %s with seq 2", r.id, decodeCounter(r.task).Seq, res.TaskID)
		}
		if st := h.taskState(holder.ID); st != asynq.TaskStateArchived {
			t.Fatalf("holder state %v, want archived", st)
		}
	})
}

// Input asynq's client would refuse, or asynq options deduplication cannot
// honour, given to the call or to NewTask, get ErrInvalidOption before any
// lock is taken or task stored.
func TestPromiseBadInputRefusedBeforeAnyLock(t *testing.T) {
	bothPaths(t, Config{}, func(t *testing.T, h *harness) {
		p := []byte(`{"user_id":1}`)
		cases := []struct {
			name string
			task *asynq.Task
			opts []asynq.Option
		}{
			{"empty type", asynq.NewTask("", p), nil},
			{"blank type", asynq.NewTask("  ", p), nil},
			{"blank queue", asynq.NewTask("user:reindex", p), []asynq.Option{asynq.Queue("")}},
			{"blank task ID", asynq.NewTask("user:reindex", p), []asynq.Option{asynq.TaskID(" ")}},
			{"blank queue in NewTask", asynq.NewTask("user:reindex", p, asynq.Queue(" ")), nil},
			{"blank task ID in NewTask", asynq.NewTask("user:reindex", p, asynq.TaskID(" ")), []asynq.Option{asynq.TaskID("ok")}},
			{"Unique in NewTask", asynq.NewTask("user:reindex", p, asynq.Unique(time.Minute)), nil},
			{"Group in NewTask", asynq.NewTask("user:reindex", p, asynq.Group("g")), nil},
			{"Unique", asynq.NewTask("user:reindex", p), []asynq.Option{asynq.Unique(time.Minute)}},
		}
		for _, c := range cases {
			_, err := h.client.Enqueue(c.task, append([]asynq.Option{asynq.Queue(h.queue)}, c.opts...)...)
			if !errors.Is(err, ErrInvalidOption) || errors.Is(err, ErrUnavailable) {
				t.Errorf("%s: err = %v, want ErrInvalidOption", c.name, err)
			}
		}
		if l := h.locks(); len(l) != 0 {
			t.Fatalf("locks left behind: %v", l)
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Fatalf("%d tasks stored", n)
		}
	})
}

// A follow-up carries its holder's options as asynq's client stored them,
// an absolute deadline without a timeout included.
func TestPromiseFollowUpKeepsHolderDeadline(t *testing.T) {
	bothPaths(t, counterRules(Rule{OnRunning: RunningDefer}), func(t *testing.T, h *harness) {
		release := make(chan struct{})
		defer close(release)
		rc := newRecorder(func(r run) error { <-release; return nil })
		h.serve(rc.handler(), nil)
		deadline := time.Now().Add(time.Hour).Truncate(time.Second)
		holder := h.enqueue(counterTask("k", 1, 0), asynq.Deadline(deadline), asynq.MaxRetry(4))
		waitFor(t, rc.runs, "holder runs")
		res, err := h.client.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("%+v, %v, want a follow-up", res, err)
		}
		hi, err := h.insp.GetTaskInfo(h.queue, holder.ID)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := h.insp.GetTaskInfo(h.queue, res.TaskID)
		if err != nil {
			t.Fatal(err)
		}
		if !fi.Deadline.Equal(deadline) || fi.Timeout != hi.Timeout || fi.MaxRetry != 4 || fi.Retried != 0 {
			t.Fatalf("follow-up deadline %v timeout %v max retry %d retried %d; holder %v %v %d",
				fi.Deadline, fi.Timeout, fi.MaxRetry, fi.Retried, hi.Deadline, hi.Timeout, hi.MaxRetry)
		}
	})
}

// Two types sharing a key never fold one's payload into the other's task:
// across types a fold is a duplicate naming the holder, waiting (Replace,
// Merge) or running (Defer).
func TestPromisePayloadOnlyLandsInItsOwnType(t *testing.T) {
	shared := Rule{Key: "tenant-7", Shared: true, OnConflict: Replace, OnRunning: RunningDefer}
	merged := shared
	merged.OnConflict, merged.MergeFunc = Merge, addMerge
	for name, r := range map[string]Rule{"replace": shared, "merge": merged} {
		t.Run(name, func(t *testing.T) {
			cfg := Config{Rules: map[string]Rule{"email:send": r, "invoice:build": r}}
			bothPaths(t, cfg, func(t *testing.T, h *harness) {
				email := h.enqueue(asynq.NewTask("email:send", []byte(`{"email":1}`)))
				for i := range 3 { // the second and third go through this process's hint
					_, err := h.client.Enqueue(asynq.NewTask("invoice:build", []byte(`{"invoice":42}`)), asynq.Queue(h.queue))
					var dup *DuplicateTaskError
					if !errors.As(err, &dup) || dup.Holder != email.ID {
						t.Fatalf("enqueue %d of another type: %v, want a duplicate of %s", i, err, email.ID)
					}
				}
				if p := h.payloadOf(email.ID); p != `{"email":1}` {
					t.Fatalf("email task carries %s", p)
				}
				// Running: no follow-up of the other type either.
				release := make(chan struct{})
				defer close(release)
				rc := newRecorder(func(r run) error { <-release; return nil })
				h.serve(rc.handler(), nil)
				waitFor(t, rc.runs, "email runs")
				_, err := h.client.Enqueue(asynq.NewTask("invoice:build", []byte(`{"invoice":43}`)), asynq.Queue(h.queue))
				var dup *DuplicateTaskError
				if !errors.As(err, &dup) || dup.Holder != email.ID {
					t.Fatalf("enqueue behind the running email: %v, want a duplicate of %s", err, email.ID)
				}
				if n := h.queueSize(h.queue); n != 1 {
					t.Fatalf("%d tasks stored, want the email alone", n)
				}
			})
		})
	}
}

// A task that arrives without a lock (another service, the Scheduler) and
// meets a busy key on its last attempt is not archived for it: a copy runs
// once the key is free.
func TestPromiseBusyArrivalOnLastAttemptNotArchived(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{heartbeat: (2 * time.Second) / 3, Rules: counterRules(Rule{}).Rules})
	release := make(chan struct{})
	rc := newRecorder(func(r run) error {
		if decodeCounter(r.task).Seq == 0 {
			<-release
		}
		return nil
	})
	h.serve(rc.handler(), nil)
	holder := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, rc.runs, "holder runs")
	// Enqueued around the wrapper, with no retries to spare.
	arrival, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the arrival met the busy key", func() bool { return h.d.Stats().Busy >= 1 })
	close(release)
	r := waitFor(t, rc.runs, "the arrival's work")
	if decodeCounter(r.task).Seq != 1 || r.id == holder.ID {
		t.Fatalf("ran %s seq %d, want the arrival's copy with seq 1", r.id, decodeCounter(r.task).Seq)
	}
	archived, err := h.insp.ListArchivedTasks(h.queue)
	if err != nil {
		t.Fatal(err)
	}
	if len(archived) != 0 {
		t.Fatalf("archived: %s (%s)", archived[0].ID, archived[0].LastErr)
	}
	if st := h.taskState(arrival.ID); st != 0 && st != asynq.TaskStateCompleted {
		t.Fatalf("the arrival itself is %v, want done", st)
	}
}

// An enqueue on the direct path whose lock call (carrying the task) timed
// out in a stalled Redis never answers "failed" for a task the late script
// stored: it says the outcome is unknown, fail-open included (enqueueing it
// again could store it twice).
func TestPromiseAnswerTellsWhatIsStoredWhenRedisStalls(t *testing.T) {
	t.Parallel()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("failOpen=%v", failOpen), func(t *testing.T) {
			proxy, d, h := hungDedup(t, Config{FailOpen: failOpen, BreakerThreshold: -1}, func(o *redis.Options) { o.MaxRetries = -1 })
			t.Cleanup(func() { _ = d.Close() })
			c := d.NewClient()
			if _, err := c.Enqueue(userTask(0, ""), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err) // warm: the queue is registered, scripts loaded
			}
			proxy.stall()
			res, err := c.Submit(context.Background(), userTask(1, ""), asynq.Queue(h.queue))
			proxy.resume() // the stalled script now runs
			if err == nil {
				t.Fatalf("stalled enqueue succeeded: %+v", res)
			}
			if !errors.Is(err, ErrOutcomeUnknown) || !errors.Is(err, ErrUnavailable) {
				t.Fatalf("err = %v, want ErrOutcomeUnknown (and ErrUnavailable)", err)
			}
			eventually(t, "the late script stored the task", func() bool { return h.queueSize(h.queue) == 2 })
			// The key is held by that one task: nothing else was stored.
			if _, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
				t.Fatalf("enqueue after the stall: %v, want a duplicate of the stored task", err)
			}
			if n := h.queueSize(h.queue); n != 2 {
				t.Fatalf("%d tasks, want 2", n)
			}
		})
	}
}

// WrapClient over an asynq client on another Redis: the lock's owner checks
// would find no task there and heal live locks after HealGrace. The first
// accepted enqueue finds out and every later deduplicated call is refused,
// so no duplicate is ever admitted; a server whose tasks are elsewhere
// refuses to run its deduplicated tasks under the middleware.
func TestPromiseTasksInAnotherRedisNeverAdmitDuplicates(t *testing.T) {
	needRealRedis(t)
	h := newHarness(t, Config{})
	_, other := ownRedis(t, nil)
	elsewhere := asynq.NewClientFromRedisClient(other)
	c := h.d.WrapClient(elsewhere)
	first, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue))
	if err != nil {
		t.Fatalf("first enqueue (stored elsewhere, still locked): %v", err)
	}
	h.ageLock(h.keyOf(userTask(1, ""), h.queue)) // past HealGrace: an owner check would now heal the lock
	for _, task := range []*asynq.Task{userTask(1, ""), userTask(2, "")} {
		if _, err := c.Enqueue(task, asynq.Queue(h.queue)); !errors.Is(err, ErrTasksElsewhere) {
			t.Fatalf("err = %v, want ErrTasksElsewhere", err)
		}
	}
	if _, err := c.Enqueue(userTask(3, ""), asynq.Queue(h.queue), Skip()); err != nil {
		t.Fatalf("a call without deduplication still passes: %v", err)
	}
	if n, _ := other.LLen(context.Background(), "asynq:{"+h.queue+"}:pending").Result(); n != 2 {
		t.Fatalf("%d tasks stored elsewhere, want 2 (the first and the opted-out one)", n)
	}
	if l := h.locks(); len(l) != 1 {
		t.Fatalf("locks %v, want the first task's only", l)
	}
	if owner := h.lockOwner(h.keyOf(userTask(1, ""), h.queue)); owner != first.ID {
		t.Fatalf("lock owned by %q, want %s", owner, first.ID)
	}
	// The same Dedup's own clients, on its Redis, are not affected.
	if _, err := h.client.Enqueue(userTask(4, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("a client on the Dedup's Redis: %v", err)
	}

	// A server on the other Redis under this Dedup's middleware.
	errs := make(chan error, 10)
	ran := make(chan string, 10)
	srv := asynq.NewServerFromRedisClient(other, asynq.Config{
		Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour },
		ErrorHandler:   asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { errs <- err }),
	})
	if err := srv.Start(h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	if err := waitFor(t, errs, "task refused"); !errors.Is(err, ErrTasksElsewhere) {
		t.Fatalf("server's task: err = %v, want ErrTasksElsewhere", err)
	}
	// The opted-out task runs, as it would without deduplication; the
	// deduplicated one never does.
	if id := waitFor(t, ran, "the opted-out task runs"); id == first.ID {
		t.Fatal("a deduplicated task ran under a middleware whose Redis does not hold its task")
	}
	select {
	case id := <-ran:
		t.Fatalf("%s ran too; only the opted-out task may", id)
	default:
	}
}

// A lock written in the same script as its task (NewClient's direct path)
// has no gap between lock and task to wait out: once asynq's record says
// the owner is gone, completed or archived, the next enqueue of the key is
// accepted at once, HealGrace (a minute) notwithstanding. A lock taken
// before its task was enqueued (WrapClient) still waits out the grace.
func TestPromiseDirectLockFreeOnceItsTaskIsGone(t *testing.T) {
	ends := []struct {
		name string
		end  func(t *testing.T, h *harness, id string)
	}{
		{"deleted", func(t *testing.T, h *harness, id string) {
			if err := h.insp.DeleteTask(h.queue, id); err != nil {
				t.Fatal(err)
			}
		}},
		{"archived", func(t *testing.T, h *harness, id string) {
			if err := h.insp.ArchiveTask(h.queue, id); err != nil {
				t.Fatal(err)
			}
		}},
		{"completed by a server without the middleware", func(t *testing.T, h *harness, id string) {
			srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{Queues: map[string]int{h.queue: 1},
				TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel})
			if err := srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })); err != nil {
				t.Fatal(err)
			}
			defer srv.Shutdown()
			eventually(t, "task completed", func() bool { return h.taskState(id) == asynq.TaskStateCompleted })
		}},
	}
	for _, e := range ends {
		t.Run(e.name, func(t *testing.T) {
			h := newHarness(t, Config{})
			h.client = h.d.NewClient()
			first := h.enqueue(userTask(1, ""), asynq.Retention(time.Hour))
			e.end(t, h, first.ID)
			second, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue))
			if err != nil {
				t.Fatalf("next enqueue after the owner %s: %v, want a new task at once", e.name, err)
			}
			if owner := h.lockOwner(h.keyOf(userTask(1, ""), h.queue)); owner != second.ID {
				t.Fatalf("lock owned by %q, want the new task %s", owner, second.ID)
			}
		})
	}
	t.Run("WrapClient waits out the grace", func(t *testing.T) {
		h := newHarness(t, Config{})
		first := h.enqueue(userTask(1, ""))
		if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
			t.Fatal(err)
		}
		if dup := h.duplicateOf(userTask(1, "")); dup.Holder != first.ID {
			t.Fatalf("duplicate of %s, want %s (a lock younger than HealGrace)", dup.Holder, first.ID)
		}
	})
	t.Run("a task arriving without a lock takes it at once", func(t *testing.T) {
		h := newHarness(t, Config{})
		h.client = h.d.NewClient()
		first := h.enqueue(userTask(1, ""))
		if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
			t.Fatal(err)
		}
		rc := newRecorder(nil)
		h.serve(rc.handler(), nil)
		if _, err := h.asynq.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, rc.runs, "the unlocked arrival runs, its holder gone")
	})
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

// A direct-path lock call that carried its task and timed out never
// reports failed for a stored task, and never stores it twice. Here the
// call's bytes are slow on their connection, so the Inspector's "is it
// stored now?", on another connection, overtakes them and finds nothing;
// then the late script runs. The answer must be ErrOutcomeUnknown (the call
// was sent and never answered), and with fail-open the task is stored once,
// once in asynq's pending list, and never runs twice at once. (Once,
// fail-closed answered a plain ErrUnavailable for a task stored anyway, and
// fail-open enqueued the task again through asynq, after which the late
// script stored the same ID a second time in the pending list.)
func TestPromiseLateScriptOfATimedOutCallStoresTheTaskOnce(t *testing.T) {
	t.Parallel()
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
