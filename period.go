package dedup

import (
	"fmt"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Period (uniqueness per calendar window): "at most one digest per user
// per day". The key includes the wall-clock window the enqueue falls in,
// so a key is taken at most once per window: later enqueues in the window
// meet its task (rejected or folded while it waits, rejected while it
// runs), and once it succeeds the key stays held until the window ends
// (*DuplicateTaskError with CoolingDown set, as a Cooldown), whatever
// becomes of the task's record. A new window is a new key. A task that
// fails for good frees the key, unless OnFail holds it. Unlike
// Cooldown, which counts from the take, a window is a fixed bucket of the
// calendar: a task taken at 23:59 does not block one at 00:01.
//
// Windows shorter than a day start at midnight and follow each other (a
// period that does not divide the day is cut short at the next midnight);
// windows of whole days start at midnight, weeks on Mondays, longer ones
// count from Monday 1970-01-05. Midnight is the Location's, so days and
// weeks follow its daylight-saving changes.
//
// The window is the producer's clock at the enqueue (the server's, for a
// task that arrives without a lock). Needs OnRunning RunningReject; not
// with Cooldown.

// Period sets this call's period (see Rule.Period), overriding the type's
// rule: the key is taken at most once per window of d in loc (nil: UTC).
// d is at least a second, and a whole number of days when a day or more.
// With Config.OptIn it opts the call in.
func Period(d time.Duration, loc *time.Location) asynq.Option {
	desc := fmt.Sprintf("dedup.Period(%v, %v)", d, loc)
	return option{desc: desc, apply: func(r *resolved) error {
		if err := checkPeriod(d); err != nil {
			return err
		}
		r.period, r.loc, r.optedIn = d, loc, true
		return nil
	}}
}

// checkPeriod refuses a period without whole windows.
func checkPeriod(d time.Duration) error {
	const day = 24 * time.Hour
	switch {
	case d < time.Second:
		return errorf("%w: Period %v is shorter than a second", ErrInvalidOption, d)
	case d > maxLifetime:
		return errorf("%w: Period %v is longer than 100 years", ErrInvalidOption, d)
	case d >= day && d%day != 0:
		return errorf("%w: Period %v is a day or more but not whole days", ErrInvalidOption, d)
	}
	return nil
}

// firstMonday is 1970-01-05, the Monday windows of whole days count from,
// in days since the Unix epoch.
const firstMonday = 4

// periodWindow returns the window of d in loc (nil: UTC) that t falls in.
func periodWindow(t time.Time, d time.Duration, loc *time.Location) (start, end time.Time) {
	if loc == nil {
		loc = time.UTC
	}
	t = t.In(loc)
	y, m, day := t.Date()
	if d >= 24*time.Hour {
		days := int64(d / (24 * time.Hour))
		n := time.Date(y, m, day, 0, 0, 0, 0, time.UTC).Unix()/86400 - firstMonday
		first := n - ((n%days)+days)%days + firstMonday // floored: n may be negative
		return dayStart(1970, 1, 1+int(first), loc), dayStart(1970, 1, 1+int(first+days), loc)
	}
	midnight := dayStart(y, m, day, loc)
	next := dayStart(y, m, day+1, loc)
	start = midnight.Add(t.Sub(midnight) / d * d)
	if end = start.Add(d); end.After(next) {
		end = next
	}
	return start, end
}

// dayStart is the first instant of a calendar day in loc (the day may be
// given out of range, as to time.Date): its midnight, or, where the clocks
// skip midnight (daylight saving starting at 00:00, as in Santiago), the
// instant they jump.
func dayStart(y int, m time.Month, day int, loc *time.Location) time.Time {
	y, m, day = time.Date(y, m, day, 12, 0, 0, 0, time.UTC).Date() // normalised
	onOrAfter := func(t time.Time) bool {
		ty, tm, td := t.In(loc).Date()
		return time.Date(ty, tm, td, 0, 0, 0, 0, time.UTC).Compare(time.Date(y, m, day, 0, 0, 0, 0, time.UTC)) >= 0
	}
	t := time.Date(y, m, day, 0, 0, 0, 0, loc)
	if onOrAfter(t) {
		return t // midnight, or the day's first instant after a skipped one
	}
	// time.Date gave an instant of the day before: the day starts at the
	// jump, within a few hours; found to the second.
	lo, hi := t, t.Add(4*time.Hour)
	for hi.Sub(lo) > time.Second/2 {
		if mid := lo.Add(hi.Sub(lo) / 2); onOrAfter(mid) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi.Truncate(time.Second) // (zone changes fall on whole seconds)
}

// settleWindow works out the window of a rule with a period at now: its
// key includes the window's start (fingerprint), and its lock cools down
// until the window's end.
func (r *resolved) settleWindow(now time.Time) {
	if r.period > 0 {
		r.window, r.windowEnd = periodWindow(now, r.period, r.loc)
	}
}

// lockTerms returns the cooldown and the window a lock taken now under r
// records: with a period, held after success until the window ends (in
// whole milliseconds from now's, so that the lock's end is the window's).
func (r *resolved) lockTerms(now time.Time) (cool time.Duration, w store.Window) {
	if r.period == 0 {
		return r.cooldown, w
	}
	w.Start, w.End = r.window, r.windowEnd
	if w.Start.IsZero() {
		w.Start, w.End = periodWindow(now, r.period, r.loc)
	}
	return time.Duration(max(w.End.UnixMilli()-now.UnixMilli(), 1)) * time.Millisecond, w
}
