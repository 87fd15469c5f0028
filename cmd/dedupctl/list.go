package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

type listFlags struct {
	typ    string
	queue  string
	limit  int
	count  int64
	cursor string
}

func listCommand() *command {
	return &command{
		name:     "list",
		synopsis: "[--type T] [--queue Q] [--limit N] [--count N] [--cursor C]",
		summary:  "held locks: key, type, holder, queue, state, TTL left, folds",
		help: `Lists the held locks: key, task type, holder task ID, queue, state, TTL left
and folds (calls folded into the waiting task; follow-up task
when one is owed). State is the holder's in asynq: waiting, running or
retry-wait (asynq waits to retry the holder); or orphaned (the holder is gone,
completed or archived; the lock heals at the key's next enqueue); or a hold a
policy keeps past its holder: cooling (the holder succeeded and the key stays
held until the lock expires: Cooldown, Period; a Scheduler firing's window)
or failed (the holder failed for good: OnFailure). The type is the one the
key's mode record keeps (a key with modes), else the holder's in asynq: a
plain lock whose holder is gone shows none.

Reads with SCAN, page by page (never KEYS), on every master with --cluster,
two pipelined round trips per page. At most --limit locks are printed, in
whole SCAN pages (so a call may print fewer while more follow); then the last
line (or "next_cursor" in JSON) gives the --cursor to continue from. Like
SCAN itself, paging never misses a lock held throughout, and may show one
twice while Redis resizes its table.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			o := &listFlags{}
			fs.StringVar(&o.typ, "type", "", "only locks of this task `type`")
			fs.StringVar(&o.queue, "queue", "", "only locks of this `queue`")
			fs.IntVar(&o.limit, "limit", 100, "print at most `N` locks, 0 for all")
			fs.Int64Var(&o.count, "count", 200, "SCAN COUNT: keys Redis looks at per page")
			fs.StringVar(&o.cursor, "cursor", "", "continue from this `cursor` (printed by a previous list)")
			return func(a *app, _ []string) error { return runList(a, o) }
		},
	}
}

type listOutput struct {
	Prefix     string      `json:"prefix"`
	Type       string      `json:"type,omitempty"`
	Queue      string      `json:"queue,omitempty"`
	Locks      []*lockInfo `json:"locks"`
	Count      int         `json:"count"`
	Complete   bool        `json:"complete"`              // every master scanned to the end
	NextCursor string      `json:"next_cursor,omitempty"` // --cursor to go on with
}

func runList(a *app, o *listFlags) error {
	if o.limit < 0 {
		return usagef("--limit must be 0 (all) or positive, got %d", o.limit)
	}
	if o.count <= 0 {
		return usagef("--count must be positive, got %d", o.count)
	}
	ctx, cancel := a.ctx()
	defer cancel()
	c, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer c.close()
	s, err := lockview.NewScanner(ctx, c.src(), a.g.prefix, lockview.Filter{Type: o.typ, Queue: o.queue}, o.count)
	if err != nil {
		return err
	}
	start, err := s.DecodeCursor(o.cursor)
	if err != nil {
		return err
	}
	locks, next, done, err := s.Collect(ctx, start, o.limit)
	if err != nil {
		return err
	}
	lockview.SortLocks(locks)
	for _, l := range locks {
		l.Fields = nil
	}
	out := listOutput{Prefix: a.g.prefix, Type: o.typ, Queue: o.queue, Locks: locks, Count: len(locks), Complete: done}
	if out.Locks == nil {
		out.Locks = []*lockInfo{}
	}
	if !done {
		out.NextCursor = s.EncodeCursor(next)
	}
	if a.g.json {
		return writeJSON(a.stdout, out)
	}
	printList(a.stdout, out)
	return nil
}

func printList(w io.Writer, out listOutput) {
	what := "locks"
	var filters []string
	if out.Type != "" {
		filters = append(filters, "type "+out.Type)
	}
	if out.Queue != "" {
		filters = append(filters, "queue "+out.Queue)
	}
	if len(filters) > 0 {
		what += " of " + strings.Join(filters, ", ")
	}
	if len(out.Locks) == 0 {
		if out.Complete {
			fmt.Fprintf(w, "no %s held under prefix %q\n", what, out.Prefix)
		} else {
			fmt.Fprintf(w, "no %s on this page; more may follow: --cursor %s\n", what, out.NextCursor)
		}
		return
	}
	follow := false
	for _, l := range out.Locks {
		follow = follow || l.FollowUp != ""
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := "KEY\tTYPE\tHOLDER\tQUEUE\tSTATE\tTTL\tFOLDS"
	if follow {
		head += "\tFOLLOW-UP"
	}
	fmt.Fprintln(tw, head)
	for _, l := range out.Locks {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d", text(l.Key), orDash(l.Type), text(l.Holder), text(l.Queue), l.State, l.TTL, l.Folds)
		if follow {
			fmt.Fprintf(tw, "\t%s", orDash(l.FollowUp))
		}
		fmt.Fprintln(tw)
	}
	_ = tw.Flush()
	if out.Complete {
		fmt.Fprintf(w, "%d %s\n", len(out.Locks), plural(len(out.Locks), "lock", "locks"))
	} else {
		fmt.Fprintf(w, "%d %s shown; more may follow: add --cursor %s\n", len(out.Locks), plural(len(out.Locks), "lock", "locks"), out.NextCursor)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return text(s)
}

// text prints a name read from Redis (a type, an ID, a key) as one visible
// token: with a control character (a newline, a tab) it is quoted, so that
// it can neither forge lines nor columns.
func text(s string) string { return lockview.Printable(s) }

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
