package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Where two modes, or a mode and an operator, meet. Each test drives a real
// asynq server (or asynq's Inspector) into the seam and checks the promise
// it names against asynq's record.

// seqOf reads the "seq" field of a profileSync or digest payload.
func seqOf(t *testing.T, task *asynq.Task) int {
	t.Helper()
	var p struct{ Seq int }
	if err := json.Unmarshal(task.Payload(), &p); err != nil {
		t.Fatalf("payload: %v", err)
	}
	return p.Seq
}

// drained waits until the harness queue holds no task (pending, active,
// scheduled, retry or archived), then reports whether the recorder saw
// another run.
func (h *harness) drained(rc *recorder) (extra *run) {
	h.t.Helper()
	eventually(h.t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	select {
	case r := <-rc.runs:
		return &r
	default:
		return nil
	}
}

// holdRun returns a recorder whose handler, for a counter task of sequence
// seq, waits until release is closed (or sent to) and then returns then;
// other tasks succeed at once.
func holdRun(seq int, then error) (*recorder, chan struct{}) {
	release := make(chan struct{})
	return newRecorder(func(r run) error {
		if decodeCounter(r.task).Seq == seq {
			<-release
			return then
		}
		return nil
	}), release
}

// A task that arrives without a lock (here asynq's own client) at a key
// whose debounced task waits is folded into it (BusyFold): the key runs
// once, with the newest payload.
func TestBusyFoldFoldsIntoADebouncedHolder(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	rule := Rule{Fields: []string{"user_id"}, OnConflict: Replace, Debounce: 2 * time.Second, OnBusy: BusyFold}
	bothPaths(t, Config{Rules: map[string]Rule{"sync:profile": rule}}, func(t *testing.T, h *harness) {
		rc := newRecorder(nil)
		h.serve(rc.handler(), nil)
		holder := h.enqueue(profileSync("sync:profile", 1, 1))
		if _, err := h.asynq.Enqueue(profileSync("sync:profile", 1, 2), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
		r := waitFor(t, rc.runs, "the key runs")
		if r.id != holder.ID || seqOf(t, r.task) != 2 {
			t.Fatalf("ran %s with seq %d, want the debounced holder %s with the arrival's seq 2", r.id, seqOf(t, r.task), holder.ID)
		}
		if extra := h.drained(rc); extra != nil {
			t.Fatalf("the key ran again: %s with seq %d", extra.id, seqOf(t, extra.task))
		}
	})
}

// The same with a Cooldown type: the arrival's payload is folded into the
// waiting holder, so the window's one run carries it.
func TestBusyFoldFoldsIntoAWaitingCooldownHolder(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	rule := Rule{Fields: []string{"user_id"}, OnConflict: Replace, Cooldown: time.Minute, OnBusy: BusyFold}
	bothPaths(t, Config{Rules: map[string]Rule{"digest:weekly": rule}}, func(t *testing.T, h *harness) {
		rc := newRecorder(nil)
		h.serve(rc.handler(), nil)
		holder := h.enqueue(digest(1, 1), asynq.ProcessIn(2*time.Second))
		if _, err := h.asynq.Enqueue(digest(1, 2), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
		r := waitFor(t, rc.runs, "the key runs")
		if r.id != holder.ID || seqOf(t, r.task) != 2 {
			t.Fatalf("ran %s with seq %d, want the holder %s with the arrival's seq 2", r.id, seqOf(t, r.task), holder.ID)
		}
		if extra := h.drained(rc); extra != nil {
			t.Fatalf("the key ran again: %s with seq %d", extra.id, seqOf(t, extra.task))
		}
		coolingDup(t, h.client, digest(1, 3), h.queue, holder.ID)
	})
}

// An operator deletes or archives the follow-up parked behind a running
// task: the next update during the run makes a new follow-up instead of
// being refused, and the newest payload runs after the run.
func TestDeletedFollowUpIsReplacedByANewOne(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"delete", "archive"} {
		t.Run(op, func(t *testing.T) {
			bothPaths(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}), func(t *testing.T, h *harness) {
				rc, release := holdRun(0, nil)
				h.serve(rc.handler(), nil)
				first := h.enqueue(counterTask("k", 1, 0))
				waitFor(t, rc.runs, "the first run")
				ctx := context.Background()
				res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
				if err != nil || res.Outcome != Deferred {
					t.Fatalf("update while running: %+v %v, want Deferred", res, err)
				}
				if op == "delete" {
					err = h.insp.DeleteTask(h.queue, res.TaskID)
				} else {
					err = h.insp.ArchiveTask(h.queue, res.TaskID)
					defer func() { _ = h.insp.DeleteTask(h.queue, res.TaskID) }()
				}
				if err != nil {
					t.Fatal(err)
				}
				again, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
				if err != nil || again.Outcome != Deferred || again.TaskID == res.TaskID {
					t.Fatalf("update after the follow-up was %sd: %+v %v, want a new follow-up (Deferred)", op, again, err)
				}
				close(release)
				r := waitFor(t, rc.runs, "the follow-up runs")
				if r.id != again.TaskID || decodeCounter(r.task).Seq != 2 {
					t.Fatalf("ran %s seq %d, want the new follow-up %s with seq 2", r.id, decodeCounter(r.task).Seq, again.TaskID)
				}
				_ = first
			})
		})
	}
}

// A call with the caller-chosen TaskID of the task holding its key folds
// into it like any other call of the key (Replace, Merge), and defers
// behind it while it runs (RunningDefer).
func TestSameCallerIDFoldsLikeAnyCall(t *testing.T) {
	union := func(old, new []byte) ([]byte, error) {
		var a, b counterPayload
		_ = json.Unmarshal(old, &a)
		_ = json.Unmarshal(new, &b)
		a.N += b.N
		a.Seq = max(a.Seq, b.Seq)
		return json.Marshal(a)
	}
	for _, tc := range []struct {
		name string
		rule Rule
		want Outcome
		n    int
	}{
		{"replace", Rule{OnConflict: Replace}, Replaced, 2},
		{"merge", Rule{OnConflict: Merge, MergeFunc: union}, Merged, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bothPaths(t, counterRules(tc.rule), func(t *testing.T, h *harness) {
				id := "counter-" + uniq(t)
				first := h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
				res, err := h.client.Submit(context.Background(), counterTask("k", 2, 2), asynq.Queue(h.queue), asynq.TaskID(id))
				if err != nil || res.Outcome != tc.want || res.TaskID != first.ID {
					t.Fatalf("second call with the holder's ID: %+v %v, want %v into %s", res, err, tc.want, first.ID)
				}
				var p counterPayload
				_ = json.Unmarshal([]byte(h.payloadOf(id)), &p)
				if p.N != tc.n || p.Seq != 2 {
					t.Fatalf("stored payload %+v, want n %d seq 2", p, tc.n)
				}
			})
		})
	}
	t.Run("defer", func(t *testing.T) {
		bothPaths(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}), func(t *testing.T, h *harness) {
			rc, release := holdRun(1, nil)
			h.serve(rc.handler(), nil)
			id := "counter-" + uniq(t)
			h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
			waitFor(t, rc.runs, "the holder runs")
			res, err := h.client.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("call with the running holder's ID: %+v %v, want Deferred", res, err)
			}
			close(release)
			if r := waitFor(t, rc.runs, "the follow-up runs"); r.id != res.TaskID || decodeCounter(r.task).Seq != 2 {
				t.Fatalf("ran %s seq %d, want the follow-up %s seq 2", r.id, decodeCounter(r.task).Seq, res.TaskID)
			}
		})
	})
	t.Run("reject", func(t *testing.T) {
		bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
			id := "counter-" + uniq(t)
			h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
			_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id))
			var dup *DuplicateTaskError
			if !errors.As(err, &dup) || dup.Holder != id || !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Fatalf("second call with the holder's ID: %v, want a DuplicateTaskError naming %s that also matches asynq.ErrTaskIDConflict", err, id)
			}
		})
	})
}

// Enqueuing a task again under its caller-chosen ID (an idempotent retry)
// leaves its lock as it was: once the operator archives or deletes the
// task, the key is free at once, as without the retry.
func TestIdempotentReEnqueueKeepsTheLockHealable(t *testing.T) {
	for _, op := range []string{"archive", "delete"} {
		t.Run(op, func(t *testing.T) {
			bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
				h.client = h.d.NewClient() // the key heals at once only for a lock written with its task
				id := "mail-" + uniq(t)
				first := h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
				again, err := h.client.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id))
				if err != nil || again.ID != first.ID {
					t.Fatalf("idempotent re-enqueue: %v %v, want the task %s", again, err, first.ID)
				}
				if op == "archive" {
					err = h.insp.ArchiveTask(h.queue, id)
				} else {
					err = h.insp.DeleteTask(h.queue, id)
				}
				if err != nil {
					t.Fatal(err)
				}
				next, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
				if err != nil || next.ID == id {
					t.Fatalf("new task of the key after the holder was %sd: %v %v, want it created", op, next, err)
				}
			})
		})
	}
}

// A caller-chosen task ID can be used again once no task with that ID
// exists, as asynq's own client allows; an ID whose task still lives stays
// refused.
func TestCallerIDUsableOnceItsTaskIsGone(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		// Opted out, then its task gone.
		id := "x-" + uniq(t)
		if _, err := h.client.Enqueue(counterTask("a", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id), Skip()); err != nil {
			t.Fatal(err)
		}
		if err := h.insp.DeleteTask(h.queue, id); err != nil {
			t.Fatal(err)
		}
		if _, err := h.client.Enqueue(counterTask("a", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id)); err != nil {
			t.Fatalf("ID of a deleted opted-out task, deduplicated now: %v", err)
		}
		// A scheduled task deleted, its ID reused for another key.
		id2 := "y-" + uniq(t)
		if _, err := h.client.Enqueue(counterTask("b", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id2), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if err := h.insp.DeleteTask(h.queue, id2); err != nil {
			t.Fatal(err)
		}
		if _, err := h.client.Enqueue(counterTask("c", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id2)); err != nil {
			t.Fatalf("ID of a deleted scheduled task, for another key: %v", err)
		}
		// The old key's lock named the ID, which another key's task has now:
		// it went with the stale index, so the old key is free.
		if _, err := h.client.Enqueue(counterTask("b", 1, 2), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("the old key of a reused ID: %v, want it free", err)
		}
		// Still live under another key: refused.
		if _, err := h.client.Submit(ctx, counterTask("d", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id2)); !errors.Is(err, asynq.ErrTaskIDConflict) {
			t.Fatalf("ID of a live task, for another key: %v, want asynq.ErrTaskIDConflict", err)
		}
	})
}

// "Forever" durations never wrap: the lock lasts at least as long as asked.
func TestForeverDurationsNeverWrap(t *testing.T) {
	t.Run("per-call TTL with ProcessIn", func(t *testing.T) {
		h := newHarness(t, counterRules(Rule{}))
		info := h.enqueue(counterTask("k", 1, 1), TTL(math.MaxInt64), asynq.ProcessIn(time.Hour))
		if ttl := pttl(t, h.rdb, h.keyOf(counterTask("k", 1, 1), h.queue)); ttl < time.Hour {
			t.Fatalf("lock TTL %v, want at least an hour", ttl)
		}
		if dup := h.duplicateOf(counterTask("k", 1, 2)); dup.Holder != info.ID {
			t.Fatalf("duplicate of %s, want %s", dup.Holder, info.ID)
		}
	})
	t.Run("Config.TTL across a retry", func(t *testing.T) {
		h := newHarness(t, Config{TTL: math.MaxInt64 - 1, Rules: counterRules(Rule{}).Rules})
		rc := newRecorder(func(run) error { return errors.New("try again") })
		h.serve(rc.handler(), retryInAnHour)
		first := h.enqueue(counterTask("k", 1, 1))
		waitFor(t, rc.runs, "the first attempt")
		h.settled(1)
		if dup := h.duplicateOf(counterTask("k", 1, 2)); dup.Holder != first.ID {
			t.Fatalf("duplicate of %s, want %s, which waits for its retry", dup.Holder, first.ID)
		}
	})
	t.Run("options and config", func(t *testing.T) {
		h := newHarness(t, counterRules(Rule{OnConflict: Replace}))
		for _, o := range []asynq.Option{Cooldown(math.MaxInt64), Debounce(math.MaxInt64)} {
			info, err := h.client.Enqueue(counterTask(o.String(), 1, 1), asynq.Queue(h.queue), o)
			if err != nil && !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("%v: %v, want it taken or refused with ErrInvalidOption", o, err)
			}
			if err == nil {
				if ttl := pttl(t, h.rdb, h.keyOf(counterTask(o.String(), 1, 1), h.queue)); ttl < time.Hour {
					t.Fatalf("%v: lock TTL %v", o, ttl)
				}
				_ = info
			}
		}
		for _, cfg := range []Config{{heartbeat: (math.MaxInt64) / 3}, {healGrace: math.MaxInt64}, {LockTimeout: math.MaxInt64}, {Rules: map[string]Rule{"x": {Cooldown: math.MaxInt64}}}, {Rules: map[string]Rule{"x": {TTL: math.MaxInt64}}}} {
			cfg.Logger = quietLogger()
			d, err := New(context.Background(), h.rdb, cfg)
			if err != nil && !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("New(%+v): %v", cfg, err)
			}
			if d != nil {
				_ = d.Close()
			}
		}
	})
}

// Per-call options follow their precedence whatever their order.
func TestMergeOptionsInAnyOrder(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	fn := func(old, new []byte) ([]byte, error) { return new, nil }
	h.enqueue(counterTask("k", 1, 1))
	for _, opts := range [][]asynq.Option{{MergeWith(fn), OnConflict(Merge)}, {OnConflict(Merge), MergeWith(fn)}} {
		res, err := h.client.Submit(context.Background(), counterTask("k", 1, 2), append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
		if err != nil || res.Outcome != Merged {
			t.Fatalf("%v: %+v %v, want Merged", opts, res, err)
		}
	}
	if _, err := h.client.Submit(context.Background(), counterTask("k", 1, 3), asynq.Queue(h.queue), OnConflict(Merge)); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("OnConflict(Merge) without a function: %v, want ErrInvalidOption", err)
	}
}

// A debounced task never comes due before the debounce has passed since
// the last enqueue folded into it: asynq keeps due times in whole seconds,
// so they are rounded up.
func TestDebounceNeverComesDueEarly(t *testing.T) {
	t.Parallel()
	bothPaths(t, Config{Rules: map[string]Rule{"sync:profile": {Fields: []string{"user_id"}, OnConflict: Replace, Debounce: 1500 * time.Millisecond}}}, func(t *testing.T, h *harness) {
		for seq := 1; seq <= 5; seq++ {
			before := time.Now()
			info := h.enqueue(profileSync("sync:profile", 1, seq))
			score, err := h.rdb.ZScore(context.Background(), "asynq:{"+h.queue+"}:scheduled", info.ID).Result()
			if err != nil {
				t.Fatal(err)
			}
			if due := time.Unix(int64(score), 0); due.Before(before.Add(1500 * time.Millisecond)) {
				t.Fatalf("enqueue %d at %v: due at %v, earlier than 1.5 s later", seq, before.Format(time.StampMilli), due.Format(time.StampMilli))
			}
			time.Sleep(150 * time.Millisecond) // the burst's pace: time under test
		}
	})
}

// A Defer follow-up that waits is a key waiting: MaxPending counts it from
// when it is made until it starts, so no more keys wait than the bound.
func TestMaxPendingCountsAFollowUpThatWaits(t *testing.T) {
	bothPaths(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 1}), func(t *testing.T, h *harness) {
		rc, release := holdRun(0, nil) // (only a has seq 0 here)
		h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = 1 })
		ctx := context.Background()
		h.enqueue(counterTask("a", 1, 0))
		waitFor(t, rc.runs, "a runs")
		if err := h.insp.PauseQueue(h.queue); err != nil { // nothing starts until the test says so
			t.Fatal(err)
		}
		res, err := h.client.Submit(ctx, counterTask("a", 1, 1), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("update of the running key: %+v %v, want Deferred", res, err)
		}
		overBound := func(when string) {
			t.Helper()
			if _, err := h.client.Submit(ctx, counterTask("b", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, ErrTooManyPending) {
				t.Fatalf("%s: a new key: %v, want ErrTooManyPending (the follow-up waits)", when, err)
			}
		}
		overBound("follow-up parked behind the run")
		close(release)
		h.settled(1)
		overBound("follow-up queued after the run")
		if err := h.insp.UnpauseQueue(h.queue); err != nil {
			t.Fatal(err)
		}
		if r := waitFor(t, rc.runs, "the follow-up runs"); r.id != res.TaskID {
			t.Fatalf("ran %s, want the follow-up %s", r.id, res.TaskID)
		}
		if _, err := h.client.Submit(ctx, counterTask("b", 1, 2), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("a new key once the follow-up started: %v", err)
		}
	})
}

// An operator who purges the waiting tasks (or the queue) frees their
// MaxPending slots: a slot whose task cannot run is not counted once the
// bound is hit (as healing judges an owner: a WrapClient lock not yet
// HealGrace old might still be waiting for its task to be stored).
func TestMaxPendingFreesTheSlotsOfPurgedTasks(t *testing.T) {
	purges := map[string]func(h *harness) error{
		"DeleteAllPendingTasks":  func(h *harness) error { _, err := h.insp.DeleteAllPendingTasks(h.queue); return err },
		"ArchiveAllPendingTasks": func(h *harness) error { _, err := h.insp.ArchiveAllPendingTasks(h.queue); return err },
		"DeleteQueue":            func(h *harness) error { return h.insp.DeleteQueue(h.queue, true) },
	}
	for name, purge := range purges {
		t.Run(name, func(t *testing.T) {
			bothPaths(t, counterRules(Rule{MaxPending: 2}), func(t *testing.T, h *harness) {
				a, b := h.enqueue(counterTask("a", 1, 0)), h.enqueue(counterTask("b", 1, 0))
				if _, err := h.client.Enqueue(counterTask("c", 1, 0), asynq.Queue(h.queue)); !errors.Is(err, ErrTooManyPending) {
					t.Fatalf("third key: %v, want ErrTooManyPending", err)
				}
				if err := purge(h); err != nil {
					t.Fatal(err)
				}
				for _, k := range []string{h.keyOf(counterTask("a", 1, 0), h.queue), h.keyOf(counterTask("b", 1, 0), h.queue)} {
					if !h.lockVerified(k) { // a WrapClient lock not written with its task: aged past HealGrace
						h.ageLock(k)
					}
				}
				_, _ = a, b
				if _, err := h.client.Enqueue(counterTask("c", 1, 0), asynq.Queue(h.queue)); err != nil {
					t.Fatalf("third key after %s: %v, want room", name, err)
				}
			})
		})
	}
}

// lockVerified reports whether the lock at key was written with its task
// (field v): it heals without waiting out HealGrace.
func (h *harness) lockVerified(key string) bool {
	h.t.Helper()
	return h.rdb.HExists(context.Background(), key, "v").Val()
}

// MaxPending counts a key in the queue its task waits in: a queue given to
// asynq.NewTask is not remembered for calls that name none, and a task an
// enqueuer moves to another queue is counted there.
func TestMaxPendingCountsInTheQueueTheTaskWaitsIn(t *testing.T) {
	t.Run("NewTask queue", func(t *testing.T) {
		bothPaths(t, counterRules(Rule{MaxPending: 1}), func(t *testing.T, h *harness) {
			low := h.queue + "-low"
			if _, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"key":"a"}`), asynq.Queue(low))); err != nil {
				t.Fatal(err)
			}
			info, err := h.client.Enqueue(counterTask("b", 1, 0)) // no queue anywhere: asynq's "default"
			if err != nil || info.Queue != "default" {
				t.Fatalf("a key with no queue named: %v %v, want it in default", info, err)
			}
			t.Cleanup(func() { _ = h.insp.DeleteTask("default", info.ID) })
			if _, err := h.client.Enqueue(counterTask("c", 1, 0)); !errors.Is(err, ErrTooManyPending) {
				t.Fatalf("a second key in default: %v, want ErrTooManyPending", err)
			}
			t.Cleanup(func() { _ = h.insp.DeleteQueue(low, true) })
		})
	})
	t.Run("moved by the enqueuer", func(t *testing.T) {
		h := newHarness(t, counterRules(Rule{MaxPending: 1}))
		c := h.d.WrapClient(queueMover{c: h.asynq, q: h.queue})
		other := h.queue + "-asked"
		if _, err := c.Enqueue(counterTask("a", 1, 0), asynq.Queue(other)); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Enqueue(counterTask("b", 1, 0), asynq.Queue(other)); !errors.Is(err, ErrTooManyPending) {
			t.Fatalf("a second key moved into the full queue: %v, want ErrTooManyPending", err)
		}
		if n := h.queueSize(h.queue); n != 1 {
			t.Fatalf("%d tasks in the queue, want 1 (the refused one taken back out)", n)
		}
	})
}

// A follow-up owed by a task that failed with retries left waits for the
// retry; when an operator deletes or archives that task, the follow-up is
// queued at once (within a heartbeat), not when its parked time comes
// (the retry delay plus TTL later).
func TestFollowUpQueuedWhenItsRetryingHolderIsRemoved(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"archive", "delete"} {
		t.Run(op, func(t *testing.T) {
			cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
			cfg.heartbeat = (1500 * time.Millisecond) / 3 // a heartbeat every 500 ms
			bothPaths(t, cfg, func(t *testing.T, h *harness) {
				rc, release := holdRun(0, errors.New("try again later"))
				h.serve(rc.handler(), retryInAnHour)
				first := h.enqueue(counterTask("k", 1, 0))
				waitFor(t, rc.runs, "the first attempt")
				res, err := h.client.Submit(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue))
				if err != nil || res.Outcome != Deferred {
					t.Fatalf("update while running: %+v %v, want Deferred", res, err)
				}
				close(release)
				h.settled(1)
				eventually(t, "asynq schedules the retry", func() bool { return h.taskState(first.ID) == asynq.TaskStateRetry })
				if op == "archive" {
					err = h.insp.ArchiveTask(h.queue, first.ID)
					defer func() { _ = h.insp.DeleteTask(h.queue, first.ID) }()
				} else {
					err = h.insp.DeleteTask(h.queue, first.ID)
				}
				if err != nil {
					t.Fatal(err)
				}
				if r := waitFor(t, rc.runs, "the follow-up runs"); r.id != res.TaskID || decodeCounter(r.task).Seq != 1 {
					t.Fatalf("ran %s seq %d, want the follow-up %s seq 1", r.id, decodeCounter(r.task).Seq, res.TaskID)
				}
			})
		})
	}
}

// dedupctl doctor --fix, releasing a lock whose owner cannot run, queues
// the follow-up the lock owes, which takes the key (here no server watches
// the lock: the one that held it has stopped).
func TestDoctorFixQueuesTheFollowUpOfALockItReleases(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	rc, release := holdRun(0, errors.New("try again later"))
	srv := h.serve(rc.handler(), retryInAnHour)
	first := h.enqueue(counterTask("k", 1, 0))
	waitFor(t, rc.runs, "the first attempt")
	ctx := context.Background()
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	close(release)
	h.settled(1)
	srv.Shutdown()
	if err := h.insp.ArchiveTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.insp.DeleteTask(h.queue, first.ID) }()
	keys := store.NewKeys(h.prefix)
	ls, err := store.ReadLocks(ctx, h.rdb, keys, h.locks())
	if err != nil {
		t.Fatal(err)
	}
	ds, _, err := store.Diagnose(ctx, h.rdb, ls, time.Minute, time.Now())
	if err != nil || len(ds) != 1 {
		t.Fatalf("doctor: %v %v, want the one lock whose owner was archived", ds, err)
	}
	l := ds[0].Lock
	rel, err := store.ReleaseKey(ctx, h.rdb, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: store.ReleaseStuck, Holder: l.Owner, Grace: time.Minute})
	if err != nil || !rel.Released || rel.Queued != res.TaskID {
		t.Fatalf("doctor --fix: %+v %v, want released to the follow-up %s", rel, err, res.TaskID)
	}
	if st := h.taskState(res.TaskID); st != asynq.TaskStatePending {
		t.Fatalf("follow-up %s is %v, want pending (queued now)", res.TaskID, st)
	}
	if dup := h.duplicateOf(counterTask("k", 1, 2), OnConflict(Reject)); dup.Holder != res.TaskID {
		t.Fatalf("the key is held by %s, want the follow-up %s", dup.Holder, res.TaskID)
	}
}

// A forced Release (holder "") releases whoever holds the key, also while
// the key changes hands under it (other releases free it, producers take it
// again): never ErrNotHolder.
func TestForcedReleaseReleasesWhoeverHoldsTheKey(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	stop := make(chan struct{})
	var producers, releasers sync.WaitGroup
	for range 4 { // producers take the key again as soon as it is free
		producers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				_, _ = h.client.Submit(ctx, counterTask("k", 1, 0), asynq.Queue(h.queue))
			}
		})
	}
	var (
		mu       sync.Mutex
		released int
		failed   []error
	)
	for range 4 {
		releasers.Go(func() {
			for range 150 {
				ok, err := h.d.Release(ctx, counterTask("k", 1, 0), "", asynq.Queue(h.queue))
				mu.Lock()
				if err != nil {
					failed = append(failed, err)
				} else if ok {
					released++
				}
				mu.Unlock()
			}
		})
	}
	releasers.Wait()
	close(stop)
	producers.Wait()
	t.Logf("%d of 600 forced releases released a lock", released)
	if len(failed) > 0 {
		t.Fatalf("%d of 600 forced releases failed, the first: %v", len(failed), failed[0])
	}
	if released == 0 {
		t.Fatal("no forced release found the key held: the producers did not contend")
	}
}

// Redis refusing a call before running it, for a reason that refuses any
// copy of it too (an ACL without the scripting commands, no memory left
// for writes), is not "outcome unknown": nothing was stored, and the error
// matches ErrUnavailable with Redis's refusal kept as its cause.
func TestDefinitiveRefusalsAreUnavailableNotUnknown(t *testing.T) {
	check := func(t *testing.T, err error, code string) {
		t.Helper()
		var re redis.Error
		switch {
		case !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown):
			t.Fatalf("enqueue refused with %s: %v, want ErrUnavailable and not ErrOutcomeUnknown", code, err)
		case !errors.As(err, &re) || !strings.HasPrefix(re.Error(), code):
			t.Fatalf("enqueue refused with %s: %v, want Redis's %s reply kept as the cause", code, err, code)
		}
	}
	t.Run("NOPERM", func(t *testing.T) {
		needRealRedis(t)
		admin := newRDB(t)
		ctx := context.Background()
		user := "noscript-" + uniq(t)
		if err := admin.Do(ctx, "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval", "-script").Err(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", user) })
		rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), Username: user, Password: "pw"})
		t.Cleanup(func() { _ = rdb.Close() })
		h := newHarnessOn(t, rdb, counterRules(Rule{}))
		_, err := h.d.NewClient().Enqueue(counterTask("k", 1, 0), asynq.Queue(h.queue))
		check(t, err, "NOPERM")
		if n := admin.LLen(ctx, store.PendingKey(h.queue)).Val(); n != 0 {
			t.Fatalf("%d tasks stored", n)
		}
	})
	t.Run("OOM", func(t *testing.T) {
		_, rdb := ownRedis(t, nil)
		h := newHarnessOn(t, rdb, counterRules(Rule{}))
		c := h.d.NewClient()
		if _, err := c.Enqueue(counterTask("a", 1, 0), asynq.Queue(h.queue)); err != nil { // registers the queue
			t.Fatal(err)
		}
		if err := rdb.ConfigSet(context.Background(), "maxmemory", "1").Err(); err != nil {
			t.Fatal(err)
		}
		_, err := c.Enqueue(counterTask("b", 1, 0), asynq.Queue(h.queue))
		check(t, err, "OOM")
	})
}

// A server whose Dedup has another Prefix than the producer's follows the
// producer's locks (found through the prefixes registered for the queue):
// Lookup sees the task running, a Defer follow-up is queued when the run
// ends, and the server leaves no lock of its own prefix behind.
func TestServerWithAnotherPrefixFollowsTheProducersLock(t *testing.T) {
	rules := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}).Rules
	bothPaths(t, Config{Rules: rules}, func(t *testing.T, h *harness) {
		server, err := New(context.Background(), h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = server.Close() })
		rc, release := holdRun(0, nil)
		serving := &harness{t: t, rdb: h.rdb, d: server, queue: h.queue, prefix: server.cfg.Prefix, insp: h.insp}
		serving.serve(rc.handler(), nil)
		ctx := context.Background()
		for _, opts := range [][]asynq.Option{nil, {asynq.TaskID("caller-" + uniq(t))}} {
			first := h.enqueue(counterTask("k", 1, 0), opts...)
			if r := waitFor(t, rc.runs, "the first run"); r.id != first.ID {
				t.Fatalf("ran %s, want %s", r.id, first.ID)
			}
			if kl, found, err := h.d.Lookup(ctx, counterTask("k", 1, 0), asynq.Queue(h.queue)); err != nil || !found || kl.State != "running" || kl.Holder != first.ID {
				t.Fatalf("producer's Lookup while the server runs the task: %+v %v %v, want running, held by %s", kl, found, err, first.ID)
			}
			res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("update while running: %+v %v, want Deferred", res, err)
			}
			release <- struct{}{}
			if r := waitFor(t, rc.runs, "the follow-up runs"); r.id != res.TaskID {
				t.Fatalf("ran %s, want the follow-up %s", r.id, res.TaskID)
			}
			eventually(t, "the key is free", func() bool {
				_, found, err := h.d.Lookup(ctx, counterTask("k", 1, 0), asynq.Queue(h.queue))
				return err == nil && !found
			})
		}
		if left := serving.locks(); len(left) != 0 {
			t.Fatalf("locks left under the server's own prefix: %v", left)
		}
	})
}

// The prefix registry has a fixed name (dedup:{<queue>}:prefixes), outside
// a custom prefix: an ACL that grants only the prefix and asynq's keys
// refuses it, and that must not fail the enqueue.
func TestPrefixRegistryRefusedByACLDoesNotFailEnqueue(t *testing.T) {
	needRealRedis(t)
	admin := newRDB(t)
	ctx := context.Background()
	name := uniq(t)
	prefix := "acl-" + name
	if err := admin.Do(ctx, "ACL", "SETUSER", name, "on", ">pw", "~asynq:*", "~"+prefix+":*", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", name) })
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), Username: name, Password: "pw"})
	t.Cleanup(func() { _ = rdb.Close() })
	h := newHarnessOn(t, rdb, Config{Prefix: prefix, Rules: counterRules(Rule{}).Rules})
	for _, c := range []*Client{h.client, h.d.NewClient()} {
		for i := range 2 {
			if _, err := c.Enqueue(counterTask(fmt.Sprint("k", i), 1, 0), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("enqueue under an ACL that refuses the prefix registry: %v", err)
			}
		}
		h.queue += "-2"
	}
}

// A call with Skip() under the caller-chosen ID of a live deduplicated
// task is refused by asynq (the ID is taken) and leaves that task's lock
// and index as they were: the task still runs locked.
func TestSkipUnderALiveTasksIDLeavesItLocked(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		id := "cid-" + uniq(t)
		h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
		if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id), Skip()); !errors.Is(err, asynq.ErrTaskIDConflict) {
			t.Fatalf("Skip under a live task's ID: %v, want asynq.ErrTaskIDConflict", err)
		}
		rc, release := holdRun(1, nil)
		h.serve(rc.handler(), nil)
		waitFor(t, rc.runs, "the task runs")
		defer close(release)
		if kl, found, err := h.d.Lookup(context.Background(), counterTask("k", 1, 1), asynq.Queue(h.queue)); err != nil || !found || kl.State != "running" || kl.Holder != id {
			t.Fatalf("the task's lock while it runs: %+v %v %v, want running, held by %s", kl, found, err, id)
		}
	})
}

// A holder that fails and runs again (a retry) while its follow-up waits
// leaves the follow-up counted under MaxPending.
func TestMaxPendingKeepsCountingAFollowUpAcrossItsHoldersRetry(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 1}))
	fail, done := make(chan struct{}), make(chan struct{})
	rc := newRecorder(func(r run) error {
		switch {
		case decodeCounter(r.task).Seq != 0:
			return nil
		case r.retry == 0:
			<-fail
			return errors.New("try again")
		}
		<-done // the retry runs until the test ends
		return nil
	})
	h.serve(rc.handler(), func(c *asynq.Config) { c.Concurrency = 1 })
	defer close(done)
	ctx := context.Background()
	h.enqueue(counterTask("a", 1, 0))
	waitFor(t, rc.runs, "the first attempt")
	res, err := h.client.Submit(ctx, counterTask("a", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	close(fail) // the first attempt fails
	if r := waitFor(t, rc.runs, "the retry"); r.retry != 1 {
		t.Fatalf("run %+v, want the retry", r)
	}
	if _, err := h.client.Submit(ctx, counterTask("b", 1, 2), asynq.Queue(h.queue)); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("a new key while the holder's retry runs and its follow-up waits: %v, want ErrTooManyPending", err)
	}
}

// A task of a RunningAllow type frees its key when it starts; when that
// attempt fails, another task of the key may take it (here: waits, and
// holds it) before asynq retries the first. The retry was accepted at
// enqueue: it runs, whatever holds the key, and is neither retried as busy
// nor dropped as an arrival (OnBusy BusyDrop), also under a caller-chosen
// ID, whose index must outlive the freed lock.
func TestAllowedTaskRetriesWhateverHoldsItsKey(t *testing.T) {
	t.Parallel()
	for _, callerID := range []bool{false, true} {
		t.Run(fmt.Sprintf("callerID=%v", callerID), func(t *testing.T) {
			bothPaths(t, counterRules(Rule{OnRunning: RunningAllow, OnBusy: BusyDrop}), func(t *testing.T, h *harness) {
				var failed atomic.Bool
				rc := newRecorder(func(r run) error {
					if decodeCounter(r.task).Seq == 1 && failed.CompareAndSwap(false, true) {
						return errors.New("first attempt fails")
					}
					return nil
				})
				gate := make(chan struct{})
				h.serve(rc.handler(), func(c *asynq.Config) {
					c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { <-gate; return 300 * time.Millisecond }
				})
				var opts []asynq.Option
				if callerID {
					opts = append(opts, asynq.TaskID("allow-"+h.queue))
				}
				first := h.enqueue(counterTask("k", 1, 1), opts...)
				if r := waitFor(t, rc.runs, "the first attempt"); r.id != first.ID {
					t.Fatalf("ran %s, want %s", r.id, first.ID)
				}
				// The key is free while the first waits for its retry: a second task takes it, and waits.
				second, err := h.client.Submit(context.Background(), counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour))
				if err != nil || second.Outcome != Created {
					t.Fatalf("second task: %+v %v, want Created", second, err)
				}
				close(gate)
				r := waitFor(t, rc.runs, "the retry of the first")
				if r.id != first.ID || r.retry != 1 {
					t.Fatalf("ran %s (retry %d), want the first task %s's retry", r.id, r.retry, first.ID)
				}
				eventually(t, "the first task completes", func() bool {
					st := h.taskState(first.ID)
					return st == 0 || st == asynq.TaskStateCompleted
				})
				if s := h.d.Stats(); s.Busy != 0 {
					t.Fatalf("%d busy decisions, want none", s.Busy)
				}
			})
		})
	}
}

// README: "a server whose Config.Prefix differs from the producer's
// follows the producer's lock"; RunningDefer: one follow-up, queued when
// the run ends, never two runs at once. A server of another prefix (and no
// rules) runs a Replace + RunningDefer key of a producer.
func TestServerWithAnotherPrefixHandsTheFollowUpOver(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	ds, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	tr := newKeyTracker(counterKeyOf, 1)
	serveWith(t, h.rdb, ds, h.queue, tr.handler(nil), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	holder := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("enqueue during the run: %+v %v, want Deferred behind %s", res, err, holder.ID)
	}
	res3, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue))
	if err != nil || res3.Outcome != Replaced || res3.TaskID != res.TaskID {
		t.Fatalf("second enqueue during the run: %+v %v, want Replaced into the follow-up %s", res3, err, res.TaskID)
	}
	tr.open(1)
	r := waitFor(t, tr.ends, "the holder ends")
	if r.id != holder.ID {
		t.Fatalf("first end %s, want the holder", r.id)
	}
	r = waitFor(t, tr.ends, "the follow-up runs")
	if r.id != res.TaskID || r.seq != 3 {
		t.Errorf("after the holder: %s with seq %d, want the follow-up %s with seq 3", r.id, r.seq, res.TaskID)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("overlaps: %v", o)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
}

// README: "RunningDefer never runs two tasks of a key at once. … When
// the run ends … the follow-up is queued"; SkipBusy/BusyDrop is for "tasks
// that arrive without a lock". An operator who runs the parked follow-up
// now (Inspector.RunTask, asynqmon's "run") while its holder runs must not
// lose the newest payload, whatever the busy policy.
func TestRunNowOnAFollowUpKeepsTheNewestPayload(t *testing.T) {
	for _, skipBusy := range []bool{false, true} {
		t.Run(fmt.Sprintf("SkipBusy=%v", skipBusy), func(t *testing.T) {
			cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
			cfg.SkipBusy = skipBusy
			h := newHarness(t, cfg)
			ctx := context.Background()
			tr := newKeyTracker(counterKeyOf, 1)
			h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 2 })
			t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
			h.enqueue(counterTask("k", 1, 1))
			waitFor(t, tr.starts, "the holder runs")
			res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
			if err != nil || res.Outcome != Deferred {
				t.Fatalf("%+v %v, want a follow-up", res, err)
			}
			if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
				t.Fatalf("run the follow-up now: %v", err)
			}
			eventually(t, "the follow-up was picked up", func() bool {
				s := h.taskState(res.TaskID)
				return s != asynq.TaskStatePending && s != asynq.TaskStateScheduled && s != asynq.TaskStateActive
			})
			if o := tr.overlapsSeen(); len(o) > 0 {
				t.Errorf("overlaps: %v", o)
			}
			tr.open(1)
			deadline := time.After(6 * time.Second)
			for {
				select {
				case r := <-tr.ends:
					if r.seq == 2 {
						return
					}
				case <-deadline:
					t.Fatalf("the newest payload (seq 2, follow-up %s) never ran; follow-up state %v (busy counted %d)", res.TaskID, taskStateName(h, res.TaskID), h.d.Stats().Busy)
				}
			}
		})
	}
}

// Three modes at once. README (combinations): "every other mix … works
// … Cooldown + Debounce: the debounced task's success cools the key"; "a
// RunningDefer follow-up counts"; MaxPending: "enqueues folded into keys
// already waiting always pass"; entries "leave when their task starts".
func TestDebounceCooldownAndMaxPendingTogether(t *testing.T) {
	t.Parallel()
	const typ = "a6:sync"
	h := newHarness(t, Config{Rules: map[string]Rule{typ: {Fields: []string{"user_id"}, OnConflict: Replace,
		Debounce: time.Second, Cooldown: time.Hour, MaxPending: 1}}})
	h.client = h.d.NewClient()
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	tr := newKeyTracker(func(t *asynq.Task) string {
		var p struct {
			UserID int `json:"user_id"`
		}
		_ = json.Unmarshal(t.Payload(), &p)
		return fmt.Sprint(p.UserID)
	})
	h.serve(tr.handler(nil), nil)
	r1, err := h.client.Submit(ctx, profileSync(typ, 1, 1), q)
	if err != nil || r1.Outcome != Created {
		t.Fatalf("first: %+v %v", r1, err)
	}
	if r, err := h.client.Submit(ctx, profileSync(typ, 1, 2), q); err != nil || r.Outcome != Replaced || r.TaskID != r1.TaskID {
		t.Fatalf("fold: %+v %v", r, err)
	}
	if _, err := h.client.Submit(ctx, profileSync(typ, 2, 1), q); !errors.Is(err, ErrTooManyPending) {
		t.Fatalf("second key while one waits (MaxPending 1): %v, want ErrTooManyPending", err)
	}
	run := waitFor(t, tr.ends, "the debounced task runs")
	if run.id != r1.TaskID || run.seq != 2 {
		t.Fatalf("ran %s seq %d, want %s with seq 2", run.id, run.seq, r1.TaskID)
	}
	eventually(t, "the key cools down", func() bool {
		_, err := h.client.Submit(ctx, profileSync(typ, 1, 3), q)
		var dup *DuplicateTaskError
		return errors.As(err, &dup) && dup.CoolingDown && dup.Holder == r1.TaskID
	})
	if r, err := h.client.Submit(ctx, profileSync(typ, 2, 1), q); err != nil || r.Outcome != Created {
		t.Fatalf("another key once the first ran (its slot left when it started): %+v %v", r, err)
	}
	if l, found, err := h.d.Lookup(ctx, profileSync(typ, 1, 9), q); err != nil || !found || l.State != "cooling" {
		t.Errorf("Lookup of the cooling key: %+v %v %v", l, found, err)
	}
}

// README (matrix): "the Inspector runs a scheduled task → runs now";
// RunningDefer: "After a failure with retries left it waits for the retry,
// so the newest payload still runs last". An operator runs a holder that
// waits for its retry (with a follow-up owed) now: the holder's retry runs,
// then the follow-up, never at once, and the newest payload last.
func TestRunNowOnARetryingHolderThenItsFollowUp(t *testing.T) {
	h := newHarness(t, counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}))
	ctx := context.Background()
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(func(r keyRun) error {
		if r.seq == 1 && r.retry == 0 {
			return errors.New("flaky")
		}
		return nil
	}), retryInAnHour)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	holder := h.enqueue(counterTask("k", 1, 1))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("%+v %v, want a follow-up", res, err)
	}
	tr.open(1)
	eventually(t, "the holder waits for its retry", func() bool { return h.taskState(holder.ID) == asynq.TaskStateRetry })
	if r, err := h.client.Submit(ctx, counterTask("k", 1, 3), asynq.Queue(h.queue)); err != nil || r.TaskID != res.TaskID {
		t.Fatalf("enqueue during the retry wait: %+v %v, want folded into the follow-up %s", r, err, res.TaskID)
	}
	if err := h.insp.RunTask(h.queue, holder.ID); err != nil {
		t.Fatal(err)
	}
	var ends []keyRun
	for len(ends) < 3 {
		ends = append(ends, waitFor(t, tr.ends, "runs"))
	}
	if ends[1].id != holder.ID || ends[1].err != nil || ends[2].id != res.TaskID || ends[2].seq != 3 {
		t.Fatalf("runs %+v: want the holder's retry, then the follow-up %s with seq 3", ends, res.TaskID)
	}
	if o := tr.overlapsSeen(); len(o) > 0 {
		t.Errorf("overlaps: %v", o)
	}
	eventually(t, "no lock is left", func() bool { return len(h.locks()) == 0 })
}

// README: "a server whose prefix differs follows the producer's lock when
// it finds none under its own"; lifecycle: "the key's own follow-up, run
// early by an operator, is retried and runs after the holder";
// RunningDefer "never runs two tasks of a key at once". On a server of
// another prefix, an operator runs the parked follow-up now while its
// holder runs: it must wait for the holder, not run beside it.
func TestServerWithAnotherPrefixMakesAFollowUpRunEarlyWait(t *testing.T) {
	rules := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	tr := newSeqTracker(0)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	first := h.enqueue(counterTask("k", 1, 0))
	if r := waitFor(t, tr.starts, "the holder runs"); r.id != first.ID {
		t.Fatalf("ran %s, want %s", r.id, first.ID)
	}
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(15 * time.Second)
wait:
	for {
		select {
		case r := <-tr.starts:
			t.Fatalf("the follow-up %s (seq %d) started while its holder %s ran (running beside it: %v)", r.id, r.seq, first.ID, r.overlaps)
		case <-tick.C:
			if server.Stats().Busy >= 1 {
				break wait // it met its key held: it waits
			}
		case <-timeout:
			t.Fatal("the follow-up run now was never picked up")
		}
	}
	tr.open(0)
	if r := waitSeqStart(tr, 1, 8*time.Second); r == nil {
		t.Fatalf("the follow-up %s never ran after its holder", res.TaskID)
	}
}

// README (Lock API): Release "deletes the lock …, never a task: the
// holder, if alive, still runs … and takes the key again when it starts if
// the key is free; if another task of the key holds it by then, the holder
// meets its type's OnBusy as a busy task does"; "a server whose prefix
// differs follows the producer's lock". On a server of another prefix, a
// released holder that starts while the key's new task runs must meet it
// (busy), not run beside it.
func TestServerWithAnotherPrefixMakesAReleasedHolderMeetTheKey(t *testing.T) {
	rules := counterRules(Rule{}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	released := h.enqueue(counterTask("k", 1, 1), asynq.ProcessIn(time.Hour))
	if ok, err := h.d.Release(ctx, counterTask("k", 1, 1), released.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release: %v %v", ok, err)
	}
	next := h.enqueue(counterTask("k", 1, 2))
	tr := newSeqTracker(2)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	if r := waitFor(t, tr.starts, "the key's new task runs"); r.id != next.ID {
		t.Fatalf("ran %s, want %s", r.id, next.ID)
	}
	if err := h.insp.RunTask(h.queue, released.ID); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(15 * time.Second)
	for {
		select {
		case r := <-tr.starts:
			t.Fatalf("the released holder %s started while the key's task %s ran (beside: %v)", r.id, next.ID, r.overlaps)
		case <-tick.C:
			if server.Stats().Busy >= 1 {
				return
			}
		case <-timeout:
			t.Fatal("the released holder was never picked up")
		}
	}
}

// README (Configuration): "Every duration (in Config, a Rule or an option,
// and what RetryDelayFunc returns) above dedup.MaxLifetime (100 years) is
// taken as MaxLifetime, and lifetimes add up without wrapping, so
// math.MaxInt64 means 'as long as can be'". Config.ConnectBackoff and
// Config.BreakerBackoff are durations of the Config: "forever" must
// neither panic nor wrap to no wait at all.
func TestForeverBackoffsNeverWrap(t *testing.T) {
	t.Parallel()
	noPanic := func(t *testing.T, what string, f func()) (panicked bool) {
		t.Helper()
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("%s panicked: %v", what, p)
				panicked = true
			}
		}()
		f()
		return false
	}
	t.Run("Backoff.Delay", func(t *testing.T) {
		forever := backoff{Min: math.MaxInt64, Max: math.MaxInt64}
		noPanic(t, "Backoff{MaxInt64, MaxInt64}.Delay(0)", func() { _ = forever.delay(0) })
		long := backoff{Min: time.Hour, Max: math.MaxInt64}
		zero := 0
		for range 20 {
			if long.delay(40) == 0 {
				zero++
			}
		}
		if zero == 20 {
			t.Errorf("Backoff{Min: 1h, Max: MaxInt64}.Delay(40) is always 0: the doubling wrapped (want a wait up to MaxLifetime)")
		}
	})
	t.Run("New with ConnectBackoff forever", func(t *testing.T) {
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		var err error
		if noPanic(t, "New with ConnectBackoff{MaxInt64, MaxInt64}", func() {
			_, err = New(ctx, rdb, Config{connectAttempts: 3, connectBackoff: backoff{Min: math.MaxInt64, Max: math.MaxInt64}, Logger: quietLogger()})
		}) {
			return
		}
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("New against no Redis: %v, want ErrUnavailable", err)
		}
	})
}

// README (lifecycle): "the key's own follow-up, run early by an operator,
// is retried and runs after the holder"; a last-attempt busy task is copied
// (da-<fingerprint>-…), and a follow-up's copy takes its place in the lock;
// RunningDefer "never runs two tasks of a key at once … When the run ends …
// the follow-up is queued". A follow-up that inherits MaxRetry(0) and is run
// now while its holder runs: its payload runs once, after the holder, never
// beside it.
func TestFollowUpRunEarlyOnItsLastAttemptRunsOnceAfterTheHolder(t *testing.T) {
	t.Parallel()
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer})
	cfg.heartbeat = (1500 * time.Millisecond) / 3
	h := newHarness(t, cfg)
	tr := newSeqTracker(0)
	h.serve(tr.handler(), nil)
	t.Cleanup(tr.openAll)
	ctx := context.Background()
	first := h.enqueue(counterTask("k", 1, 0), asynq.MaxRetry(0))
	waitFor(t, tr.starts, "the holder runs")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	if err := h.insp.RunTask(h.queue, res.TaskID); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follow-up meets its running holder", metKeyHeld(h.d, 1))
	// Let the copy's first due time (one Lease) pass while the holder runs.
	select {
	case r := <-tr.starts:
		t.Fatalf("%s (seq %d) started while the holder %s ran (beside: %v)", r.id, r.seq, first.ID, r.overlaps)
	case <-time.After(2 * 3 * cfg.heartbeat): // time under test: the copy's due time passing
	}
	tr.open(0)
	r := waitSeqStart(tr, 1, 8*time.Second)
	if r == nil {
		t.Fatalf("the follow-up's payload (seq 1) never ran after the holder; follow-up %s is %s", res.TaskID, taskStateName(h, res.TaskID))
	}
	if len(r.overlaps) > 0 {
		t.Fatalf("%s ran beside %v", r.id, r.overlaps)
	}
	eventually(t, "the queue drains", func() bool { return h.queueSize(h.queue) == 0 })
	n := 0
	for _, x := range tr.runs() {
		if x.seq == 1 {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("the follow-up's payload ran %d times, want once: %+v", n, tr.runs())
	}
}

// README (RunningDefer): "After a failure with retries left it waits for
// the retry …; if an operator then deletes or archives the waiting task,
// the server that held it queues the follow-up within a heartbeat". The
// holder here has a caller-chosen ID (its lock found through its index).
func TestFollowUpQueuedWhenItsRetryingCallerIDHolderIsDeleted(t *testing.T) {
	t.Parallel()
	cfg := counterRules(Rule{OnConflict: Replace, OnRunning: RunningDefer, MaxPending: 2})
	cfg.heartbeat = (1500 * time.Millisecond) / 3
	h := newHarness(t, cfg)
	fail := make(chan struct{})
	rc := newRecorder(func(r run) error {
		if decodeCounter(r.task).Seq == 0 {
			<-fail
			return errors.New("try again later")
		}
		return nil
	})
	h.serve(rc.handler(), retryInAnHour)
	ctx := context.Background()
	id := "a7-" + uniq(t)
	h.enqueue(counterTask("k", 1, 0), asynq.TaskID(id))
	waitFor(t, rc.runs, "the first attempt")
	res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("update while running: %+v %v, want Deferred", res, err)
	}
	close(fail)
	h.settled(1)
	eventually(t, "asynq schedules the retry", func() bool { return h.taskState(id) == asynq.TaskStateRetry })
	if err := h.insp.DeleteTask(h.queue, id); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-rc.runs:
		if r.id != res.TaskID || decodeCounter(r.task).Seq != 1 {
			t.Fatalf("ran %s seq %d, want the follow-up %s", r.id, decodeCounter(r.task).Seq, res.TaskID)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("the follow-up %s was not queued within a heartbeat (%v) of its holder's deletion: %s, due in %v",
			res.TaskID, 3*cfg.heartbeat/3, taskStateName(h, res.TaskID), dueIn(h, res.TaskID))
	}
}

// README (Failure modes): "Redis refuses the call before running it, for a
// reason that refuses any copy too (NOPERM, …) → nothing was stored, and a
// late copy would be refused as well: not 'outcome unknown' → ErrUnavailable
// wrapping Redis's reply". A user whose ACL lacks asynq's task keys (the
// README's ACL guidance not followed) is refused NOPERM on NewClient's
// direct path: that is no unknown outcome.
func TestNoPermOnTheDirectPathIsUnavailableNotUnknown(t *testing.T) {
	needRealRedis(t)
	admin := newRDB(t)
	ctx := context.Background()
	name := "a7-" + uniq(t)
	prefix := "a7p-" + name
	if err := admin.Do(ctx, "ACL", "SETUSER", name, "on", ">pw", "~"+prefix+":*", "~dedup:*", "~asynq:queues", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Do(context.Background(), "ACL", "DELUSER", name) })
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), Username: name, Password: "pw"})
	t.Cleanup(func() { _ = rdb.Close() })
	h := newHarnessOn(t, rdb, Config{Prefix: prefix, Rules: counterRules(Rule{}).Rules})
	_, err := h.d.NewClient().Enqueue(counterTask("k", 1, 0), asynq.Queue(h.queue))
	var re redis.Error
	switch {
	case err == nil:
		t.Fatal("enqueue succeeded without access to asynq's keys")
	case !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown):
		t.Fatalf("enqueue refused NOPERM: %v, want ErrUnavailable and not ErrOutcomeUnknown", err)
	case !errors.As(err, &re):
		t.Fatalf("enqueue refused NOPERM: %v, want Redis's reply kept as the cause", err)
	}
	if n := admin.LLen(ctx, store.PendingKey(h.queue)).Val(); n != 0 {
		t.Fatalf("%d tasks stored", n)
	}
}

// README (Choosing the key): Skip: "none: no lock at enqueue or at
// execution"; "a server whose prefix differs follows the producer's lock
// when it finds none under its own — a task locked at enqueue, or a
// caller-chosen ID with an index under the other prefix"; Key layout:
// "dedup:{<queue>}:i:<task ID> | lock of a caller-chosen task ID (or its
// opt-out mark)". A task enqueued with Skip() under a caller-chosen ID must
// run unguarded on a server of another prefix too: not be dropped as busy
// (BusyDrop) because an unrelated arrival of its key runs.
func TestServerWithAnotherPrefixRunsASkippedCallerIDUnguarded(t *testing.T) {
	rules := counterRules(Rule{OnBusy: BusyDrop}).Rules
	h := newHarness(t, Config{Rules: rules})
	ctx := context.Background()
	h.enqueue(counterTask("other", 1, 9), asynq.ProcessIn(time.Hour)) // registers the producer's prefix for the queue
	server, err := New(ctx, h.rdb, Config{Prefix: h.prefix + "-srv", Rules: rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close() })
	tr := newSeqTracker(1)
	serveWith(t, h.rdb, server, h.queue, tr.handler(), nil)
	t.Cleanup(tr.openAll)
	// An arrival without a lock (a Scheduler firing) of key k runs, held.
	if _, err := h.asynq.Enqueue(counterTask("k", 1, 1), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, tr.starts, "the arrival runs")
	id := "a7-skip-" + uniq(t)
	if _, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue), asynq.TaskID(id), Skip()); err != nil {
		t.Fatal(err)
	}
	if r := waitSeqStart(tr, 2, 8*time.Second); r == nil {
		t.Fatalf("the task %s enqueued with Skip() never ran: guarded at execution and dropped as busy (busy %d)", id, server.Stats().Busy)
	}
}
