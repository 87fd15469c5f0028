package dedup

import (
	"go/scanner"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// retiredWords are the words docs/glossary.md retired, each with the word
// that replaced it.
var retiredWords = []struct {
	re  *regexp.Regexp
	now string
}{
	{regexp.MustCompile(`(?i)coalesc`), "fold, replaced (the counter), folds (a lock's folded calls)"},
	{regexp.MustCompile(`(?i)(\b|_)own(er|ers|ed)(\b|_)`), "holder"},
	{regexp.MustCompile(`FailureHold|FailureHeld|failure_held|(?i)failure[ -]hold`), "fail hold, FailHoldFor, FailHeld, fail_held"},
	{regexp.MustCompile(`DuplicateTaskError(\.|\{)TaskID`), "DuplicateTaskError.Holder"},
}

// glossaryExempt says whether line i of a file may name a retired word: only
// in docs/glossary.md, in the "not used for it" column of its first table
// and in its "Renamed" section, which quote them to say they are retired.
func glossaryExempt(file string, lines []string, i int) (string, bool) {
	if filepath.ToSlash(file) != "docs/glossary.md" {
		return lines[i], false
	}
	for _, l := range lines[:i+1] {
		if strings.HasPrefix(l, "## Renamed") {
			return "", true
		}
	}
	if cells := strings.Split(strings.TrimSuffix(lines[i], "|"), "|"); len(cells) == 5 {
		return strings.Join(cells[:4], "|"), false // the last column names the retired words
	}
	return lines[i], false
}

// userTexts returns the texts a user reads, by file: the docs and README,
// the web templates whole, and the string literals of dedupctl's and the
// web's code and of the lock views they print (help, output, errors).
func userTexts(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	files := docFiles(t)
	tmpl, _ := filepath.Glob(filepath.Join("dedupweb", "templates", "*.html"))
	for _, f := range append(files, tmpl...) {
		out[f] = strings.Split(readDoc(t, f), "\n")
	}
	for _, dir := range []string{"cmd/dedupctl", "dedupweb", "internal/lockview"} {
		gos, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		for _, f := range gos {
			if !strings.HasSuffix(f, "_test.go") {
				out[f] = goTexts(t, f, false)
			}
		}
	}
	// The packages a user imports or copies: their doc comments (godoc)
	// and their texts (errors, logs, metric names and help).
	for _, dir := range []string{".", "dedupprom", "dedupotel", "examples/service", "examples/worker", "cmd/dedupbench"} {
		gos, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		for _, f := range gos {
			if !strings.HasSuffix(f, "_test.go") {
				out[f] = goTexts(t, f, true)
			}
		}
	}
	return out
}

// goTexts returns the lines of a Go file with only its string literals
// kept, unquoted, and with comments its comments too (code blanked), so
// that line numbers hold. A literal of stats.go's renamedEvents, which
// reads counters stored under the retired names, is left out.
func goTexts(t *testing.T, file string, comments bool) []string {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := make([]string, strings.Count(string(src), "\n")+1)
	fset := token.NewFileSet()
	var s scanner.Scanner
	mode := scanner.Mode(0)
	if comments {
		mode = scanner.ScanComments
	}
	s.Init(fset.AddFile(file, -1, len(src)), src, nil, mode)
	srcLines := strings.Split(string(src), "\n")
	for {
		pos, tok, lit := s.Scan()
		if tok == token.EOF {
			return lines
		}
		line := fset.Position(pos).Line - 1
		if tok == token.COMMENT {
			for j, l := range strings.Split(lit, "\n") {
				lines[line+j] += " " + l
			}
			continue
		}
		if tok != token.STRING || strings.Contains(srcLines[line], "renamedEvents") {
			continue
		}
		text, err := strconv.Unquote(lit)
		if err != nil {
			t.Fatalf("%s: %v", fset.Position(pos), err)
		}
		for j, l := range strings.Split(text, "\n") {
			lines[line+j] += " " + l
		}
	}
}

// TestGlossaryWordsAreTheOnlyWords: the words docs/glossary.md retired
// (coalesced, owner, failure hold, DuplicateTaskError.TaskID) appear in no
// text a user reads, but where the glossary quotes them as retired.
func TestGlossaryWordsAreTheOnlyWords(t *testing.T) {
	t.Parallel()
	texts := userTexts(t)
	if len(texts) < 20 {
		t.Fatalf("only %d files read", len(texts))
	}
	for file, lines := range texts {
		for i := range lines {
			text, exempt := glossaryExempt(file, lines, i)
			if exempt {
				continue
			}
			for _, w := range retiredWords {
				if m := w.re.FindString(text); m != "" {
					t.Errorf("%s:%d: %q is a retired word (docs/glossary.md): say %s", file, i+1, m, w.now)
				}
			}
		}
	}
}
