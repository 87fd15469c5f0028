package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

type releaseOutput struct {
	Released  bool     `json:"released"`
	Key       string   `json:"key"`
	Queue     string   `json:"queue"`
	Type      string   `json:"type"`
	Holder    string   `json:"holder"`
	State     string   `json:"state"` // the lock's state when released
	TaskState string   `json:"task_state"`
	TTLms     int64    `json:"ttl_ms"` // what was left
	FollowUp  string   `json:"follow_up,omitempty"`
	Notes     []string `json:"notes,omitempty"`
}

func releaseCommand() *command {
	return &command{
		name:     "release",
		synopsis: "[--yes] KEY | --task ID [--queue Q]",
		summary:  "force-release a lock (asks for confirmation unless --yes)",
		help: `Force-releases a lock: deletes it (and its entry in the type's waiting set)
so the key can be enqueued again. It asks on the terminal first; with --yes
it does not ask, and without a terminal it refuses unless --yes is given.

The delete is holder-safe: it happens only if the lock still has the holder
that was shown, so a lock that changed hands meanwhile is left alone.
Releasing deletes no task: a queued holder still runs, marked so that it
checks its key first when it starts (it takes the key if free; if a task of
its type has taken the key by then, it gives way to it, as docs/lifecycle.md
says under "A task locked at enqueue that meets a busy key"); a running holder goes on without the lock. An owed follow-up task
that waits is queued now (it carries the newest payload). Holds are released
too: a cooling key, a fail hold, a Scheduler firing's window.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			s := &selector{}
			s.register(fs, "to release")
			yes := fs.Bool("yes", false, "release without asking")
			return func(a *app, args []string) error { return runRelease(a, args, *s, *yes) }
		},
		maxArgs: 1,
	}
}

func runRelease(a *app, args []string, s selector, yes bool) error {
	return a.withLock(args, s, func(ctx context.Context, c *conn, t *lockview.Target, l *lockInfo) error {
		return release(a, ctx, c, t, l, yes)
	})
}

func release(a *app, ctx context.Context, c *conn, t *lockview.Target, l *lockInfo, yes bool) error {
	if t.Task != "" && t.Task != l.Holder {
		role := "does not hold it"
		if t.Task == l.FollowUp {
			role = "is its owed follow-up, not its holder"
		}
		return fmt.Errorf("not released: task %s %s (lock %s, holder %s); name the key to release it anyway", t.Task, role, l.Key, l.Holder)
	}
	if !yes {
		if err := a.confirm(l); err != nil {
			return err
		}
		fresh, cancel := a.ctx() // the answer may have taken a while
		defer cancel()
		ctx = fresh
		c.within(ctx)
	}
	res, err := lockview.Release(ctx, c.src(), a.g.prefix, l)
	if err != nil {
		return err
	}
	out := releaseOutput{Released: true, Key: l.Key, Queue: l.Queue, Type: l.Type, Holder: l.Holder, State: l.State,
		TaskState: l.TaskState, TTLms: l.TTLms, FollowUp: l.FollowUp, Notes: res.Notes}
	if a.g.json {
		return writeJSON(a.stdout, out)
	}
	fmt.Fprintf(a.stdout, "released %s (type %s, holder %s, %s, %s left)\n", l.Key, orDash(l.Type), l.Holder, l.State, l.TTL)
	for _, n := range out.Notes {
		fmt.Fprintf(a.stdout, "note: %s\n", n)
	}
	return nil
}

// confirm asks on stdin whether to release l; it refuses when stdin is not
// a terminal (pass --yes in scripts).
func (a *app) confirm(l *lockInfo) error {
	if f, ok := a.stdin.(*os.File); ok {
		fi, err := f.Stat()
		if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
			return errors.New("not released: stdin is not a terminal, so nobody can confirm; pass --yes to release without asking")
		}
	}
	w := a.stderr
	fmt.Fprintf(w, "lock   %s\ntype   %s\nholder %s (%s in asynq)\nstate  %s, %s left, %d folds\n", l.Key, orDash(l.Type), l.Holder, l.TaskState, l.State, l.TTL, l.Folds)
	if l.FollowUp != "" {
		fmt.Fprintf(w, "follow-up  %s\n", l.FollowUp)
	}
	fmt.Fprint(w, "Release this lock? [y/N] ")
	line, err := bufio.NewReader(a.stdin).ReadString('\n')
	if err != nil && (!errors.Is(err, io.EOF) || line == "") {
		fmt.Fprintln(w)
		return errors.New("not released: no answer on stdin; pass --yes to release without asking")
	}
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	return errors.New("not released: not confirmed")
}
