package lockview

import (
	"context"
	"fmt"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Finding is one lock whose holder cannot run (or an orphan left alone), or
// a key with no lock that owes a follow-up (store.ProblemOwed).
type Finding struct {
	Key       string `json:"key"`
	Queue     string `json:"queue"`
	Type      string `json:"type"`
	Holder    string `json:"holder"`
	TaskState string `json:"task_state"`
	Problem   string `json:"problem"` // gone, lost or owed
	Detail    string `json:"detail"`
	Released  bool   `json:"released,omitempty"`
	FollowUp  string `json:"follow_up_queued,omitempty"` // the owed follow-up that took the key, queued now
	Error     string `json:"error,omitempty"`            // why the fix did not release it

	lock *store.Lock
}

// ProblemOwed is the problem of a key with no lock that owes a follow-up
// which still waits (store.ProblemOwed): fixing it queues the follow-up.
const ProblemOwed = store.ProblemOwed

// Report is what Doctor found.
type Report struct {
	Prefix   string    `json:"prefix"`
	Checked  int       `json:"checked"`
	Findings []Finding `json:"findings"`
	Released int       `json:"released"`
	Grace    string    `json:"grace"`
	Young    []Finding `json:"left_alone"` // orphans younger than the grace: not released

	grace time.Duration
}

// Doctor checks every lock of prefix that passes f against its holder's
// record (store.Diagnose), and every mode record for a follow-up owed by a
// key whose lock is gone (store.DiagnoseOwed), and, with fix, releases
// those no task and no policy keeps: the holder cannot run, and the key is
// not held on purpose (a cooldown, a fail hold, a firing's window),
// holder-checked (store.ReleaseStuck), which queues an owed follow-up
// that waits.
func Doctor(ctx context.Context, src Source, prefix string, f Filter, grace time.Duration, fix bool) (*Report, error) {
	s, err := NewScanner(ctx, src, prefix, f, 500)
	if err != nil {
		return nil, err
	}
	var ls []*store.Lock
	if err := s.Each(ctx, func(l *Info) { ls = append(ls, l.lock) }); err != nil {
		return nil, err
	}
	ds, young, err := store.Diagnose(ctx, src.RDB, ls, grace, time.Now())
	if err != nil {
		return nil, err
	}
	out := &Report{Prefix: prefix, Checked: len(ls), Findings: []Finding{}, Grace: FmtDuration(grace), Young: []Finding{}, grace: grace}
	for _, d := range young {
		f := findingOf(d)
		f.Detail += fmt.Sprintf(", lock younger than --grace %s: its task may not be stored yet", out.Grace)
		out.Young = append(out.Young, f)
	}
	for _, d := range ds {
		out.Findings = append(out.Findings, findingOf(d))
	}
	if err := s.EachKeys(ctx, store.NewKeys(prefix).ModePattern(f.Queue), func(keys []string) error {
		return out.addOwed(ctx, src, keys, f)
	}); err != nil {
		return nil, err
	}
	if fix {
		out.Fix(ctx, src, func(*Finding) bool { return true })
	}
	return out, nil
}

// Fix releases the findings that keep selects, holder-checked and only if
// their holder still cannot run and no policy holds the key
// (store.ReleaseStuck), and records each outcome in its finding.
func (r *Report) Fix(ctx context.Context, src Source, keep func(*Finding) bool) {
	for i := range r.Findings {
		f := &r.Findings[i]
		if !keep(f) {
			continue
		}
		fixOne(ctx, src, r.grace, f.lock, f)
		if f.Released {
			r.Released++
		}
	}
}

// fixOne releases one lock found stuck, and records the outcome in f.
func fixOne(ctx context.Context, src Source, grace time.Duration, l *store.Lock, f *Finding) {
	res, err := store.ReleaseKey(ctx, src.RDB, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: store.ReleaseStuck, Holder: l.Owner, Grace: grace})
	switch {
	case err != nil:
		f.Error = err.Error()
	case res.Released:
		f.Released, f.FollowUp = true, res.Queued
	case res.Kept != "":
		f.Error = "kept: " + keptWhy(res.Kept)
	case res.Holder == "":
		f.Error = "gone meanwhile"
	default:
		f.Error = "changed holder meanwhile, to " + res.Holder
	}
}

// keptWhy says why the release script kept a lock found stuck (its reply
// to store.ReleaseStuck: the kind of hold, or the holder's state).
func keptWhy(kept string) string {
	switch kept {
	case string(store.HoldCooling):
		return "it cools down (Cooldown, Period)"
	case string(store.HoldFiring):
		return "a Scheduler firing's window holds it"
	case store.LockFailed:
		return "a fail hold (OnFailure)"
	case "reserved":
		return "taken before its task was stored, less than the grace (at least 1s) ago: its task may not be stored yet"
	}
	return "its holder is " + kept + " now, and can run"
}

// addOwed adds the keys owing a follow-up among the mode records at keys
// that pass f (store.DiagnoseOwed).
func (r *Report) addOwed(ctx context.Context, src Source, keys []string, f Filter) error {
	owed, err := store.DiagnoseOwed(ctx, src.RDB, store.NewKeys(r.Prefix), keys)
	if err != nil {
		return err
	}
	for _, o := range owed {
		l := o.Lock
		if (f.Type == "" || l.Type == f.Type) && (f.Queue == "" || l.Queue == f.Queue) {
			r.Findings = append(r.Findings, Finding{Key: l.Key, Queue: l.Queue, Type: l.Type, Holder: l.Owner, TaskState: l.TaskState,
				Problem: ProblemOwed, Detail: o.Detail, lock: l})
		}
	}
	return nil
}

// findingOf presents one diagnosis.
func findingOf(d store.Diagnosis) Finding {
	l := d.Lock
	return Finding{Key: l.Key, Queue: l.Queue, Type: l.Type, Holder: l.Owner, TaskState: l.TaskState, Problem: d.Problem, Detail: d.Detail, lock: l}
}
