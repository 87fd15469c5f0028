package dedup

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// Every invalid rule is reported in one order, the sentinel first, then
// the rule, then what is wrong with it, and still matches ErrInvalidOption.
func TestRuleErrorsNameTheSentinelFirst(t *testing.T) {
	for name, r := range map[string]Rule{
		"bad field path":   {Fields: []string{"a..b"}},
		"negative TTL":     {TTL: -time.Second},
		"cooldown + allow": {Cooldown: time.Minute, OnRunning: RunningAllow},
		"merge, no func":   {OnConflict: Merge},
	} {
		_, err := compileRules(map[string]Rule{"report:build": r})
		if !errors.Is(err, ErrInvalidOption) {
			t.Fatalf("%s: %v, want ErrInvalidOption", name, err)
		}
		msg := err.Error()
		if want := `dedup: invalid option: rule for "report:build": `; !strings.HasPrefix(msg, want) {
			t.Errorf("%s: %q, want it to begin %q", name, msg, want)
		}
		if strings.Count(msg, "dedup:") != 1 {
			t.Errorf("%s: %q names the package twice", name, msg)
		}
	}
}
