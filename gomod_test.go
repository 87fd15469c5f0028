package dedup

import (
	"go/version"
	"os/exec"
	"strings"
	"testing"
)

// go.mod's go line asks of users no newer a Go than the dependencies do:
// a patch release there would force every user onto it.
func TestGoDirectiveIsTheDependenciesFloor(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command in PATH")
	}
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Main}} {{.GoVersion}}", "all").Output()
	if err != nil {
		t.Fatalf("go list -m all: %v", err)
	}
	var ours, need string
	for line := range strings.Lines(string(out)) {
		main, v, _ := strings.Cut(strings.TrimSpace(line), " ")
		if main == "true" {
			ours = v
		} else if v != "" && version.Compare("go"+v, "go"+need) > 0 {
			need = v
		}
	}
	if version.Compare("go"+ours, "go"+need) != 0 {
		t.Errorf("go.mod says go %s; the dependencies need go %s: say that", ours, need)
	}
}
