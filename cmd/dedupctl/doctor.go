package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

func doctorCommand() *command {
	return &command{
		name:     "doctor",
		synopsis: "[--fix] [--grace D] [--type T] [--queue Q]",
		summary:  "find locks whose holder cannot run (gone, or in no list), and follow-ups owed by keys with no lock; release them with --fix",
		help: `Checks every lock (on every master with --cluster) against its holder task's
record in asynq and reports the locks whose holder cannot run:

  gone  the holder's record is missing, completed or archived: an orphan. The
        key's next enqueue heals it anyway; doctor finds the ones nobody
        enqueues.
  lost  the holder's record says pending, scheduled, retry or active, but the
        list or set of that state does not hold it, so asynq never runs it:
        what a forced slot migration (redis-cli --cluster fix with REPLACE) or
        a lossy failover leaves behind. The lock would refuse its key until
        it expires; healing does not apply, as the record looks alive.
  owed  no lock, but the key's mode record names a follow-up (RunningDefer)
        that still waits, owed by a holder that cannot run (missing,
        completed or archived): the owed signal missed that the holder's
        run made it, and it waits until its parking time. Doctor scans the
        mode records for these, beside the locks.

A lock a policy keeps past its task is never found, whatever its holder's
state: a cooling key (Cooldown, Period), a fail hold (OnFailure: an
archived holder whose error the key keeps) and a Scheduler firing's window;
release them by hand. A lock taken before its task was stored (WrapClient)
whose holder has no record and that is younger than --grace is left alone
(its task may not be stored yet): doctor lists it apart, as left alone, and
--fix does not release it. With --fix each lock found is released
holder-checked, and only while its holder still cannot run and no policy
keeps it (checked again as it is released); the tasks are left
as they are (a lost task's record stays for you to inspect or re-enqueue),
but for a follow-up the lock owes (RunningDefer) that still waits: it takes
the key and is queued now, as the end of its holder's run would have done.
An owed key's follow-up is queued now too, and takes the key.
Exit status 0 whether or not locks were found.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			o := &doctorFlags{}
			fs.BoolVar(&o.fix, "fix", false, "release the locks found")
			fs.DurationVar(&o.grace, "grace", time.Minute, "leave orphans younger than this alone (the library's heal grace, 1 minute)")
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

func runDoctor(a *app, o *doctorFlags) error {
	return a.withConn(func(ctx context.Context, c *conn) error {
		out, err := lockview.Doctor(ctx, c.src(), a.g.prefix, lockview.Filter{Type: o.typ, Queue: o.queue}, o.grace, o.fix)
		if err != nil {
			return err
		}
		if a.g.json {
			return writeJSON(a.stdout, out)
		}
		printDoctor(a.stdout, *out, o.fix)
		return nil
	})
}

func printDoctor(w io.Writer, out doctorOutput, fix bool) {
	if len(out.Findings)+len(out.Young) > 0 {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "KEY\tTYPE\tHOLDER\tPROBLEM\tDETAIL")
		for _, f := range out.Young {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s; left alone\n", text(f.Key), orDash(f.Type), text(f.Holder), f.Problem, text(f.Detail))
		}
		for _, f := range out.Findings {
			detail := f.Detail
			switch {
			case f.Released && f.FollowUp != "" && f.Problem == lockview.ProblemOwed:
				detail += "; follow-up " + f.FollowUp + " queued now"
			case f.Released && f.FollowUp != "":
				detail += "; released to its follow-up " + f.FollowUp + ", queued now"
			case f.Released:
				detail += "; released"
			case f.Error != "":
				detail += "; not released: " + f.Error
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", text(f.Key), orDash(f.Type), text(f.Holder), f.Problem, text(detail))
		}
		_ = tw.Flush()
	}
	printDoctorSummary(w, out, fix)
}

// printDoctorSummary prints doctor's last line: what it checked and found.
func printDoctorSummary(w io.Writer, out doctorOutput, fix bool) {
	owed := 0
	for _, f := range out.Findings {
		if f.Problem == lockview.ProblemOwed {
			owed++
		}
	}
	n, locks := len(out.Findings), len(out.Findings)-owed
	fmt.Fprintf(w, "%d %s checked, %d %s holder cannot run", out.Checked, plural(out.Checked, "lock", "locks"), locks, plural(locks, "lock whose", "locks whose"))
	if owed > 0 {
		fmt.Fprintf(w, ", %d %s with no lock", owed, plural(owed, "key owing a follow-up", "keys owing a follow-up"))
	}
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
