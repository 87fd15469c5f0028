package dedup

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// eventsDoc holds the table of which events each policy emits, under
// eventsHeading.
const (
	eventsDoc     = "docs/operations.md"
	eventsHeading = "### Events per policy"
)

// policyRules are the rules of the table's rows, keyed by the row's name.
var policyRules = map[string]Rule{
	"Reject":       {},
	"Replace":      {OnConflict: Replace},
	"Merge":        {OnConflict: Merge, MergeFunc: func(_, new []byte) ([]byte, error) { return new, nil }},
	"RunningDefer": {OnConflict: Replace, OnRunning: RunningDefer},
	"RunningAllow": {OnRunning: RunningAllow},
	"Cooldown":     {Cooldown: time.Hour},
	"Period":       {Period: 24 * time.Hour},
	"FailHold":     {OnFailure: FailHold, FailHoldFor: time.Hour},
	"Debounce":     {OnConflict: Replace, Debounce: 100 * time.Millisecond},
}

// The metrics docs say which events each policy counts; this runs what the
// table describes, one task per policy through a real asynq server, and
// compares: two enqueues of one key while the first task waits, then one
// run that succeeds.
func TestEventsPerPolicyMatchTheDocs(t *testing.T) {
	table := readEventsTable(t)
	for name, rule := range policyRules {
		if _, ok := table[name]; !ok {
			t.Errorf("%s: no row %q in %s", eventsDoc, name, eventsHeading)
		}
		rule.Fields = []string{"user_id"}
		typ := "events:" + strings.ToLower(name)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := eventsOfOneRun(t, typ, rule)
			if want := table[name]; !slices.Equal(got, want) {
				t.Errorf("counted %v, the table says %v", got, want)
			}
		})
	}
	for name := range table {
		if _, ok := policyRules[name]; !ok {
			t.Errorf("%s: row %q names no policy this test runs", eventsDoc, name)
		}
	}
}

// eventsOfOneRun enqueues two tasks of one key of type typ under rule
// before a server runs them, waits for the run to be settled, and returns
// the events counted for typ, in eventNames' order.
func eventsOfOneRun(t *testing.T, typ string, rule Rule) []string {
	h := newHarness(t, Config{OptIn: true, Rules: map[string]Rule{typ: rule}})
	client := h.d.NewClient()
	for i := range 2 {
		task := asynq.NewTask(typ, fmt.Appendf(nil, `{"user_id":42,"n":%d}`, i))
		if _, err := client.Submit(t.Context(), task, asynq.Queue(h.queue)); err != nil && i == 0 {
			t.Fatalf("first enqueue: %v", err)
		}
	}
	var runs atomic.Int64
	h.serve(func(ctx context.Context, _ *asynq.Task) error { runs.Add(1); return nil }, nil)
	eventually(t, "the run settled", func() bool {
		s := h.d.StatsByType()[typ]
		return s.Processed == 1 && s.Released+s.Cooling == 1
	})
	eventually(t, "the queue empty", func() bool { return h.queueSize(h.queue) == 0 })
	if n := runs.Load(); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
	var got []string
	for name, n := range h.d.StatsByType()[typ].Map() {
		if n > 0 {
			got = append(got, name)
		}
	}
	order := eventNames[:]
	slices.SortFunc(got, func(a, b string) int { return slices.Index(order, a) - slices.Index(order, b) })
	return got
}

// readEventsTable reads the events table: policy → its events, in
// eventNames' order.
func readEventsTable(t *testing.T) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(eventsDoc)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, eventsHeading)
	if i < 0 {
		t.Fatalf("%s: no %q", eventsDoc, eventsHeading)
	}
	order := eventNames[:]
	names := regexp.MustCompile("`([a-z_]+)`")
	table := map[string][]string{}
	inTable := false
	for line := range strings.Lines(s[i+len(eventsHeading):]) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		policy := strings.Trim(strings.TrimSpace(cells[0]), "`*")
		if _, ok := policyRules[policy]; !ok && (strings.HasPrefix(policy, "-") || strings.EqualFold(policy, "policy")) {
			continue // the header and its rule
		}
		var evs []string
		for _, m := range names.FindAllStringSubmatch(strings.Join(cells[1:], "|"), -1) {
			if !slices.Contains(order, m[1]) {
				t.Errorf("%s, row %s: %q is not an event name", eventsDoc, policy, m[1])
			}
			evs = append(evs, m[1])
		}
		slices.SortFunc(evs, func(a, b string) int { return slices.Index(order, a) - slices.Index(order, b) })
		table[policy] = slices.Compact(evs)
	}
	return table
}
