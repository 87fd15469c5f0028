package dedup

import (
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// Firing times: a Scheduler's entries are parsed as asynq's Scheduler
// parses them (robfig/cron v3's standard parser: five fields, descriptors
// such as @daily, "@every <duration>", a CRON_TZ= or TZ= prefix), and every
// replica computes the same times from them. One departure: asynq counts
// "@every d" in whole seconds from the moment its Scheduler starts, which
// differs from pod to pod, so replicas would not agree on a firing; here
// its firings are the multiples of d since the Unix epoch.

// schedule gives an entry's firing times.
type schedule interface {
	// next is the first firing strictly after t, or the zero time if
	// there is none (a spec that matches no date within five years).
	next(t time.Time) time.Time
	// canon is the schedule as the entry ID hashes it: the same for every
	// spelling of one schedule in one place ("@every 60s", "@every 1m").
	canon() string
}

// everySchedule fires at every multiple of d since the Unix epoch.
type everySchedule struct{ d time.Duration }

func (s everySchedule) next(t time.Time) time.Time {
	n := t.UnixNano()
	k := n / int64(s.d)
	if n < 0 && n%int64(s.d) != 0 {
		k-- // floor, before the epoch
	}
	return time.Unix(0, (k+1)*int64(s.d)).In(t.Location())
}

func (s everySchedule) canon() string { return "@every " + s.d.String() }

// cronSchedule is a cron spec evaluated in loc (the spec's own CRON_TZ,
// else the Scheduler's Location).
type cronSchedule struct {
	spec cron.Schedule
	loc  *time.Location
	text string // the spec without its time zone prefix, fields single-spaced
}

func (s cronSchedule) next(t time.Time) time.Time { return s.spec.Next(t.In(s.loc)) }

func (s cronSchedule) canon() string { return s.text + " in " + s.loc.String() }

// parseSchedule parses spec as asynq's Scheduler does, with loc for a spec
// that names no time zone. "@every d" rounds d down to whole seconds, at
// least one, as robfig/cron does.
func parseSchedule(spec string, loc *time.Location) (schedule, error) {
	s, err := cron.ParseStandard(spec)
	if err != nil {
		return nil, errorf("%w: cron spec %q: %w", ErrInvalidOption, spec, err)
	}
	switch v := s.(type) {
	case cron.ConstantDelaySchedule:
		return everySchedule{d: v.Delay}, nil
	case *cron.SpecSchedule:
		if v.Location != time.Local { // the spec named its zone (robfig's mark for none is time.Local)
			loc = v.Location
		}
		return cronSchedule{spec: v, loc: loc, text: strings.Join(strings.Fields(withoutZone(spec)), " ")}, nil
	}
	return nil, errorf("%w: cron spec %q: unknown schedule %T", ErrInvalidOption, spec, s)
}

// withoutZone strips a TZ= or CRON_TZ= prefix.
func withoutZone(spec string) string {
	spec = strings.TrimSpace(spec)
	if strings.HasPrefix(spec, "TZ=") || strings.HasPrefix(spec, "CRON_TZ=") {
		if i := strings.IndexByte(spec, ' '); i >= 0 {
			return spec[i+1:]
		}
	}
	return spec
}
