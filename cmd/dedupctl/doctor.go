package main

import (
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

func doctorCommand() *command {
	return &command{
		name:     "doctor",
		synopsis: "[--fix] [--grace D] [--type T] [--queue Q]",
		summary:  "find locks whose owner cannot run (gone, or in no list); release them with --fix",
		help: `Checks every lock (on every master with --cluster) against its owner task's
record in asynq and reports the locks whose owner cannot run:

  gone  the owner's record is missing, completed or archived, and the lock is
        not cooling down (Rule.Cooldown): an orphan. The key's next enqueue
        heals it anyway; doctor finds the ones nobody enqueues.
  lost  the owner's record says pending, scheduled, retry or active, but the
        list or set of that state does not hold it, so asynq never runs it:
        what a forced slot migration (redis-cli --cluster fix with REPLACE) or
        a lossy failover leaves behind. The lock would refuse its key until
        it expires; healing does not apply, as the record looks alive.

A lock younger than --grace whose owner is gone is left alone unless it was
written with its task (its task may not be stored yet): doctor lists it
apart, as left alone, and --fix does not release it. With --fix each lock
found is released owner-checked, as "release --yes" does; the tasks are left
as they are (a lost task's record stays for you to inspect or re-enqueue),
but for a follow-up the lock owes (RunningDefer) that still waits: it takes
the key and is queued now, as the end of its owner's run would have done.
Exit status 0 whether or not locks were found.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			o := &doctorFlags{}
			fs.BoolVar(&o.fix, "fix", false, "release the locks found")
			fs.DurationVar(&o.grace, "grace", time.Minute, "leave orphans younger than this alone (Config.HealGrace)")
			fs.StringVar(&o.typ, "type", "", "only locks of this task `type`")
			fs.StringVar(&o.queue, "queue", "", "only locks of this `queue`")
			return func(a *app, _ []string) error { return runDoctor(a, o) }
		},
	}
}

type doctorFlags struct {
	fix        bool
	grace      time.Duration
	typ, queue string
}

type doctorFinding struct {
	Key       string `json:"key"`
	Queue     string `json:"queue"`
	Type      string `json:"type"`
	Owner     string `json:"owner"`
	TaskState string `json:"task_state"`
	Problem   string `json:"problem"` // gone or lost
	Detail    string `json:"detail"`
	Released  bool   `json:"released,omitempty"`
	FollowUp  string `json:"follow_up_queued,omitempty"` // the owed follow-up that took the key, queued now
	Error     string `json:"error,omitempty"`            // why --fix did not release it
}

type doctorOutput struct {
	Prefix   string          `json:"prefix"`
	Checked  int             `json:"checked"`
	Findings []doctorFinding `json:"findings"`
	Released int             `json:"released"`
	Grace    string          `json:"grace"`
	Young    []doctorFinding `json:"left_alone"` // orphans younger than --grace: not released
}

func runDoctor(a *app, o *doctorFlags) error {
	ctx, cancel := a.ctx()
	defer cancel()
	c, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer c.close()
	s, err := newScanner(ctx, c, a.g.prefix, scanFilter{typ: o.typ, queue: o.queue}, 500)
	if err != nil {
		return err
	}
	var ls []*store.Lock
	if err := s.each(ctx, func(l *lockInfo) { ls = append(ls, l.lock) }); err != nil {
		return err
	}
	ds, young, err := store.Diagnose(ctx, c.rdb, ls, o.grace, time.Now())
	if err != nil {
		return err
	}
	out := doctorOutput{Prefix: a.g.prefix, Checked: len(ls), Findings: []doctorFinding{}, Grace: fmtDuration(o.grace), Young: []doctorFinding{}}
	for _, d := range young {
		f := findingOf(d)
		f.Detail += fmt.Sprintf(", lock younger than --grace %s: its task may not be stored yet", out.Grace)
		out.Young = append(out.Young, f)
	}
	for _, d := range ds {
		l, f := d.Lock, findingOf(d)
		if o.fix {
			res, err := store.ReleaseStuck(ctx, c.rdb, store.NewKeys(a.g.prefix), l)
			switch {
			case err != nil:
				f.Error = err.Error()
			case res.Released:
				f.Released, f.FollowUp = true, res.FollowUp
				out.Released++
			case res.Gone:
				f.Error = "gone meanwhile"
			case res.Runnable != "":
				f.Error = "its owner can run now (" + res.Runnable + ")"
			default:
				f.Error = "changed owner meanwhile, to " + res.Owner
			}
		}
		out.Findings = append(out.Findings, f)
	}
	if a.g.json {
		return writeJSON(a.stdout, out)
	}
	printDoctor(a.stdout, out, o.fix)
	return nil
}

// findingOf presents one diagnosis.
func findingOf(d store.Diagnosis) doctorFinding {
	l := d.Lock
	return doctorFinding{Key: l.Key, Queue: l.Queue, Type: l.Type, Owner: l.Owner, TaskState: l.TaskState, Problem: d.Problem, Detail: d.Detail}
}

func printDoctor(w io.Writer, out doctorOutput, fix bool) {
	if len(out.Findings)+len(out.Young) > 0 {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "KEY\tTYPE\tOWNER\tPROBLEM\tDETAIL")
		for _, f := range out.Young {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s; left alone\n", text(f.Key), orDash(f.Type), text(f.Owner), f.Problem, text(f.Detail))
		}
		for _, f := range out.Findings {
			detail := f.Detail
			switch {
			case f.Released && f.FollowUp != "":
				detail += "; released to its follow-up " + f.FollowUp + ", queued now"
			case f.Released:
				detail += "; released"
			case f.Error != "":
				detail += "; not released: " + f.Error
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", text(f.Key), orDash(f.Type), text(f.Owner), f.Problem, text(detail))
		}
		_ = tw.Flush()
	}
	n := len(out.Findings)
	fmt.Fprintf(w, "%d %s checked, %d %s owner cannot run", out.Checked, plural(out.Checked, "lock", "locks"), n, plural(n, "lock whose", "locks whose"))
	if y := len(out.Young); y > 0 {
		fmt.Fprintf(w, ", %d %s younger than --grace %s left alone", y, plural(y, "orphan", "orphans"), out.Grace)
	}
	switch {
	case fix:
		fmt.Fprintf(w, ", %d released\n", out.Released)
	case n > 0:
		fmt.Fprintf(w, "; run with --fix to release %s\n", plural(n, "it", "them"))
	default:
		fmt.Fprintln(w)
	}
}
