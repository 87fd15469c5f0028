package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

// selector names a lock: by key, or by a task ID (and queue).
type selector struct {
	task  string
	queue string
}

func (s *selector) register(fs *flag.FlagSet, verb string) {
	fs.StringVar(&s.task, "task", "", "find the lock "+verb+" by asynq task `ID` instead of KEY")
	fs.StringVar(&s.queue, "queue", "", "with --task: the task's `queue` (default: search asynq's queues)")
}

// check refuses a command line that names no lock, or names it twice.
func (s selector) check(args []string) error {
	switch {
	case len(args) == 1 && s.task != "":
		return usagef("give KEY or --task, not both")
	case len(args) == 0 && s.task == "":
		return usagef("missing argument: KEY (or --task ID [--queue Q])")
	case s.queue != "" && s.task == "":
		return usagef("--queue goes with --task; KEY names its queue itself")
	}
	return nil
}

// byKey is the lock KEY names, refused (a usage error) before Redis is
// asked when KEY is not a lock key; nil with --task, whose lock only Redis
// can tell (resolve).
func (a *app) byKey(args []string, s selector) (*lockview.Target, error) {
	if err := s.check(args); err != nil || s.task != "" {
		return nil, err
	}
	return lockview.ByKey(a.g.prefix, args[0])
}

// resolve is the lock t names (byKey's), or the one --task/--queue names.
func (a *app) resolve(ctx context.Context, c *conn, t *lockview.Target, s selector) (*lockview.Target, error) {
	if t != nil {
		return t, nil
	}
	return lockview.ByTask(ctx, c.src(), a.g.prefix, s.task, s.queue)
}

func showCommand() *command {
	return &command{
		name:     "show",
		synopsis: "KEY | --task ID [--queue Q]",
		summary:  "one lock in full, and whether its holder task still exists in asynq",
		help: `Shows one lock in full: every field, TTL left, and what asynq says about its
holder task (and its owed follow-up). A holder that is missing, completed or
archived means the lock is orphaned: the library heals it at the key's next
enqueue.

KEY is a lock key, ` + lockKeyForm + `, as list prints
it. With --task the lock is found from a task ID: the task's asynq record
names its lock.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			s := &selector{}
			s.register(fs, "to show")
			return func(a *app, args []string) error { return runShow(a, args, *s) }
		},
		maxArgs: 1,
	}
}

func runShow(a *app, args []string, s selector) error {
	return a.withLock(args, s, func(ctx context.Context, c *conn, t *lockview.Target, l *lockInfo) error {
		out, err := lockview.Describe(ctx, c.src(), a.g.prefix, l, t)
		if err != nil {
			return err
		}
		if a.g.json {
			return writeJSON(a.stdout, out)
		}
		printShow(a.stdout, out, time.Now())
		return nil
	})
}

func printShow(w io.Writer, o *showOutput, now time.Time) {
	row := func(k, v string) { fmt.Fprintf(w, "%-17s%s\n", k, text(v)) }
	row("key", o.Key)
	row("queue", o.Queue)
	if o.Node != "" {
		row("node", o.Node)
	}
	row("fingerprint", o.Fingerprint)
	row("type", orDash(o.Type))
	row("keyed on", orDash(o.KeyedOn))
	row("state", o.State)
	row("holder", o.Holder)
	row("holder in asynq", o.HolderTask.Note)
	switch o.TaskRole {
	case "follow-up":
		row("--task", o.Task+" is the owed follow-up, not the holder")
	case "other":
		row("--task", o.Task+" does not hold this lock")
	}
	if o.Hold != "" {
		row("value", o.Hold)
	}
	if o.Created > 0 {
		c := time.Unix(o.Created, 0).UTC()
		row("taken", c.Format(time.RFC3339)+" ("+fmtDuration(now.Sub(c))+" ago, before its task was stored)")
	}
	row("TTL left", o.TTL)
	row("folds", fmt.Sprintf("%d", o.Folds))
	printPolicies(row, o, now)
}

// printPolicies prints, in words, what the key's mode record says, or that
// it has none: then the lock is its holder's alone, and its state the
// holder's. The record's raw fields are for --json (fields).
func printPolicies(row func(k, v string), o *showOutput, now time.Time) {
	if o.FollowUpTask != nil {
		row("follow-up", o.FollowUpTask.ID+": "+o.FollowUpTask.Note)
	}
	for _, r := range [][2]string{{"while running", o.RunningPolicy}, {"payload version", o.PayloadVersion},
		{"cooldown left", lockview.CooldownLeft(&o.Info, now)}, {"on failure", o.OnFailure}, {"last error", o.LastError},
		{"window", o.Window}, {"waiting set", o.WaitingSet}} {
		if r[1] != "" {
			row(r[0], r[1])
		}
	}
	if o.ModeKey == "" {
		row("mode record", "none: a plain lock, whose state is its holder's in asynq")
		return
	}
	row("mode record", o.ModeKey)
}
