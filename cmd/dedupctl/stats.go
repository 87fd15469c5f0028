package main

import (
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/asynq-dedup/dedup"
)

const noCounters = "no counters in Redis: start d.StartFlusher in your processes"

type statsOutput struct {
	Prefix string                       `json:"prefix"`
	Types  map[string]map[string]uint64 `json:"types"`  // type → event → total
	Totals map[string]uint64            `json:"totals"` // event → total over types
	Note   string                       `json:"note,omitempty"`
	Locks  lockCounts                   `json:"locks"`
	Top    []topKey                     `json:"top_coalesced"`
}

type lockCounts struct {
	Total   int            `json:"total"`
	ByState map[string]int `json:"by_state"`
}

type topKey struct {
	Key       string `json:"key"`
	Queue     string `json:"queue"`
	Type      string `json:"type"`
	Owner     string `json:"owner"`
	Coalesced int64  `json:"coalesced"`
}

func statsCommand() *command {
	return &command{
		name:     "stats",
		synopsis: "[--top N] [--count N]",
		summary:  "flushed counters per task type, and the most coalesced live locks",
		help: `Prints the counters that processes flushed to Redis (Dedup.StartFlusher,
read with dedup.ReadStats): totals per task type since the first flush, for
the events that happened at all. Then the live locks by state and the --top
locks with the most coalesced enqueues (field n), found by a full SCAN of
the lock keys (on every master with --cluster).`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			top := fs.Int("top", 10, "show the `N` most coalesced live locks")
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
	ctx, cancel := a.ctx()
	defer cancel()
	c, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer c.close()
	byType, err := dedup.ReadStats(ctx, c.rdb, a.g.prefix)
	if err != nil {
		return err
	}
	out := statsOutput{
		Prefix: a.g.prefix,
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

	s, err := newScanner(ctx, c, a.g.prefix, scanFilter{}, count)
	if err != nil {
		return err
	}
	err = s.each(ctx, func(l *lockInfo) {
		out.Locks.Total++
		out.Locks.ByState[l.State]++
		if l.Coalesced <= 0 || top == 0 {
			return
		}
		out.Top = append(out.Top, topKey{Key: l.Key, Queue: l.Queue, Type: l.Type, Owner: l.Owner, Coalesced: l.Coalesced})
		if len(out.Top) > 4*top { // keep memory bounded on huge keyspaces
			sortTop(out.Top)
			out.Top = out.Top[:top]
		}
	})
	if err != nil {
		return err
	}
	sortTop(out.Top)
	if len(out.Top) > top {
		out.Top = out.Top[:top]
	}
	if a.g.json {
		return writeJSON(a.stdout, out)
	}
	printStats(a.stdout, out)
	return nil
}

func sortTop(t []topKey) {
	sort.Slice(t, func(i, j int) bool {
		if t[i].Coalesced != t[j].Coalesced {
			return t[i].Coalesced > t[j].Coalesced
		}
		return t[i].Key < t[j].Key
	})
}

func printStats(w io.Writer, o statsOutput) {
	if len(o.Types) == 0 {
		fmt.Fprintln(w, noCounters)
	} else {
		// Columns: the events that happened, in dedup.EventNames order.
		var events []string
		for _, e := range dedup.EventNames() {
			if o.Totals[e] > 0 {
				events = append(events, e)
			}
		}
		types := make([]string, 0, len(o.Types))
		for t := range o.Types {
			types = append(types, t)
		}
		sort.Strings(types)
		fmt.Fprintf(w, "Counters flushed to Redis under prefix %q (all processes, since the first flush):\n", o.Prefix)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "%s\t%s\t\n", "TYPE"+strings.Repeat(" ", max(0, typeWidth(types)-4)), strings.ToUpper(strings.Join(events, "\t")))
		line := func(name string, m map[string]uint64) {
			fmt.Fprint(tw, name)
			for _, e := range events {
				fmt.Fprintf(tw, "\t%d", m[e])
			}
			fmt.Fprintln(tw, "\t")
		}
		// Numbers align right, type names left: pad the names to one width.
		width := typeWidth(types)
		pad := func(s string) string { return s + strings.Repeat(" ", width-len(s)) }
		for _, t := range types {
			line(pad(typeName(t)), o.Types[t])
		}
		if len(types) > 1 {
			line(pad("TOTAL"), o.Totals)
		}
		_ = tw.Flush()
		if len(events) == 0 {
			fmt.Fprintln(w, "(every counter is 0)")
		}
	}

	fmt.Fprintln(w)
	states := make([]string, 0, len(o.Locks.ByState))
	for s := range o.Locks.ByState {
		states = append(states, s)
	}
	sort.Strings(states)
	var parts []string
	for _, s := range states {
		parts = append(parts, fmt.Sprintf("%d %s", o.Locks.ByState[s], s))
	}
	if o.Locks.Total == 0 {
		fmt.Fprintln(w, "Live locks: none")
	} else {
		fmt.Fprintf(w, "Live locks: %d (%s)\n", o.Locks.Total, strings.Join(parts, ", "))
	}

	if len(o.Top) == 0 {
		fmt.Fprintln(w, "Top coalesced keys: no live lock has coalesced enqueues")
		return
	}
	fmt.Fprintln(w, "\nTop coalesced keys:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tTYPE\tOWNER\tCOALESCED")
	for _, t := range o.Top {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", t.Key, orDash(t.Type), t.Owner, t.Coalesced)
	}
	_ = tw.Flush()
}

// typeName shows the type "" (breaker_open is counted under it).
func typeName(t string) string {
	if t == "" {
		return "(no type)"
	}
	return t
}

func typeWidth(types []string) int {
	w := len("TOTAL")
	for _, t := range types {
		w = max(w, len(typeName(t)))
	}
	return w
}
