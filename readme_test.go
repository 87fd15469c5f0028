package dedup

import (
	"slices"
	"strings"
	"testing"
)

// The README is read in five minutes: at most 300 lines. Everything else
// lives in the guides in docs/.
func TestReadmeIsShort(t *testing.T) {
	s := readDoc(t, "README.md")
	if n := strings.Count(s, "\n"); n > 300 {
		t.Errorf("README.md has %d lines, at most 300: move the detail to a guide in docs/", n)
	}
}

// The README's first ```sh block holds the two commands CI runs, and only
// them.
func TestReadmeHasTheTwoCommands(t *testing.T) {
	var cmds []string
	for _, b := range fencedBlocks("README.md", readDoc(t, "README.md")) {
		if b.lang != "sh" {
			continue
		}
		for _, line := range strings.Split(b.code, "\n") {
			if cmd, _, _ := strings.Cut(line, "#"); strings.TrimSpace(cmd) != "" {
				cmds = append(cmds, strings.Join(strings.Fields(cmd), " "))
			}
		}
		break
	}
	want := []string{"go run ./examples/worker", "go test -race -count=1 ./..."}
	if !slices.Equal(cmds, want) {
		t.Errorf("README's first sh block runs %q, want the two commands %q", cmds, want)
	}
}
