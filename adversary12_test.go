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
	"unicode/utf8"

	"github.com/hibiken/asynq"
)

// Adversarial tests of Period, OnFailure and the Scheduler (round 12). Each
// asserts a documented promise, so it fails while the bug it names exists.

const adv12Type = "adv12:job"

func adv12Task(key string, n int) *asynq.Task {
	return asynq.NewTask(adv12Type, fmt.Appendf(nil, `{"key":%q,"n":%d}`, key, n))
}

// adv12Within polls cond until it holds or d has passed: for a check that
// must come true soon once a bug is fixed, and never does while it exists.
func adv12Within(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

func adv12Rules(r Rule) Config {
	r.Fields = []string{"key"}
	return Config{Rules: map[string]Rule{adv12Type: r}}
}

// A success's settle goes off the handler's path (releaser.go) unless the
// server's rule has a Cooldown: with a Period rule, or a per-call Cooldown
// or Period the server has no rule for ("the server needs no configuration
// for it"), the cooling lands a few ms after asynq marks the task done. An
// enqueue in between finds the holder completed (its record gone) and,
// the lock being older than HealGrace, heals it and takes the key: a second
// task in the window. docs/policies.md: "Once it succeeds, the key stays
// held until the window ends, whatever becomes of the task's record".
func TestAdversary12SuccessCoolsWhileItsSettleIsInFlight(t *testing.T) {
	t.Run("Period rule", func(t *testing.T) {
		adv12HammerTheEnd(t, adv12Rules(Rule{Period: 24 * time.Hour}))
	})
	t.Run("per-call Cooldown, no server rule", func(t *testing.T) {
		adv12HammerTheEnd(t, Config{}, Fields("key"), Cooldown(24*time.Hour))
	})
	t.Run("per-call Period, no server rule", func(t *testing.T) {
		adv12HammerTheEnd(t, Config{}, Fields("key"), Period(24*time.Hour, nil))
	})
	t.Run("control: Cooldown rule", func(t *testing.T) { // settled on the handler's path: holds
		adv12HammerTheEnd(t, adv12Rules(Rule{Cooldown: 24 * time.Hour}))
	})
}

// adv12HammerTheEnd runs tasks of a few keys, each held past HealGrace, and
// enqueues their keys in tight loops from other processes' clients while
// the tasks succeed; it fails if any enqueue took a key.
func adv12HammerTheEnd(t *testing.T, cfg Config, opts ...asynq.Option) {
	cfg.HealGrace = time.Second
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
		info, err := h.client.Enqueue(adv12Task(fmt.Sprint(k), 0), opts...)
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
		hh := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix, Rules: cfg.Rules, HealGrace: time.Second, Logger: quietLogger()})
		c := hh.d.NewClient()
		key := fmt.Sprint(i % keys)
		wg.Go(func() {
			for n := 1; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if info, err := c.Enqueue(adv12Task(key, n), opts...); err == nil {
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

// In zones whose daylight-saving time starts at midnight (America/Santiago,
// America/Havana), that midnight does not exist and time.Date normalises
// it to 23:00 the day before. A day window then ends an hour early, and a
// time in its last hour lies outside its own window: the key it takes
// cools for a millisecond after success, and a second task runs the same
// day. docs/policies.md: "Midnight is Location's ..., so days follow its
// daylight-saving changes (a 23- or 25-hour day)"; windows tile time.
func TestAdversary12PeriodWindowsInZonesWhoseMidnightIsSkipped(t *testing.T) {
	for _, c := range []struct {
		zone string
		at   string // the evening before DST starts at 00:00
	}{
		{"America/Santiago", "2026-09-05 23:30"},
		{"America/Havana", "2026-03-07 23:30"},
	} {
		loc := mustZone(t, c.zone)
		at, err := time.ParseInLocation("2006-01-02 15:04", c.at, loc)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range []time.Duration{time.Hour, 24 * time.Hour, 7 * 24 * time.Hour} {
			start, end := periodWindow(at, d, loc)
			if at.Before(start) || !at.Before(end) {
				t.Errorf("%s, %v windows: %v lies outside its window [%v, %v)", c.zone, d, at, start, end)
				continue
			}
			if next, _ := periodWindow(end, d, loc); !next.Equal(end) {
				t.Errorf("%s, %v windows: the window after [%v, %v) starts at %v", c.zone, d, start, end, next)
			}
			// What a taken lock records: held after success until the window ends.
			r := resolved{period: d, loc: loc}
			r.settleWindow(at)
			if cool, _ := r.lockTerms(at); cool < 29*time.Minute { // the day's first instant is 30 min on
				t.Errorf("%s, %v windows: a success at %v cools for %v, want until the window's end (30m on)", c.zone, d, at, cool)
			}
		}
	}
}

// asynq's Inspector archiving a waiting task is a final failure: with
// FailHoldUntilReleased the key stays held until someone releases it. The
// hold is only marked when an enqueue meets the lock; until then the lock
// keeps its waiting TTL, and if it lapses first the key frees by itself.
func TestAdversary12InspectorArchivedHoldOutlivesTheLockTTL(t *testing.T) {
	h := newHarness(t, adv12Rules(Rule{OnFailure: FailHoldUntilReleased, TTL: time.Second}))
	h.client = h.d.NewClient()
	info := h.enqueue(adv12Task("a", 1)) // no server: it waits
	if err := h.insp.ArchiveTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	archived := time.Now()
	eventually(t, "past the lock's waiting TTL", func() bool { return time.Since(archived) > 2*time.Second })
	_, err := h.client.Enqueue(adv12Task("a", 2), asynq.Queue(h.queue))
	var de *DuplicateTaskError
	if !errors.As(err, &de) || !de.Failed || de.TaskID != info.ID {
		t.Fatalf("enqueue after the operator archived %s: %v, want a failed hold until released", info.ID, err)
	}
}

// Right after the Inspector archives a waiting FailHold task, Lookup (and
// dedupctl show) must say "failed" (docs/policies.md: "The state is
// failed"), not "orphaned" ("its task is gone; it heals"), which it will
// not: the next enqueue is refused with Failed.
func TestAdversary12LookupSaysFailedAfterInspectorArchive(t *testing.T) {
	h := newHarness(t, adv12Rules(Rule{OnFailure: FailHold, FailureHold: time.Hour}))
	h.client = h.d.NewClient()
	info := h.enqueue(adv12Task("l", 1))
	if err := h.insp.ArchiveTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	kl, found, err := h.d.Lookup(context.Background(), adv12Task("l", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" {
		t.Errorf("Lookup after the archive: %+v %v %v, want state failed", kl, found, err)
	}
	failedDup(t, h.client, adv12Task("l", 3), h.queue, info.ID)
	kl, _, _ = h.d.Lookup(context.Background(), adv12Task("l", 2), asynq.Queue(h.queue))
	if kl.State != "failed" {
		t.Errorf("Lookup after the refused enqueue: %+v, want failed", kl)
	}
}

// Period + FailHoldUntilReleased: a task that fails for good keeps its
// window's key held, with no expiry, "until someone releases it
// (Dedup.Release, ...)". Once the window is over, Lookup and Release of the
// task compute the new window's key and can no longer find it: the lock is
// left in Redis forever, one per failed key per window.
func TestAdversary12PeriodFailedHoldReachableAfterItsWindow(t *testing.T) {
	h := newHarness(t, Config{Lease: 3 * time.Second})
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	opts := []asynq.Option{asynq.Queue(h.queue), Fields("key"), Period(time.Second, nil), OnFailure(FailHoldUntilReleased, 0)}
	info, err := h.client.Enqueue(adv12Task("w", 1), opts...)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "held after the failure", func() bool { return h.d.Stats().FailureHeld == 1 })
	locks := h.locks()
	if len(locks) != 1 {
		t.Fatalf("locks %v, want the held one", locks)
	}
	_, end := periodWindow(time.Now(), time.Second, nil)
	eventually(t, "the window is over", func() bool { return time.Now().After(end.Add(100 * time.Millisecond)) })
	released, err := h.d.Release(context.Background(), adv12Task("w", 2), info.ID, opts[1:]...)
	if err != nil || !released {
		n := len(h.locks())
		t.Fatalf("Release of the failed %s after its window: %v %v; %d lock(s) left, PTTL %v: a lock no API can reach or that never expires",
			info.ID, released, err, n, h.rdb.PTTL(context.Background(), locks[0]).Val())
	}
}

// A caller-chosen task ID with per-call key and OnFailure options (the
// policy is recorded in the lock, "so the server needs no matching rule"):
// the failure's settle deletes the ID's index key, so when an operator runs
// the archived task again (Inspector.RunTask) the server cannot find its
// lock, runs it unguarded, and its success leaves the key held forever.
// docs/policies.md: "Running the archived task again ... makes it the key's
// owner again: its success frees the key."
func TestAdversary12RunTaskOfACallerIDHeldTaskFreesTheKeyOnSuccess(t *testing.T) {
	h := newHarness(t, Config{Lease: 3 * time.Second})
	h.client = h.d.NewClient()
	fail := make(chan bool, 2)
	fail <- true
	fail <- false
	ran := make(chan string, 4)
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		if <-fail {
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	opts := []asynq.Option{asynq.Queue(h.queue), Key("invoice-7"), OnFailure(FailHoldUntilReleased, 0)}
	info, err := h.client.Enqueue(adv12Task("x", 1), append(opts, asynq.TaskID("invoice-7-run"), asynq.Retention(time.Hour))...)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the failing run")
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the run by hand")
	eventually(t, "the run by hand completed", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
	if !adv12Within(3*time.Second, func() bool { _, err = h.client.Enqueue(adv12Task("x", 2), opts...); return err == nil }) {
		kl, _, _ := h.d.Lookup(context.Background(), adv12Task("x", 2), opts...)
		t.Fatalf("enqueue after the run by hand of %s succeeded: %v (lock: state %s, holder %s), want the key free; stats %+v",
			info.ID, err, kl.State, kl.Holder, h.d.Stats())
	}
}

// A panic on the last retry is a final failure; "the holder's last error is
// kept in the lock". The lock keeps "dedup: handler panicked" instead of
// what panicked (asynq's own record says "panic ...: <value>").
func TestAdversary12PanicOnTheLastRetryKeepsWhatPanicked(t *testing.T) {
	h := newHarness(t, failRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { panic("disk on fire") }, nil)
	info := h.enqueue(counterTask("panic", 1, 0), asynq.MaxRetry(0), asynq.Retention(time.Hour))
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	kl, found, err := h.d.Lookup(context.Background(), counterTask("panic", 2, 0), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || !strings.Contains(kl.LastError, "disk on fire") {
		ti, _ := h.insp.GetTaskInfo(h.queue, info.ID)
		t.Fatalf("Lookup: state %q, LastError %q; want failed with what panicked (asynq recorded %q)", kl.State, kl.LastError, ti.LastErr)
	}
}

// Register refuses OnFailure ("Cooldown, Period or OnFailure (the Scheduler
// sets the hold)"), but OnFailure(FailRelease, 0) passes, and is then
// silently overridden by the Scheduler's FailHold.
func TestAdversary12SchedulerRegisterRefusesEveryOnFailure(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, nil)
	if id, err := s.Register("@every 1m", adv12Task("s", 1), OnFailure(FailRelease, 0)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("Register with OnFailure(FailRelease, 0): entry %q, err %v; want ErrInvalidOption", id, err)
	}
}

// The last error is kept in the lock, cut at 1000 bytes by the scripts
// (string.sub): an error of multi-byte text is cut inside a character, and
// Lookup's LastError (and dedupctl show's "last error", and the lock
// browser) is not valid UTF-8 any more.
func TestAdversary12LastErrorIsKeptAsValidText(t *testing.T) {
	h := newHarness(t, failRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	msg := "upstream said:\nstate            free\x1b[2J xy" + strings.Repeat("é", 600)
	h.serve(func(context.Context, *asynq.Task) error { return fmt.Errorf("%s: %w", msg, asynq.SkipRetry) }, nil)
	info := h.enqueue(counterTask("utf8", 1, 0))
	eventually(t, "held", func() bool { return h.d.Stats().FailureHeld == 1 })
	kl, found, err := h.d.Lookup(context.Background(), counterTask("utf8", 2, 0), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || kl.Holder != info.ID {
		t.Fatalf("Lookup: %+v %v %v", kl, found, err)
	}
	if !strings.HasPrefix(msg, strings.TrimRight(kl.LastError, "\xc3")) || len(kl.LastError) < 100 {
		t.Errorf("LastError %q is not the error's text", kl.LastError)
	}
	t.Logf("LastError %d bytes: %q", len(kl.LastError), kl.LastError)
	if !utf8.ValidString(kl.LastError) {
		t.Errorf("LastError (%d bytes) is not valid UTF-8: ends %q", len(kl.LastError), kl.LastError[len(kl.LastError)-4:])
	}
}
