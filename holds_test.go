package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// Holds are the truth: a hold a policy keeps past its task (a cooldown, a
// period window, a fail hold) is written before the handler's result
// reaches asynq, lives exactly as long as the lock's PTTL (which FreeIn
// reads), and nothing later (a heartbeat, a heal, a shutdown) shortens or
// stretches it.

// A success closer to the attempt's deadline than LockTimeout still cools
// its key for the whole window, with or without Retention: no enqueue of the
// key is accepted within it.
func TestCooldownAndPeriodHoldTheirWindowAfterASuccessJustBeforeTheTimeout(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		rule Rule
	}{
		{"Cooldown", Rule{Fields: []string{"user_id"}, Cooldown: time.Hour}},
		{"Period", Rule{Fields: []string{"user_id"}, Period: 24 * time.Hour}},
	} {
		for _, retention := range []time.Duration{0, time.Hour} {
			t.Run(fmt.Sprintf("%s/Retention=%v", mode.name, retention), func(t *testing.T) {
				h := newHarness(t, Config{heartbeat: 200 * time.Millisecond, Rules: map[string]Rule{"digest:weekly": mode.rule}})
				rc := newRecorder(func(r run) error {
					dl, _ := r.ctx.Deadline()
					select { // succeed 400 ms before the deadline, within LockTimeout (1 s) of it
					case <-time.After(time.Until(dl) - 400*time.Millisecond):
						return nil
					case <-r.ctx.Done():
						return r.ctx.Err()
					}
				})
				h.serve(rc.handler(), nil)
				first := h.enqueue(digest(1, 1), asynq.Timeout(2*time.Second), asynq.Retention(retention))
				waitFor(t, rc.runs, "the digest runs")
				eventually(t, "asynq marks the digest done", func() bool {
					st := h.taskState(first.ID)
					return st == asynq.TaskStateCompleted || st == 0
				})
				// Past LockTimeout and many heartbeats: the key still cools.
				for until := time.Now().Add(2 * time.Second); time.Now().Before(until); time.Sleep(100 * time.Millisecond) {
					_, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue))
					var dup *DuplicateTaskError
					if !errors.As(err, &dup) || !dup.CoolingDown || dup.Holder != first.ID {
						t.Fatalf("enqueue within the window: %v, want %s cooling down", err, first.ID)
					}
				}
				select {
				case r := <-rc.runs:
					t.Fatalf("%s ran within the window", r.id)
				default:
				}
			})
		}
	}
}

// A fail hold is written before asynq archives the task: a graceful
// shutdown of the worker right after the final failure (the Dedup closed
// too) cannot lose it. The lock lives exactly the hold, not the interim
// TTL (1 s here).
func TestFailHoldSurvivesAShutdownRightAfterTheFinalFailure(t *testing.T) {
	for _, c := range []struct {
		onFailure Failure
		hold      time.Duration
	}{{FailHold, time.Hour}, {FailHoldUntilReleased, 0}} {
		t.Run(c.onFailure.String(), func(t *testing.T) {
			cfg := counterRules(Rule{OnFailure: c.onFailure, FailHoldFor: c.hold, TTL: time.Second})
			h := newHarness(t, cfg)
			returning := make(chan struct{})
			srv := h.serve(func(context.Context, *asynq.Task) error {
				close(returning)
				return errors.New("failed for good")
			}, nil)
			a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
			select {
			case <-returning:
			case <-time.After(10 * time.Second):
				t.Fatal("the task never ran")
			}
			srv.Shutdown()
			if err := h.d.Close(); err != nil {
				t.Fatal(err)
			}
			eventually(t, "asynq archives the task", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
			key := h.keyOf(counterTask("k", 1, 1), h.queue)
			pttl := h.rdb.PTTL(context.Background(), key).Val()
			switch {
			case c.hold > 0 && (pttl < c.hold-time.Minute || pttl > c.hold):
				t.Fatalf("the lock lives %v more, want the hold %v", pttl, c.hold)
			case c.hold == 0 && pttl != -1:
				t.Fatalf("the lock's PTTL is %v, want no expiry (held until released)", pttl)
			}
			d2, err := New(context.Background(), h.rdb, Config{Prefix: h.prefix, Rules: cfg.Rules, Logger: quietLogger()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d2.Close() })
			_, err = d2.NewClient().Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
			var dup *DuplicateTaskError
			if !errors.As(err, &dup) || !dup.FailHeld || dup.Holder != a.ID {
				t.Fatalf("enqueue after the shutdown: %v, want a duplicate of %s held after its failure", err, a.ID)
			}
		})
	}
}

// FreeIn is exact: the key of a FailHold is free as soon as the first
// duplicate's FreeIn has passed (a client that retries after FreeIn, as
// after a Retry-After, is accepted), and not before.
func TestFailHoldFreeInIsExact(t *testing.T) {
	t.Parallel()
	const hold = 4 * time.Second
	// (A heartbeat shorter than the hold: a beat must not restart it.)
	h := newHarness(t, Config{heartbeat: time.Second, Rules: counterRules(Rule{OnFailure: FailHold, FailHoldFor: hold}).Rules})
	h.serve(func(context.Context, *asynq.Task) error { return errors.New("failed for good") }, nil)
	a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
	eventually(t, "asynq archives the task", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
	_, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	asked := time.Now()
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || !dup.FailHeld {
		t.Fatalf("enqueue during the hold: %v, want a failure-held duplicate", err)
	}
	freeAt := asked.Add(dup.FreeIn)
	if dup.FreeIn <= 0 || dup.FreeIn > hold {
		t.Fatalf("FreeIn %v, want within the hold %v", dup.FreeIn, hold)
	}
	time.Sleep(time.Until(freeAt.Add(-200 * time.Millisecond))) // the time under test
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), asynq.Queue(h.queue)); !errors.As(err, new(*DuplicateTaskError)) {
		t.Fatalf("enqueue 200 ms before FreeIn ran out: %v, want still held", err)
	}
	time.Sleep(time.Until(freeAt.Add(100 * time.Millisecond)))
	if _, err := h.client.Enqueue(counterTask("k", 1, 4), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue once the first duplicate's FreeIn has passed: %v, want it accepted", err)
	}
}

// docs/policies.md: "Once it succeeds, the key stays held until the window
// ends, whatever becomes of the task's record". That holds between asynq
// marking the task done and the success's settle landing too: with a Period
// rule, or a per-call Cooldown or Period the server has no rule for ("the
// server needs no configuration for it"), enqueues from other processes at
// keys whose locks are older than HealGrace, hammering while the tasks
// succeed, take no key. A Cooldown rule is the control. (Once, such a settle
// went off the handler's path and landed a few ms after asynq completed the
// task; an enqueue in between healed the lock and took the key.)
func TestCooldownAndPeriodHoldTheKeyWhileTheSuccessSettles(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	t.Run("Period rule", func(t *testing.T) {
		enqueueAtKeysAsTheySucceed(t, jobRules(Rule{Period: 24 * time.Hour}))
	})
	t.Run("per-call Cooldown, no server rule", func(t *testing.T) {
		enqueueAtKeysAsTheySucceed(t, Config{}, Fields("key"), Cooldown(24*time.Hour))
	})
	t.Run("per-call Period, no server rule", func(t *testing.T) {
		enqueueAtKeysAsTheySucceed(t, Config{}, Fields("key"), Period(24*time.Hour, nil))
	})
	t.Run("control: Cooldown rule", func(t *testing.T) { // settled on the handler's path: holds
		enqueueAtKeysAsTheySucceed(t, jobRules(Rule{Cooldown: 24 * time.Hour}))
	})
}

// enqueueAtKeysAsTheySucceed runs tasks of a few keys, each held past
// HealGrace, and enqueues their keys in tight loops from other processes'
// clients while the tasks succeed; it fails if any enqueue took a key.
func enqueueAtKeysAsTheySucceed(t *testing.T, cfg Config, opts ...asynq.Option) {
	cfg.healGrace = time.Second
	h := newHarness(t, cfg)
	h.client = h.d.NewClient()
	opts = append([]asynq.Option{asynq.Queue(h.queue)}, opts...)
	const keys = 4
	var runs atomic.Int32
	release := make(chan struct{})
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		runs.Add(1)
		<-release
		return nil
	}, nil)
	first := map[string]string{}
	for k := range keys {
		info, err := h.client.Enqueue(jobTask(fmt.Sprint(k), 0), opts...)
		if err != nil {
			t.Fatal(err)
		}
		first[fmt.Sprint(k)] = info.ID
	}
	eventually(t, "the tasks run", func() bool { return runs.Load() == keys })
	taken := time.Now()
	eventually(t, "the locks are older than HealGrace", func() bool { return time.Since(taken) > 1200*time.Millisecond })
	var (
		created []string
		mu      sync.Mutex
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	for i := range 2 * keys {
		hh := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix, Rules: cfg.Rules, healGrace: time.Second, Logger: quietLogger()})
		c := hh.d.NewClient()
		key := fmt.Sprint(i % keys)
		wg.Go(func() {
			for n := 1; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if info, err := c.Enqueue(jobTask(key, n), opts...); err == nil {
					mu.Lock()
					created = append(created, key+": "+info.ID)
					mu.Unlock()
				}
			}
		})
	}
	close(release)
	eventually(t, "the keys cool down", func() bool { return h.d.Stats().Cooling >= keys })
	ended := time.Now()
	eventually(t, "a moment of enqueues at the cooling keys", func() bool { return time.Since(ended) > 200*time.Millisecond })
	close(stop)
	wg.Wait()
	if len(created) > 0 {
		t.Fatalf("%d enqueues took a key in its window after its task succeeded (%v; holders %v), want none", len(created), created, first)
	}
}
