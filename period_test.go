package dedup

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

func mustZone(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Skipf("no time zone data for %s: %v", name, err)
	}
	return loc
}

func TestPeriodWindowsFollowTheCalendarOfTheirLocation(t *testing.T) {
	ny := mustZone(t, "America/New_York")
	kolkata := mustZone(t, "Asia/Kolkata")
	at := func(loc *time.Location, s string) time.Time {
		v, err := time.ParseInLocation("2006-01-02 15:04", s, loc)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, c := range []struct {
		name       string
		t          time.Time
		d          time.Duration
		loc        *time.Location
		start, end time.Time
	}{
		{"an hour, UTC", at(time.UTC, "2026-12-02 10:59"), time.Hour, nil, at(time.UTC, "2026-12-02 10:00"), at(time.UTC, "2026-12-02 11:00")},
		{"half hours from a half-hour offset", at(kolkata, "2026-12-02 10:44"), 30 * time.Minute, kolkata, at(kolkata, "2026-12-02 10:30"), at(kolkata, "2026-12-02 11:00")},
		{"a day that is 23 hours (DST starts)", at(ny, "2026-03-08 12:00"), 24 * time.Hour, ny, at(ny, "2026-03-08 00:00"), at(ny, "2026-03-09 00:00")},
		{"a day that is 25 hours (DST ends)", at(ny, "2026-11-01 23:30"), 24 * time.Hour, ny, at(ny, "2026-11-01 00:00"), at(ny, "2026-11-02 00:00")},
		{"a week starts on Monday", at(time.UTC, "2026-12-06 23:59"), 7 * 24 * time.Hour, nil, at(time.UTC, "2026-11-30 00:00"), at(time.UTC, "2026-12-07 00:00")},
		{"7 hours are cut at midnight", at(time.UTC, "2026-12-02 22:00"), 7 * time.Hour, nil, at(time.UTC, "2026-12-02 21:00"), at(time.UTC, "2026-12-03 00:00")},
		{"two days before 1970", at(time.UTC, "1969-12-31 12:00"), 48 * time.Hour, nil, at(time.UTC, "1969-12-30 00:00"), at(time.UTC, "1970-01-01 00:00")},
	} {
		start, end := periodWindow(c.t, c.d, c.loc)
		if !start.Equal(c.start) || !end.Equal(c.end) {
			t.Errorf("%s: window [%v, %v), want [%v, %v)", c.name, start, end, c.start, c.end)
		}
	}
}

// Property: a time lies in its window, windows are never empty, and the
// window that starts at a window's end follows it with no gap.
func TestPeriodWindowsTileTime(t *testing.T) {
	zones := []*time.Location{time.UTC, mustZone(t, "America/New_York"), mustZone(t, "Australia/Lord_Howe"), mustZone(t, "Asia/Kathmandu")}
	periods := []time.Duration{time.Second, 90 * time.Second, time.Hour, 5 * time.Hour, 24 * time.Hour, 3 * 24 * time.Hour, 7 * 24 * time.Hour}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		tm := time.Unix(rng.Int64N(4_000_000_000)-1_000_000_000, rng.Int64N(1e9))
		d, loc := periods[rng.IntN(len(periods))], zones[rng.IntN(len(zones))]
		start, end := periodWindow(tm, d, loc)
		if tm.Before(start) || !tm.Before(end) || !start.Before(end) {
			t.Fatalf("%v (%v in %v): window [%v, %v) does not hold it", tm, d, loc, start, end)
		}
		if next, _ := periodWindow(end, d, loc); !next.Equal(end) {
			t.Fatalf("%v (%v in %v): the window after [%v, %v) starts at %v", tm, d, loc, start, end, next)
		}
	}
}

func TestPeriodTakesTheKeyOncePerWindowWhateverBecomesOfTheTask(t *testing.T) {
	rule := Rule{Fields: []string{"user_id"}, Period: 24 * time.Hour}
	bothPaths(t, Config{Rules: map[string]Rule{"digest:weekly": rule}}, func(t *testing.T, h *harness) {
		rc := newRecorder(nil)
		h.serve(rc.handler(), nil)
		first, err := h.client.Enqueue(digest(1, 1), asynq.Queue(h.queue)) // (no retention of its own)
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, rc.runs, "the digest runs")
		// Gone with its success, or completed: NewClient's task is stored with a
		// Retention that keeps asynq's record of its success until the window ends.
		eventually(t, "asynq is done with it", func() bool { return h.finished(first.ID) })
		h.settled(1)
		start, end := periodWindow(time.Now(), 24*time.Hour, nil)
		_, err = h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.CoolingDown || dup.Holder != first.ID {
			t.Fatalf("enqueue after the success: %v, want cooling after %s", err, first.ID)
		}
		if left := time.Until(end); dup.FreeIn > left+time.Second || dup.FreeIn < left-time.Minute {
			t.Fatalf("FreeIn %v, want about %v (until the window ends)", dup.FreeIn, left)
		}
		kl, found, err := h.d.Lookup(context.Background(), digest(1, 3), asynq.Queue(h.queue))
		if err != nil || !found || kl.State != "cooling" || !kl.WindowStart.Equal(start) || !kl.WindowEnd.Equal(end) {
			t.Fatalf("Lookup: %+v %v %v, want cooling in window [%v, %v)", kl, found, err, start, end)
		}
		if _, err := h.client.Enqueue(digest(2, 1), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("another user's digest: %v", err)
		}
	})
}

func TestPeriodStartsANewKeyInTheNextWindow(t *testing.T) {
	h := newHarness(t, Config{})
	c := h.d.NewClient()
	opts := []asynq.Option{asynq.Queue(h.queue), Fields("user_id"), Period(time.Second, nil)}
	for {
		before := time.Now()
		_, end := periodWindow(before, time.Second, nil)
		first, err := c.Enqueue(digest(7, 1), opts...)
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Enqueue(digest(7, 2), opts...)
		if time.Now().After(end) {
			continue // the second call crossed into the next window: try again
		}
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || dup.Holder != first.ID {
			t.Fatalf("second enqueue in the window: %v, want held by %s", err, first.ID)
		}
		time.Sleep(time.Until(end)) // the window is wall-clock time: wait for it to end
		next, err := c.Enqueue(digest(7, 3), opts...)
		if err != nil || next.ID == first.ID {
			t.Fatalf("enqueue in the next window: %v %v, want a new task", next, err)
		}
		return
	}
}

func TestPeriodFreesTheKeyWhenItsTaskFailsForGood(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}, Period: 24 * time.Hour}}})
	h.client = h.d.NewClient()
	rc := newRecorder(func(run) error { return asynq.SkipRetry })
	h.serve(rc.handler(), nil)
	info := h.enqueue(digest(1, 1))
	waitFor(t, rc.runs, "the failing run")
	// (The middleware counts the release; asynq's archive is what frees the key.)
	eventually(t, "released and archived", func() bool {
		return h.d.Stats().Released == 1 && h.taskState(info.ID) == asynq.TaskStateArchived
	})
	if _, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after the failure: %v", err)
	}
}

func TestPeriodRefusesWhatItCannotKeep(t *testing.T) {
	for _, r := range []Rule{
		{Period: 500 * time.Millisecond},
		{Period: 25 * time.Hour},
		{Period: time.Hour, Cooldown: time.Minute},
		{Period: time.Hour, OnRunning: RunningAllow},
	} {
		_, err := New(context.Background(), newRDB(t), Config{Rules: map[string]Rule{"t": r}, Logger: quietLogger()})
		if !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%+v: %v, want ErrInvalidOption", r, err)
		}
	}
	h := newHarness(t, Config{})
	if _, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue), Period(36*time.Hour, nil)); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("Period(36h): %v, want ErrInvalidOption", err)
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left behind", n)
	}
}

// docs/policies.md: "Midnight is Location's ..., so days follow its
// daylight-saving changes (a 23- or 25-hour day)"; windows tile time. In
// zones whose daylight-saving time starts at midnight (America/Santiago,
// America/Havana), that midnight does not exist (time.Date normalises it to
// 23:00 the day before). A time in the evening before still lies in its own
// window, the next window starts where it ends, and a success then cools
// until the window's end. (Once, such a day window ended an hour early: a
// key taken in its last hour cooled for a millisecond, and a second task ran
// the same day.)
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

// Period + FailHoldUntilReleased: the hold ends with the window at the
// latest (the next window is another key), so no lock is left that no API
// can reach.
func TestPeriodFailHoldEndsWithItsWindow(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
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

// Bad per-call Period and OnFailure values fail with ErrInvalidOption on
// both enqueue paths and leave no lock and no task; the largest valid ones
// are taken, and bounded.
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
		"Period past MaxLifetime":        {Period(maxLifetime+24*time.Hour, nil)},
		"Period max int":                 {Period(time.Duration(1<<63-1), nil)},
		"Period with Cooldown":           {Period(time.Hour, nil), Cooldown(time.Minute)},
		"Period with RunningDefer rule":  {Period(time.Hour, nil), asynq.Queue("")},
		"Period, a good OnFailure after": {Period(time.Millisecond, nil), OnFailure(FailHold, time.Hour)},
	}
	for _, path := range []string{"wrap", "direct"} {
		h := newHarness(t, Config{Rules: map[string]Rule{"job:defer": {OnConflict: Replace, OnRunning: RunningDefer}}})
		if path == "direct" {
			h.client = h.d.NewClient()
		}
		for name, opts := range bad {
			task := jobTask(name, 1)
			if name == "Period with RunningDefer rule" {
				task, opts = asynq.NewTask("job:defer", []byte(`{}`)), opts[:1]
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
		info, err := h.client.Enqueue(jobTask("huge", 1), asynq.Queue(h.queue), Fields("key"), Period(maxLifetime/(24*time.Hour)*24*time.Hour, time.FixedZone("odd", 5*3600+1)), OnFailure(FailHold, time.Duration(1<<63-1)))
		if err != nil {
			t.Fatalf("%s: the largest Period and FailHold: %v", path, err)
		}
		kl, found, err := h.d.Lookup(context.Background(), jobTask("huge", 2), asynq.Queue(h.queue), Fields("key"), Period(maxLifetime/(24*time.Hour)*24*time.Hour, time.FixedZone("odd", 5*3600+1)))
		if err != nil || !found || kl.Holder != info.ID || kl.TTL <= 0 || kl.TTL > maxLifetime || !kl.WindowStart.Before(time.Now()) || !kl.WindowEnd.After(time.Now()) {
			t.Errorf("%s: Lookup of the largest Period: %+v %v %v", path, kl, found, err)
		}
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
	if !errors.As(err, &d) || !d.CoolingDown || d.Holder != first.ID {
		t.Fatalf("enqueue after the success: %v, want cooling after %s", err, first.ID)
	}
	if left := time.Until(end); d.FreeIn > left+time.Second || d.FreeIn < left-time.Minute {
		t.Errorf("FreeIn %v, want until the window's end (%v)", d.FreeIn, left)
	}
}

// The window is the producer's clock at the enqueue: a task enqueued in
// one 1 s window that starts in the next keeps its own window's key (Lookup
// shows it), and once it succeeds after that window has ended its lock
// goes: nothing is left behind, and the new window is a new key.
func TestPeriodTaskThatStartsInTheNextWindowKeepsItsOwnWindow(t *testing.T) {
	t.Parallel()
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
	// (Its lock is left, if it outlives the window: it heals at the next enqueue.)
	eventually(t, "asynq is done with it", func() bool { return h.finished(first.ID) })
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
		"job:period": {Fields: []string{"key"}, Period: 24 * time.Hour},
		"job:fail":   {Fields: []string{"key"}, OnFailure: FailHoldUntilReleased},
	}})
	h.client = h.d.NewClient()
	ran := make(chan string, 4)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- id
		if task.Type() == "job:fail" {
			return fmt.Errorf("no such account: %w", asynq.SkipRetry)
		}
		return nil
	}, nil)
	p1, err := h.asynq.Enqueue(asynq.NewTask("job:period", []byte(`{"key":"a","n":1}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the first arrival")
	eventually(t, "it cools", func() bool { return h.d.Stats().Cooling == 1 })
	_, err = h.asynq.Enqueue(asynq.NewTask("job:period", []byte(`{"key":"a","n":2}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the second arrival is dropped", func() bool { return h.d.Stats().Busy == 1 })
	select {
	case id := <-ran:
		t.Fatalf("the second arrival %s ran (first %s) in the same window", id, p1.ID)
	default:
	}
	f1, err := h.asynq.Enqueue(asynq.NewTask("job:fail", []byte(`{"key":"b"}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the failing arrival")
	heldAfterArchive(t, h, f1.ID)
	failedDup(t, h.client, asynq.NewTask("job:fail", []byte(`{"key":"b","n":2}`)), h.queue, f1.ID)
	kl, _, _ := h.d.Lookup(context.Background(), asynq.NewTask("job:fail", []byte(`{"key":"b"}`)), asynq.Queue(h.queue))
	if kl.State != "failed" || !strings.Contains(kl.LastError, "no such account") {
		t.Errorf("Lookup: %+v", kl)
	}
}

// "Once it succeeds, the key stays held until the window ends, whatever
// becomes of the task's record (retention, an operator's delete)": NewClient
// does not keep a Period key by asynq's record of the success (~k), which an
// operator's delete would end; with the task's own Retention, its completed
// record is deleted here.
func TestPeriodKeyStaysHeldWhenItsCompletedRecordIsDeleted(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{Rules: map[string]Rule{"digest:weekly": {Fields: []string{"user_id"}, Period: 24 * time.Hour}}})
	h.client = h.d.NewClient()
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	first := h.enqueue(digest(1, 1), asynq.Retention(time.Hour))
	waitFor(t, rc.runs, "the digest runs")
	eventually(t, "asynq records its success", func() bool { return h.taskState(first.ID) == asynq.TaskStateCompleted })
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue)); !errors.As(err, &dup) || !dup.CoolingDown {
		t.Fatalf("enqueue after the success: %v, want cooling", err)
	}
	if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	_, err := h.client.Enqueue(digest(1, 3), asynq.Queue(h.queue))
	if !errors.As(err, &dup) || !dup.CoolingDown {
		t.Fatalf("enqueue in the same window after the record was deleted: %v, want cooling until the window ends", err)
	}
}

// A Period task whose success comes after its deadline note (its handler
// still ran LockTimeout before its deadline): the window holds the key,
// counted cooling, and the note went with the handler.
func TestPeriodSuccessAfterTheDeadlineNoteHoldsTheWindow(t *testing.T) {
	t.Parallel()
	h, n := noteHarness(t, Rule{Period: 24 * time.Hour})
	h.serve(byAttempt(n, map[int]error{0: nil}, nil), retryInAnHour)
	info := h.enqueue(jobTask("w", 1), asynq.Timeout(3*time.Second))
	eventually(t, "asynq is done with it", func() bool { return h.finished(info.ID) })
	h.settled(1)
	_, err := h.client.Enqueue(jobTask("w", 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) || !dup.CoolingDown || dup.Holder != info.ID {
		t.Fatalf("enqueue in the window after the success: %v, want cooling after %s", err, info.ID)
	}
	if m := h.modeFields(h.keyOf(jobTask("w", 1), h.queue)); m["o"] != "" {
		t.Errorf("the note outlives the handler: %v", m)
	}
	if s := h.d.Stats(); s.Cooling != 1 || s.Released != 0 {
		t.Errorf("stats: cooling %d, released %d", s.Cooling, s.Released)
	}
}
