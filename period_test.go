package dedup

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

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
		first, err := h.client.Enqueue(digest(1, 1), asynq.Queue(h.queue)) // (no retention: its record goes when it completes)
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, rc.runs, "the digest runs")
		eventually(t, "its record is gone", func() bool { return h.taskState(first.ID) == 0 })
		h.settled(1)
		start, end := periodWindow(time.Now(), 24*time.Hour, nil)
		_, err = h.client.Enqueue(digest(1, 2), asynq.Queue(h.queue))
		var dup *DuplicateTaskError
		if !errors.As(err, &dup) || !dup.CoolingDown || dup.TaskID != first.ID {
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
		if !errors.As(err, &dup) || dup.TaskID != first.ID {
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
	h.enqueue(digest(1, 1))
	waitFor(t, rc.runs, "the failing run")
	eventually(t, "released", func() bool { return h.d.Stats().Released == 1 })
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
