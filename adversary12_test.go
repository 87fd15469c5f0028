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

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Adversarial tests of Period, OnFailure and the Scheduler (round 12). Each
// asserts a documented promise, so it fails while the bug it names exists.

// A success's settle goes off the handler's path (releaser.go) unless the
// server's rule has a Cooldown: with a Period rule, or a per-call Cooldown
// or Period the server has no rule for ("the server needs no configuration
// for it"), the cooling lands a few ms after asynq marks the task done. An
// enqueue in between finds the holder completed (its record gone) and,
// the lock being older than HealGrace, heals it and takes the key: a second
// task in the window. docs/policies.md: "Once it succeeds, the key stays
// held until the window ends, whatever becomes of the task's record".
func TestCooldownAndPeriodHoldTheKeyWhileTheSuccessSettles(t *testing.T) {
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

// enqueueAtKeysAsTheySucceed runs tasks of a few keys, each held past HealGrace, and
// enqueues their keys in tight loops from other processes' clients while
// the tasks succeed; it fails if any enqueue took a key.
func enqueueAtKeysAsTheySucceed(t *testing.T, cfg Config, opts ...asynq.Option) {
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

// In zones whose daylight-saving time starts at midnight (America/Santiago,
// America/Havana), that midnight does not exist and time.Date normalises
// it to 23:00 the day before. A day window then ends an hour early, and a
// time in its last hour lies outside its own window: the key it takes
// cools for a millisecond after success, and a second task runs the same
// day. docs/policies.md: "Midnight is Location's ..., so days follow its
// daylight-saving changes (a 23- or 25-hour day)"; windows tile time.
func TestPeriodWindowsInZonesWhoseMidnightIsSkipped(t *testing.T) {
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

// An operator's archive of a waiting task is no failure (docs/policies.md):
// the key frees, even under FailHoldUntilReleased, and Lookup says the lock
// is orphaned (it heals), not failed.
func TestFailHoldTreatsAnArchiveOfAWaitingTaskAsNoFailure(t *testing.T) {
	h := newHarness(t, jobRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	info := h.enqueue(jobTask("a", 1)) // no server: it waits
	if err := h.insp.ArchiveTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	kl, found, err := h.d.Lookup(context.Background(), jobTask("a", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "orphaned" {
		t.Errorf("Lookup after the archive: %+v %v %v, want orphaned", kl, found, err)
	}
	if _, err := h.client.Enqueue(jobTask("a", 2), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after the operator archived %s: %v, want a new task", info.ID, err)
	}
}

// Period + FailHoldUntilReleased: the hold ends with the window at the
// latest (the next window is another key), so no lock is left that no API
// can reach.
func TestPeriodFailureHoldEndsWithItsWindow(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (3 * time.Second) / 3})
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	const period = 6 * time.Second
	opts := []asynq.Option{asynq.Queue(h.queue), Fields("key"), Period(period, nil), OnFailure(FailHoldUntilReleased, 0)}
	// Enqueue early in a window, so that the failure is held before it ends.
	eventually(t, "a window with 5 s left", func() bool { _, end := periodWindow(time.Now(), period, nil); return time.Until(end) > 5*time.Second })
	if _, err := h.client.Enqueue(jobTask("w", 1), opts...); err != nil {
		t.Fatal(err)
	}
	eventually(t, "held after the failure, until its window ends", func() bool {
		for _, k := range h.locks() {
			if h.lockState(k) == store.LockFailed {
				ttl := h.rdb.PTTL(context.Background(), k).Val()
				return ttl > 0 && ttl <= period
			}
		}
		return false
	})
	eventually(t, "no lock left after the window", func() bool { return len(h.locks()) == 0 })
}

// A caller-chosen task ID with per-call key and OnFailure options (the
// policy is recorded in the lock, "so the server needs no matching rule"):
// the failure's settle deletes the ID's index key, so when an operator runs
// the archived task again (Inspector.RunTask) the server cannot find its
// lock, runs it unguarded, and its success leaves the key held forever.
// docs/policies.md: "Running the archived task again ... makes it the key's
// owner again: its success frees the key."
func TestFailureHeldCallerIDTaskRunAgainByHandFreesTheKeyOnSuccess(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (3 * time.Second) / 3})
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
	info, err := h.client.Enqueue(jobTask("x", 1), append(opts, asynq.TaskID("invoice-7-run"), asynq.Retention(time.Hour))...)
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
	if !within(3*time.Second, func() bool { _, err = h.client.Enqueue(jobTask("x", 2), opts...); return err == nil }) {
		kl, _, _ := h.d.Lookup(context.Background(), jobTask("x", 2), opts...)
		t.Fatalf("enqueue after the run by hand of %s succeeded: %v (lock: state %s, holder %s), want the key free; stats %+v",
			info.ID, err, kl.State, kl.Holder, h.d.Stats())
	}
}

// A panic on the last retry is a final failure; the lock keeps "dedup:
// handler panicked", never the panic's value (which may quote the
// payload; asynq's record has it), as documented.
func TestFailHoldKeepsAPanicOnTheLastRetryAsAPanic(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { panic("disk on fire") }, nil)
	info := h.enqueue(jobTask("panic", 1), asynq.MaxRetry(0), asynq.Retention(time.Hour))
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	kl, found, err := h.d.Lookup(context.Background(), jobTask("panic", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || kl.LastError != errPanicked.Error() {
		t.Fatalf("Lookup: state %q, LastError %q; want failed with %q", kl.State, kl.LastError, errPanicked)
	}
}

// Register refuses OnFailure ("Cooldown, Period or OnFailure (the Scheduler
// sets the hold)"), but OnFailure(FailRelease, 0) passes, and is then
// silently overridden by the Scheduler's FailHold.
func TestSchedulerRegisterRefusesEveryOnFailure(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, nil)
	if id, err := s.Register("@every 1m", jobTask("s", 1), OnFailure(FailRelease, 0)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("Register with OnFailure(FailRelease, 0): entry %q, err %v; want ErrInvalidOption", id, err)
	}
}

// The last error is kept in the lock, cut at 1000 bytes by the scripts
// (string.sub): an error of multi-byte text is cut inside a character, and
// Lookup's LastError (and dedupctl show's "last error", and the lock
// browser) is not valid UTF-8 any more.
func TestFailHoldKeepsTheLastErrorAsValidText(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	msg := "upstream said:\nstate            free\x1b[2J xy" + strings.Repeat("é", 600)
	h.serve(func(context.Context, *asynq.Task) error { return fmt.Errorf("%s: %w", msg, asynq.SkipRetry) }, nil)
	info := h.enqueue(jobTask("utf8", 1))
	eventually(t, "held", func() bool { return h.d.Stats().FailureHeld == 1 })
	kl, found, err := h.d.Lookup(context.Background(), jobTask("utf8", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || kl.Holder != info.ID {
		t.Fatalf("Lookup: %+v %v %v", kl, found, err)
	}
	kept, cut := strings.CutSuffix(kl.LastError, "…") // documented: up to 1,000 bytes, cut at a character, marked
	if !cut || !strings.HasPrefix(msg, kept) || len(kl.LastError) > 1000 || len(kept) < 900 {
		t.Errorf("LastError %q is not the error's text cut as documented", kl.LastError)
	}
	t.Logf("LastError %d bytes: %q", len(kl.LastError), kl.LastError)
	if !utf8.ValidString(kl.LastError) {
		t.Errorf("LastError (%d bytes) is not valid UTF-8: ends %q", len(kl.LastError), kl.LastError[len(kl.LastError)-4:])
	}
}

// A call folded into a waiting task leaves the key's failure policy as it
// was; "Result.NotApplied names the call's options that were not applied"
// (as it names a folded call's Cooldown). OnFailure is not named.
func TestOnFailureOfAFoldedCallIsNamedNotApplied(t *testing.T) {
	h := newHarness(t, jobRules(Rule{OnConflict: Replace}))
	h.client = h.d.NewClient()
	first := h.enqueue(jobTask("f", 1))
	res, err := h.client.Submit(context.Background(), jobTask("f", 2), asynq.Queue(h.queue), OnFailure(FailHoldUntilReleased, 0), Cooldown(time.Hour))
	if err != nil || res.Outcome != Replaced || res.TaskID != first.ID {
		t.Fatalf("Submit: %+v %v, want replaced into %s", res, err, first.ID)
	}
	named := strings.Join(res.NotApplied, " ")
	if !strings.Contains(named, "dedup.Cooldown") {
		t.Fatalf("NotApplied %v does not name the Cooldown", res.NotApplied)
	}
	if !strings.Contains(named, "dedup.OnFailure") {
		t.Errorf("NotApplied %v does not name dedup.OnFailure, which the fold did not apply", res.NotApplied)
	}
}

// A firing that fails for good keeps its key (FailHold) so that a replica
// whose clock lags cannot enqueue it again; a firing revoked by its handler
// (asynq.RevokeTask) or deleted by an operator frees it, and the lagging
// replica's enqueue of the same firing (the very options the first replica
// used) is accepted: the firing is enqueued, and run, twice.
// docs/scheduler.md: "each firing once however many replicas run it".
func TestSchedulerFiringRevokedByItsHandlerIsNotEnqueuedAgain(t *testing.T) {
	for _, end := range []string{"revoked"} { // (an operator's delete frees the firing's key: docs/scheduler.md)
		t.Run(end, func(t *testing.T) {
			h := newHarness(t, Config{})
			type firing struct {
				task *asynq.Task
				opts []asynq.Option
			}
			fired := make(chan firing, 10)
			posted := make(chan error, 10)
			s := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger(), PreEnqueueFunc: func(task *asynq.Task, opts []asynq.Option) {
				fired <- firing{task, opts}
			}, PostEnqueueFunc: func(info *asynq.TaskInfo, err error) { posted <- err }})
			if _, err := s.Register("@every 1s", asynq.NewTask("adv12:report", nil), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
			var ran atomic.Int32
			if end == "revoked" {
				h.serve(func(context.Context, *asynq.Task) error { ran.Add(1); return asynq.RevokeTask }, nil)
			}
			if err := s.Start(); err != nil {
				t.Fatal(err)
			}
			f := waitFor(t, fired, "a firing")
			if err := waitFor(t, posted, "the firing's enqueue"); err != nil {
				t.Fatal(err)
			}
			s.Shutdown()
			_, at, _ := SchedulerFiring(f.task)
			entry, _, _ := SchedulerFiring(f.task)
			id := func() string {
				l, found, _ := h.d.Lookup(context.Background(), f.task, f.opts...)
				if found {
					return l.Holder
				}
				return ""
			}
			holder := ""
			eventually(t, "the firing's task is stored", func() bool { holder = id(); return holder != "" })
			if end == "revoked" {
				eventually(t, "the firing ran and was revoked", func() bool { s := h.d.Stats(); return ran.Load() >= 1 && s.Released+s.Cooling >= 1 })
			} else {
				if err := h.insp.DeleteTask(h.queue, holder); err != nil {
					t.Fatal(err)
				}
			}
			// A replica whose clock lags by 0.5 s (within MaxSkew) enqueues this firing now.
			res, err := h.d.NewClient().Submit(context.Background(), f.task, f.opts...)
			var dup *DuplicateTaskError
			if !errors.As(err, &dup) {
				t.Errorf("a lagging replica's enqueue of firing %s of entry %s after it was %s: %+v %v, want a duplicate",
					at.Format(time.TimeOnly), entry[:8], end, res.Outcome, err)
			}
		})
	}
}

// Bad per-call Period and OnFailure values fail with ErrInvalidOption on
// both enqueue paths and leave no lock and no task.
func TestPeriodAndOnFailureBadValuesLeaveNothing(t *testing.T) {
	bad := map[string][]asynq.Option{
		"FailHold 0":                     {OnFailure(FailHold, 0)},
		"FailHold negative":              {OnFailure(FailHold, -time.Second)},
		"FailHold min int":               {OnFailure(FailHold, time.Duration(-1<<63))},
		"Failure(-1)":                    {OnFailure(Failure(-1), 0)},
		"Failure(3)":                     {OnFailure(Failure(3), time.Second)},
		"FailRelease with a hold":        {OnFailure(FailRelease, -time.Second)},
		"UntilReleased with a hold":      {OnFailure(FailHoldUntilReleased, -1)},
		"Period 0":                       {Period(0, nil)},
		"Period negative":                {Period(-time.Hour, nil)},
		"Period 999ms":                   {Period(999*time.Millisecond, nil)},
		"Period 25h":                     {Period(25*time.Hour, nil)},
		"Period day and a ns":            {Period(24*time.Hour+1, nil)},
		"Period past MaxLifetime":        {Period(MaxLifetime+24*time.Hour, nil)},
		"Period max int":                 {Period(time.Duration(1<<63-1), nil)},
		"Period with Cooldown":           {Period(time.Hour, nil), Cooldown(time.Minute)},
		"Period with RunningDefer rule":  {Period(time.Hour, nil), asynq.Queue("")},
		"Period, a good OnFailure after": {Period(time.Millisecond, nil), OnFailure(FailHold, time.Hour)},
	}
	for _, path := range []string{"wrap", "direct"} {
		h := newHarness(t, Config{Rules: map[string]Rule{"adv12:defer": {OnConflict: Replace, OnRunning: RunningDefer}}})
		if path == "direct" {
			h.client = h.d.NewClient()
		}
		for name, opts := range bad {
			task := jobTask(name, 1)
			if name == "Period with RunningDefer rule" {
				task, opts = asynq.NewTask("adv12:defer", []byte(`{}`)), opts[:1]
			}
			_, err := h.client.Enqueue(task, append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
			if !errors.Is(err, ErrInvalidOption) {
				t.Errorf("%s, %s: %v, want ErrInvalidOption", path, name, err)
			}
		}
		if n := len(h.locks()); n != 0 {
			t.Errorf("%s: %d locks left behind", path, n)
		}
		if n := queueTasks(t, h); n != 0 {
			t.Errorf("%s: %d tasks enqueued", path, n)
		}
		// The largest values that are valid are taken, and bounded.
		info, err := h.client.Enqueue(jobTask("huge", 1), asynq.Queue(h.queue), Fields("key"), Period(MaxLifetime/(24*time.Hour)*24*time.Hour, time.FixedZone("odd", 5*3600+1)), OnFailure(FailHold, time.Duration(1<<63-1)))
		if err != nil {
			t.Fatalf("%s: the largest Period and FailHold: %v", path, err)
		}
		kl, found, err := h.d.Lookup(context.Background(), jobTask("huge", 2), asynq.Queue(h.queue), Fields("key"), Period(MaxLifetime/(24*time.Hour)*24*time.Hour, time.FixedZone("odd", 5*3600+1)))
		if err != nil || !found || kl.Holder != info.ID || kl.TTL <= 0 || kl.TTL > MaxLifetime || !kl.WindowStart.Before(time.Now()) || !kl.WindowEnd.After(time.Now()) {
			t.Errorf("%s: Lookup of the largest Period: %+v %v %v", path, kl, found, err)
		}
	}
}

// Cooldown and FailHold together: success cools for the cooldown, a final
// failure holds for FailureHold.
func TestCooldownCoolsAndFailHoldHoldsOnOneKey(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{Cooldown: time.Hour, OnFailure: FailHold, FailureHold: 10 * time.Minute}))
	h.client = h.d.NewClient()
	h.serve(func(_ context.Context, task *asynq.Task) error {
		if decodeJob(task).Key == "bad" {
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	ok := h.enqueue(jobTask("ok", 1))
	bad := h.enqueue(jobTask("bad", 1))
	eventually(t, "both settled", func() bool { s := h.d.Stats(); return s.Cooling == 1 && s.FailureHeld == 1 })
	_, err := h.client.Enqueue(jobTask("ok", 2), asynq.Queue(h.queue))
	var d *DuplicateTaskError
	if !errors.As(err, &d) || !d.CoolingDown || d.TaskID != ok.ID || d.FreeIn < 59*time.Minute || d.FreeIn > time.Hour {
		t.Errorf("after success: %v, want cooling after %s for about the hour of the cooldown", err, ok.ID)
	}
	if d := failedDup(t, h.client, jobTask("bad", 2), h.queue, bad.ID); d.FreeIn > 10*time.Minute || d.FreeIn < 9*time.Minute {
		t.Errorf("after failure: FreeIn %v, want the 10m of FailureHold", d.FreeIn)
	}
}

// A failure whose lock owes a RunningDefer follow-up hands the key to the
// follow-up, which runs; its success frees the key.
func TestFailureHandsTheKeyToTheDeferFollowUp(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnConflict: Replace, OnRunning: RunningDefer, OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	release := make(chan struct{})
	ran := make(chan int, 4)
	h.serve(func(_ context.Context, task *asynq.Task) error {
		n := decodeJob(task).N
		ran <- n
		if n == 1 {
			<-release
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	h.enqueue(jobTask("d", 1))
	if n := waitFor(t, ran, "the first run"); n != 1 {
		t.Fatalf("ran %d", n)
	}
	res, err := h.client.Submit(context.Background(), jobTask("d", 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("Submit while running: %+v %v, want a follow-up", res, err)
	}
	close(release)
	if n := waitFor(t, ran, "the follow-up"); n != 2 {
		t.Fatalf("ran %d, want the follow-up's payload", n)
	}
	eventually(t, "the key frees after the follow-up's success", func() bool {
		_, err := h.client.Enqueue(jobTask("d", 3), asynq.Queue(h.queue))
		return err == nil
	})
	if s := h.d.Stats(); s.FailureHeld != 0 {
		t.Errorf("failure_held %d, want 0 (the key went to the follow-up)", s.FailureHeld)
	}
}

// An operator releases a failed hold while the archived task runs again by
// hand; a new task takes the key. The re-run failing again must not hold
// the new task's key as its own failure.
func TestFailHoldReleasedWhileTheTaskRunsAgainSparesTheNewTasksKey(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	rerun := make(chan struct{})
	ran := make(chan run, 8)
	var attempts sync.Map
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- run{id: id, task: task}
		n, _ := attempts.LoadOrStore(id, new(atomic.Int32))
		if decodeJob(task).N == 1 {
			if n.(*atomic.Int32).Add(1) == 2 {
				<-rerun // the run by hand waits
			}
			return fmt.Errorf("still broken: %w", asynq.SkipRetry)
		}
		return nil
	}, nil)
	a := h.enqueue(jobTask("r", 1), asynq.Retention(time.Hour))
	waitFor(t, ran, "the failing run")
	eventually(t, "archived and held", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	if err := h.insp.RunTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the run by hand")
	if ok, err := h.d.Release(context.Background(), jobTask("r", 0), a.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release during the run by hand: %v %v", ok, err)
	}
	b := h.enqueue(jobTask("r", 2))
	if r := waitFor(t, ran, "the new task"); r.id != b.ID {
		t.Fatalf("ran %s, want %s", r.id, b.ID)
	}
	close(rerun)
	eventually(t, "the run by hand failed again", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
	eventually(t, "settled", func() bool { s := h.d.Stats(); return s.Released+s.FailureHeld+s.LockLost >= 3 })
	kl, found, err := h.d.Lookup(context.Background(), jobTask("r", 3), asynq.Queue(h.queue))
	if err != nil || (found && kl.State == "failed") {
		t.Fatalf("after the new task succeeded and the released re-run failed: %+v %v %v, want no failed hold", kl, found, err)
	}
}

// A failed hold does not keep a MaxPending slot: the key's task is not
// waiting.
func TestFailureHoldsDoNotFillMaxPending(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{MaxPending: 1, OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	a := h.enqueue(jobTask("a", 1))
	eventually(t, "held", func() bool { return h.d.Stats().FailureHeld == 1 })
	failedDup(t, h.client, jobTask("a", 2), h.queue, a.ID)
	if _, err := h.client.Enqueue(jobTask("b", 1), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("a new key with the only other key held after its failure: %v", err)
	}
	failedDup(t, h.client, jobTask("a", 3), h.queue, a.ID)
}

// An operator deletes the archived task that holds its key: the docs list
// only Release as the way out ("held until someone releases it"), and
// Lookup still says failed; Release still frees it.
func TestFailHoldSurvivesTheDeletionOfTheArchivedHolder(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	a := h.enqueue(jobTask("del", 1))
	eventually(t, "archived and held", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	failedDup(t, h.client, jobTask("del", 2), h.queue, a.ID)
	kl, found, _ := h.d.Lookup(context.Background(), jobTask("del", 2), asynq.Queue(h.queue))
	if !found || kl.State != "failed" {
		t.Fatalf("Lookup: %+v %v, want failed", kl, found)
	}
	if ok, err := h.d.Release(context.Background(), jobTask("del", 3), a.ID, asynq.Queue(h.queue)); !ok || err != nil {
		t.Fatalf("Release: %v %v", ok, err)
	}
	h.enqueue(jobTask("del", 4))
}

// An attempt on its last retry that asynq gives up at its deadline, with a
// handler that returns the context's error at once: held, failed, with an
// error that says so.
func TestFailHoldHoldsADeadlineOnTheLastRetry(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailureHold: time.Hour}))
	h.client = h.d.NewClient()
	h.serve(func(ctx context.Context, _ *asynq.Task) error { <-ctx.Done(); return ctx.Err() }, nil)
	info := h.enqueue(jobTask("dl", 1), asynq.MaxRetry(0), asynq.Timeout(time.Second))
	eventually(t, "held after asynq archived it", func() bool {
		_, err := h.client.Enqueue(jobTask("dl", 2), asynq.Queue(h.queue))
		var de *DuplicateTaskError
		return errors.As(err, &de) && de.Failed && de.TaskID == info.ID
	})
	kl, _, _ := h.d.Lookup(context.Background(), jobTask("dl", 3), asynq.Queue(h.queue))
	if kl.State != "failed" || kl.LastError == "" {
		t.Errorf("Lookup: %+v, want failed with an error", kl)
	}
}

// Period with Replace, a caller-chosen task ID and WrapClient: folds while
// the task waits, cools after its success for the rest of the window.
func TestPeriodWithReplaceAndACallerIDCoolsAfterSuccess(t *testing.T) {
	h := newHarness(t, jobRules(Rule{Period: 24 * time.Hour, OnConflict: Replace}))
	first := h.enqueue(jobTask("c", 1), asynq.TaskID("digest-c-1"))
	res, err := h.client.Submit(context.Background(), jobTask("c", 2), asynq.Queue(h.queue), asynq.TaskID("digest-c-2"))
	if err != nil || res.Outcome != Replaced || res.TaskID != first.ID {
		t.Fatalf("Submit while it waits: %+v %v", res, err)
	}
	ran := make(chan *asynq.Task, 2)
	h.serve(func(_ context.Context, task *asynq.Task) error { ran <- task; return nil }, nil)
	if n := decodeJob(waitFor(t, ran, "the run")).N; n != 2 {
		t.Fatalf("ran payload %d, want the replaced 2", n)
	}
	eventually(t, "cooling", func() bool { return h.d.Stats().Cooling == 1 })
	_, end := periodWindow(time.Now(), 24*time.Hour, nil)
	_, err = h.client.Enqueue(jobTask("c", 3), asynq.Queue(h.queue), asynq.TaskID("digest-c-3"))
	var d *DuplicateTaskError
	if !errors.As(err, &d) || !d.CoolingDown || d.TaskID != first.ID {
		t.Fatalf("enqueue after the success: %v, want cooling after %s", err, first.ID)
	}
	if left := time.Until(end); d.FreeIn > left+time.Second || d.FreeIn < left-time.Minute {
		t.Errorf("FreeIn %v, want until the window's end (%v)", d.FreeIn, left)
	}
}

// Register refuses a type whose rule has a Period (the firings' hold is a
// Cooldown), and accepts one whose rule holds failures (the Scheduler's
// FailHold overrides it).
func TestSchedulerRegisterChecksTheTypesRule(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"adv12:period": {Period: time.Hour},
		"adv12:held":   {OnFailure: FailHoldUntilReleased, MaxPending: 3},
	}})
	s := NewScheduler(h.d, nil)
	if _, err := s.Register("@hourly", asynq.NewTask("adv12:period", nil)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("a Period type: %v, want ErrInvalidOption", err)
	}
	if _, err := s.Register("@hourly", asynq.NewTask("adv12:held", nil)); err != nil {
		t.Errorf("a FailHoldUntilReleased type: %v", err)
	}
}

// Register, Unregister and Shutdown from many goroutines (run with -race):
// once Shutdown and every Unregister have returned, nothing is enqueued.
func TestSchedulerRegisterUnregisterAndShutdownRace(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				id, err := s.Register("@every 1s", asynq.NewTask("adv12:race", fmt.Appendf(nil, "%d-%d", g, i)), asynq.Queue(h.queue))
				if err != nil {
					t.Errorf("Register: %v", err)
					return
				}
				if i%2 == 0 {
					if err := s.Unregister(id); err != nil {
						t.Errorf("Unregister: %v", err)
					}
				}
			}
		})
	}
	wg.Go(func() { s.Shutdown() })
	wg.Wait()
	s.Shutdown()
	size := queueTasks(t, h)
	next := time.Now().Truncate(time.Second).Add(1500 * time.Millisecond)
	eventually(t, "a firing time has passed", func() bool { return time.Now().After(next) })
	if n := queueTasks(t, h); n != size {
		t.Errorf("%d tasks enqueued after Shutdown returned", n-size)
	}
	if err := s.Start(); err == nil {
		t.Error("Start after Shutdown: no error")
	}
}

// The window is the producer's clock at the enqueue: a task enqueued in
// one 1 s window that starts in the next keeps its own window's key (Lookup
// shows it), and once it succeeds after that window has ended its lock
// goes: nothing is left behind, and the new window is a new key.
func TestPeriodTaskThatStartsInTheNextWindowKeepsItsOwnWindow(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	opts := []asynq.Option{asynq.Queue(h.queue), Fields("key"), Period(time.Second, nil)}
	var (
		first *asynq.TaskInfo
		kl    KeyLock
		end   time.Time
	)
	for {
		var start time.Time
		start, end = periodWindow(time.Now(), time.Second, nil)
		var err error
		if first, err = h.client.Enqueue(jobTask("n", 1), opts...); err != nil {
			t.Fatal(err)
		}
		var found bool
		kl, found, err = h.d.Lookup(context.Background(), jobTask("n", 2), opts...)
		if time.Now().Before(end) {
			if err != nil || !found || kl.Holder != first.ID || !kl.WindowStart.Equal(start) || !kl.WindowEnd.Equal(end) || kl.State != "waiting" {
				t.Fatalf("Lookup: %+v %v %v, want waiting in [%v, %v)", kl, found, err, start, end)
			}
			break
		}
		// (crossed into the next window meanwhile: again)
	}
	ran := make(chan string, 2)
	eventually(t, "the window is over", func() bool { return time.Now().After(end) })
	h.serve(func(ctx context.Context, _ *asynq.Task) error { id, _ := asynq.GetTaskID(ctx); ran <- id; return nil }, nil)
	if id := waitFor(t, ran, "the run"); id != first.ID {
		t.Fatalf("ran %s", id)
	}
	eventually(t, "its lock is gone (its window is over)", func() bool { return len(h.locks()) == 0 })
	next, err := h.client.Enqueue(jobTask("n", 3), opts...)
	if err != nil || next.ID == first.ID {
		t.Fatalf("enqueue in a later window: %v %v", next, err)
	}
}

// Tasks that arrive without a lock (asynq's own client) are keyed by the
// server's rule: with a Period, the second arrival in the window after the
// first succeeded is dropped; with OnFailure, an arrival that fails for
// good holds its key, and the Client's enqueue meets the hold.
func TestPeriodAndOnFailureApplyToArrivalsWithoutALock(t *testing.T) {
	h := newHarness(t, Config{heartbeat: (3 * time.Second) / 3, Rules: map[string]Rule{
		"adv12:period": {Fields: []string{"key"}, Period: 24 * time.Hour},
		"adv12:fail":   {Fields: []string{"key"}, OnFailure: FailHoldUntilReleased},
	}})
	h.client = h.d.NewClient()
	ran := make(chan string, 4)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		if task.Type() == "adv12:fail" {
			return fmt.Errorf("no such account: %w", asynq.SkipRetry)
		}
		return nil
	}, nil)
	p1, err := h.asynq.Enqueue(asynq.NewTask("adv12:period", []byte(`{"key":"a","n":1}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the first arrival")
	eventually(t, "it cools", func() bool { return h.d.Stats().Cooling == 1 })
	_, err = h.asynq.Enqueue(asynq.NewTask("adv12:period", []byte(`{"key":"a","n":2}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the second arrival is dropped", func() bool { return h.d.Stats().Busy == 1 })
	select {
	case id := <-ran:
		t.Fatalf("the second arrival %s ran (first %s) in the same window", id, p1.ID)
	default:
	}
	f1, err := h.asynq.Enqueue(asynq.NewTask("adv12:fail", []byte(`{"key":"b"}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the failing arrival")
	eventually(t, "held", func() bool { return h.d.Stats().FailureHeld == 1 })
	failedDup(t, h.client, asynq.NewTask("adv12:fail", []byte(`{"key":"b","n":2}`)), h.queue, f1.ID)
	kl, _, _ := h.d.Lookup(context.Background(), asynq.NewTask("adv12:fail", []byte(`{"key":"b"}`)), asynq.Queue(h.queue))
	if kl.State != "failed" || !strings.Contains(kl.LastError, "no such account") {
		t.Errorf("Lookup: %+v", kl)
	}
}

// Two Schedulers in one process, on one Dedup, with the same entry: each
// firing runs once.
func TestSchedulerTwoInOneProcessRunEachFiringOnce(t *testing.T) {
	h := newHarness(t, Config{})
	var (
		mu    sync.Mutex
		runs  = map[string]int{} // firing → runs
		fresh = make(chan struct{}, 100)
	)
	h.serve(func(_ context.Context, task *asynq.Task) error {
		_, at, ok := SchedulerFiring(task)
		if !ok {
			t.Errorf("a task without the scheduler's headers")
		}
		mu.Lock()
		defer mu.Unlock()
		if runs[at.String()]++; runs[at.String()] == 1 {
			fresh <- struct{}{}
		}
		return nil
	}, nil)
	a := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	b := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	t.Cleanup(a.Shutdown)
	t.Cleanup(b.Shutdown)
	for _, s := range []*Scheduler{a, b} {
		if _, err := s.Register("@every 1s", asynq.NewTask("adv12:twice", nil), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, fresh, "a firing")
	waitFor(t, fresh, "another firing")
	a.Shutdown()
	b.Shutdown()
	eventually(t, "every task ran", func() bool {
		qi, err := h.insp.GetQueueInfo(h.queue)
		return err == nil && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0
	})
	mu.Lock()
	defer mu.Unlock()
	for at, n := range runs {
		if n != 1 {
			t.Errorf("firing %s ran %d times", at, n)
		}
	}
}
