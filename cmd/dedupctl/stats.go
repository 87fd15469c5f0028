package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/lockview"
)

const noCounters = "no counters in Redis: start d.StartFlusher in your processes"

type statsOutput struct {
	Prefix string                       `json:"prefix"`
	Types  map[string]map[string]uint64 `json:"types"`  // type → event → total
	Totals map[string]uint64            `json:"totals"` // event → total over types
	Note   string                       `json:"note,omitempty"`
	Locks  lockCounts                   `json:"locks"`
	Top    []topKey                     `json:"top_folded"`
}

type lockCounts struct {
	Total   int            `json:"total"`
	ByState map[string]int `json:"by_state"`
}

type topKey struct {
	Key    string `json:"key"`
	Queue  string `json:"queue"`
	Type   string `json:"type"`
	Holder string `json:"holder"`
	Folds  int64  `json:"folds"`
}

func statsCommand() *command {
	return &command{
		name:     "stats",
		synopsis: "[--top N] [--count N]",
		summary:  "flushed counters per task type, and the live locks with the most folds",
		help: `Prints the counters that processes flushed to Redis (Dedup.StartFlusher,
read with dedup.ReadStats): every counter that --json prints, a row per
event, with its total per task type since the first flush. Then the live locks by state and the --top
locks with the most folds (calls folded into their task, field n), found by a full SCAN of
the lock keys (on every master with --cluster).`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			top := fs.Int("top", 10, "show the `N` live locks with the most folds")
			count := fs.Int64("count", 500, "SCAN COUNT: keys Redis looks at per page")
			return func(a *app, _ []string) error { return runStats(a, *top, *count) }
		},
	}
}

func runStats(a *app, top int, count int64) error {
	if top < 0 {
		return usagef("--top must not be negative, got %d", top)
	}
	if count <= 0 {
		return usagef("--count must be positive, got %d", count)
	}
	return a.withConn(func(ctx context.Context, c *conn) error {
		byType, err := dedup.ReadStats(ctx, c.rdb, a.g.prefix)
		if err != nil {
			return err
		}
		out := newStatsOutput(a.g.prefix, byType)
		if err := scanLockStats(ctx, c, a.g.prefix, count, top, &out); err != nil {
			return err
		}
		if a.g.json {
			return writeJSON(a.stdout, out)
		}
		printStats(a.stdout, out)
		return nil
	})
}

// newStatsOutput holds the flushed counters per type and their totals. Its
// maps and Top are never nil, so --json prints {} and [] rather than null.
func newStatsOutput(prefix string, byType map[string]dedup.Stats) statsOutput {
	out := statsOutput{
		Prefix: prefix,
		Types:  map[string]map[string]uint64{},
		Totals: map[string]uint64{},
		Locks:  lockCounts{ByState: map[string]int{}},
		Top:    []topKey{},
	}
	for typ, s := range byType {
		m := s.Map()
		out.Types[typ] = m
		for e, n := range m {
			out.Totals[e] += n
		}
	}
	if len(byType) == 0 {
		out.Note = noCounters
	}
	return out
}

// scanLockStats counts the live locks by state into out.Locks and keeps
// the top most folded ones in out.Top.
func scanLockStats(ctx context.Context, c *conn, prefix string, count int64, top int, out *statsOutput) error {
	s, err := lockview.NewScanner(ctx, c.src(), prefix, lockview.Filter{}, count)
	if err != nil {
		return err
	}
	err = s.Each(ctx, func(l *lockInfo) {
		out.Locks.Total++
		out.Locks.ByState[l.State]++
		if l.Folds <= 0 || top == 0 {
			return
		}
		out.Top = append(out.Top, topKey{Key: l.Key, Queue: l.Queue, Type: l.Type, Holder: l.Holder, Folds: l.Folds})
		if len(out.Top) > 4*top { // keep memory bounded on huge keyspaces
			out.Top = keepTop(out.Top, top)
		}
	})
	if err != nil {
		return err
	}
	out.Top = keepTop(out.Top, top)
	return nil
}

// keepTop returns the n most folded of t, most first.
func keepTop(t []topKey, n int) []topKey {
	sortTop(t)
	if len(t) > n {
		t = t[:n]
	}
	return t
}

func sortTop(t []topKey) {
	sort.Slice(t, func(i, j int) bool {
		if t[i].Folds != t[j].Folds {
			return t[i].Folds > t[j].Folds
		}
		return t[i].Key < t[j].Key
	})
}

func printStats(w io.Writer, o statsOutput) {
	printCounters(w, o)
	fmt.Fprintln(w)
	printLockCounts(w, o.Locks)
	printTop(w, o.Top)
}

// printCounters prints the flushed counters as a table: a row per event,
// every one of lockview.EventNames (the names --json keys its counters by),
// in that order; a column per task type, and their total.
func printCounters(w io.Writer, o statsOutput) {
	if len(o.Types) == 0 {
		fmt.Fprintln(w, noCounters)
		return
	}
	types := slices.Sorted(maps.Keys(o.Types))
	fmt.Fprintf(w, "Counters flushed to Redis under prefix %q (all processes, since the first flush):\n", o.Prefix)
	events := lockview.EventNames()
	// Numbers align right, event names left: pad the names to one width.
	width := len("EVENT")
	for _, e := range events {
		width = max(width, len(e))
	}
	pad := func(s string) string { return s + strings.Repeat(" ", width-len(s)) }
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, pad("EVENT"))
	for _, t := range types {
		fmt.Fprintf(tw, "\t%s", typeName(t))
	}
	if len(types) > 1 {
		fmt.Fprint(tw, "\tTOTAL")
	}
	fmt.Fprintln(tw, "\t")
	for _, e := range events {
		fmt.Fprint(tw, pad(e))
		for _, t := range types {
			fmt.Fprintf(tw, "\t%d", o.Types[t][e])
		}
		if len(types) > 1 {
			fmt.Fprintf(tw, "\t%d", o.Totals[e])
		}
		fmt.Fprintln(tw, "\t")
	}
	_ = tw.Flush()
}

func printLockCounts(w io.Writer, l lockCounts) {
	if l.Total == 0 {
		fmt.Fprintln(w, "Live locks: none")
		return
	}
	var parts []string
	for _, s := range slices.Sorted(maps.Keys(l.ByState)) {
		parts = append(parts, fmt.Sprintf("%d %s", l.ByState[s], s))
	}
	fmt.Fprintf(w, "Live locks: %d (%s)\n", l.Total, strings.Join(parts, ", "))
}

func printTop(w io.Writer, top []topKey) {
	if len(top) == 0 {
		fmt.Fprintln(w, "Top folded keys: no live lock has folds")
		return
	}
	fmt.Fprintln(w, "\nTop folded keys:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tTYPE\tHOLDER\tFOLDS")
	for _, t := range top {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", text(t.Key), orDash(t.Type), text(t.Holder), t.Folds)
	}
	_ = tw.Flush()
}

// typeName shows the type "" (breaker_open is counted under it).
func typeName(t string) string {
	if t == "" {
		return "(no type)"
	}
	return text(t)
}
