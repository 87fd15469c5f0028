package dedup

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// The README's list of counter names ("Their names (dedup.EventNames(),
// Stats.Map()): ...") must be EventNames.
func TestReadmeListsEveryEvent(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, "Their names (`dedup.EventNames()`, `Stats.Map()`):")
	if i < 0 {
		t.Fatal("README list not found")
	}
	j := strings.Index(s[i:], ". Counting")
	var got []string
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(s[i:i+j], -1) {
		got = append(got, m[1])
	}
	if want := EventNames(); !slices.Equal(got, want) {
		t.Errorf("README lists %v\nEventNames() = %v", got, want)
	}
	// Every name round-trips through Map.
	var st Stats
	for e := range numEvents {
		*st.field(e) = uint64(e) + 1
	}
	m := st.Map()
	for e, name := range EventNames() {
		if m[name] != uint64(e)+1 {
			t.Errorf("Map()[%q] = %d", name, m[name])
		}
	}
}
