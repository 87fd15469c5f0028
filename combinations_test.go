package dedup

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// The README's "Supported combinations" table, checked against what New
// (for a Rule) and Submit (for per-call options) accept: every mix of the
// policies it names is refused exactly when a refused row names all of
// the mix's parts, and each row naming per-call options is refused as it
// says. The table and the code cannot drift apart.
func TestSupportedCombinationsTable(t *testing.T) {
	t.Parallel()
	rows := readCombinationsTable(t)
	policyRows, special := splitCombinationRows(t, rows)
	h := newHarness(t, Config{})
	ctx := context.Background()
	n := 0
	for _, mix := range allPolicyMixes() {
		n++
		want := refusedBy(mix, policyRows)
		checkRuleMix(t, h, mix, want)
		checkCallMix(t, h, ctx, mix, want, n)
	}
	for cell, check := range specialCombinations(h) {
		if !slices.Contains(special, cell) {
			t.Errorf("README's table has no refused row %q, which the code refuses", cell)
			continue
		}
		if err := check(ctx); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption as the table says", cell, err)
		}
	}
	for _, cell := range special {
		if _, ok := specialCombinations(h)[cell]; !ok {
			t.Errorf("README's table row %q is not checked by this test", cell)
		}
	}
	t.Logf("%d mixes of policies checked against %d refused rows; %d rows of per-call options", n, len(policyRows), len(special))
}

// combinationRow is one row of the table: its first cell and whether it
// says refused.
type combinationRow struct {
	cell    string
	refused bool
}

func readCombinationsTable(t *testing.T) []combinationRow {
	t.Helper()
	b, err := os.ReadFile("docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "### Supported combinations")
	if i < 0 {
		t.Fatal("README has no Supported combinations section")
	}
	var rows []combinationRow
	inTable := false
	for _, line := range strings.Split(s[i:], "\n") {
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) < 3 || strings.Contains(cells[0], "---") || strings.TrimSpace(cells[0]) == "combination" {
			continue
		}
		rows = append(rows, combinationRow{cell: strings.TrimSpace(cells[0]), refused: strings.HasPrefix(strings.TrimSpace(cells[1]), "refused")})
	}
	if len(rows) == 0 {
		t.Fatal("README's combinations table has no rows")
	}
	return rows
}

// policyParts are the names the table joins with " + " for mixes of
// policies.
var policyParts = []string{"Reject", "Replace", "Merge", "RunningReject", "RunningAllow", "RunningDefer",
	"Cooldown", "Debounce", "MaxPending", "BusyRetry", "BusyDrop", "BusyFold", "Period", "FailHold"}

// splitCombinationRows returns the refused rows made only of policy names
// (each as its set of parts), and the first cells of the other refused
// rows (per-call options).
func splitCombinationRows(t *testing.T, rows []combinationRow) (policy [][]string, special []string) {
	t.Helper()
	tick := regexp.MustCompile("`([^`]+)`")
	for _, r := range rows {
		if !r.refused {
			continue
		}
		var parts []string
		allPolicy := strings.Count(r.cell, "`") > 0
		for _, m := range tick.FindAllStringSubmatch(r.cell, -1) {
			parts = append(parts, m[1])
			allPolicy = allPolicy && slices.Contains(policyParts, m[1])
		}
		rest := strings.TrimSpace(tick.ReplaceAllString(r.cell, ""))
		if allPolicy && strings.Trim(rest, "+ ") == "" {
			policy = append(policy, parts)
		} else {
			special = append(special, r.cell)
		}
	}
	return policy, special
}

// policyMix is one mix of the policies the table names.
type policyMix struct {
	conflict   Conflict
	running    Running
	cooldown   bool
	debounce   bool
	maxPending bool
	period     bool
	failHold   bool
	busy       Busy
}

func (m policyMix) parts() []string {
	p := []string{[...]string{"Reject", "Replace", "Merge"}[m.conflict], [...]string{"RunningReject", "RunningAllow", "RunningDefer"}[m.running],
		[...]string{"BusyRetry", "BusyDrop", "BusyFold"}[m.busy]}
	if m.cooldown {
		p = append(p, "Cooldown")
	}
	if m.debounce {
		p = append(p, "Debounce")
	}
	if m.maxPending {
		p = append(p, "MaxPending")
	}
	if m.period {
		p = append(p, "Period")
	}
	if m.failHold {
		p = append(p, "FailHold")
	}
	return p
}

func (m policyMix) String() string { return strings.Join(m.parts(), "+") }

func allPolicyMixes() []policyMix {
	var out []policyMix
	for c := Reject; c <= Merge; c++ {
		for r := RunningReject; r <= RunningDefer; r++ {
			for b := BusyRetry; b <= BusyFold; b++ {
				for bits := range 32 {
					out = append(out, policyMix{conflict: c, running: r, busy: b, cooldown: bits&1 != 0, debounce: bits&2 != 0, maxPending: bits&4 != 0,
						period: bits&8 != 0, failHold: bits&16 != 0})
				}
			}
		}
	}
	return out
}

// refusedBy reports whether some refused row names only parts the mix has.
func refusedBy(m policyMix, rows [][]string) bool {
	have := m.parts()
	for _, row := range rows {
		all := true
		for _, p := range row {
			all = all && slices.Contains(have, p)
		}
		if all {
			return true
		}
	}
	return false
}

func keepMerging(old, new []byte) ([]byte, error) { return new, nil }

// rule is the mix as a Rule.
func (m policyMix) rule() Rule {
	r := Rule{Fields: []string{"k"}, OnConflict: m.conflict, OnRunning: m.running, OnBusy: m.busy}
	if m.conflict == Merge {
		r.MergeFunc = keepMerging
	}
	if m.cooldown {
		r.Cooldown = time.Hour
	}
	if m.debounce {
		r.Debounce = time.Hour
	}
	if m.maxPending {
		r.MaxPending = 1000
	}
	if m.period {
		r.Period = 24 * time.Hour
	}
	if m.failHold {
		r.OnFailure, r.FailHoldFor = FailHold, time.Hour
	}
	return r
}

func checkRuleMix(t *testing.T, h *harness, m policyMix, refused bool) {
	t.Helper()
	d, err := New(context.Background(), h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: map[string]Rule{"mix": m.rule()}})
	if d != nil {
		_ = d.Close()
	}
	switch {
	case refused && !errors.Is(err, ErrInvalidOption):
		t.Errorf("Rule %v: New gave %v, the table says refused (ErrInvalidOption)", m, err)
	case !refused && err != nil:
		t.Errorf("Rule %v: New gave %v, the table says it works", m, err)
	}
}

// checkCallMix gives the mix's per-call parts as options (the rest, which
// only a Rule sets, in the type's rule) and checks Submit's answer.
func checkCallMix(t *testing.T, h *harness, ctx context.Context, m policyMix, refused bool, n int) {
	t.Helper()
	typ := "call:" + m.String()
	rule := &resolved{optedIn: true, running: m.running, busy: m.busy}
	if m.maxPending {
		rule.maxPending = 1000
	}
	h.d.rules[typ] = rule
	h.d.prefixes = longestFirst(h.d.rules)
	opts := []asynq.Option{asynq.Queue(h.queue), Fields("k")}
	switch m.conflict {
	case Replace:
		opts = append(opts, OnConflict(Replace))
	case Merge:
		opts = append(opts, MergeWith(keepMerging))
	}
	if m.cooldown {
		opts = append(opts, Cooldown(time.Hour))
	}
	if m.debounce {
		opts = append(opts, Debounce(time.Hour))
	}
	if m.period {
		opts = append(opts, Period(24*time.Hour, nil))
	}
	if m.failHold {
		opts = append(opts, OnFailure(FailHold, time.Hour))
	}
	_, err := h.client.Submit(ctx, asynq.NewTask(typ, fmt.Appendf(nil, `{"k":%d}`, n)), opts...)
	switch {
	case refused && !errors.Is(err, ErrInvalidOption):
		t.Errorf("per call %v: Submit gave %v, the table says refused (ErrInvalidOption)", m, err)
	case !refused && err != nil:
		t.Errorf("per call %v: Submit gave %v, the table says it works", m, err)
	}
}

// specialCombinations are the table's refused rows of per-call options,
// by their first cell, each with a call that must be refused.
func specialCombinations(h *harness) map[string]func(context.Context) error {
	submit := func(opts ...asynq.Option) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := h.client.Submit(ctx, asynq.NewTask("special", []byte(`{"k":1}`)), append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
			return err
		}
	}
	return map[string]func(context.Context) error{
		"`Merge` without a merge function": func(ctx context.Context) error {
			if err := submit(OnConflict(Merge))(ctx); !errors.Is(err, ErrInvalidOption) {
				return err
			}
			_, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: map[string]Rule{"x": {OnConflict: Merge}}})
			return err
		},
		"`MergeWith` + `OnConflict(Replace)`": func(ctx context.Context) error {
			if err := submit(MergeWith(keepMerging), OnConflict(Replace))(ctx); !errors.Is(err, ErrInvalidOption) {
				return err
			}
			return submit(OnConflict(Replace), MergeWith(keepMerging))(ctx)
		},
		"`Key` + `SharedKey`": submit(Key("a"), SharedKey("b")),
		"`Scheduler.Register` with a key, fold or hold option (`Key`, `SharedKey`, `Fields`, `Skip`, `asynq.TaskID`, `OnConflict`, `MergeWith`, `Debounce`, `Cooldown`, `Period`, `OnFailure`)": func(context.Context) error {
			s := NewScheduler(h.d, nil)
			for _, o := range []asynq.Option{Key("k"), SharedKey("k"), Fields("k"), Skip(), asynq.TaskID("x"), OnConflict(Reject), MergeWith(keepMerging),
				Debounce(time.Second), Cooldown(time.Second), Period(time.Hour, nil), OnFailure(FailHoldUntilReleased, 0)} {
				if _, err := s.Register("@every 1m", asynq.NewTask("special", nil), o); !errors.Is(err, ErrInvalidOption) {
					return fmt.Errorf("%v: %w", o, err)
				}
			}
			return ErrInvalidOption
		},
		"`asynq.Unique` or `asynq.Group`, deduplicating": func(ctx context.Context) error {
			if err := submit(asynq.Unique(time.Hour))(ctx); !errors.Is(err, ErrInvalidOption) {
				return err
			}
			return submit(asynq.Group("g"))(ctx)
		},
	}
}
