package dedup

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/format"
	"go/parser"
	"go/scanner"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// The documentation: README.md and the guides in docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	guides, err := filepath.Glob(filepath.Join("docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(guides) == 0 {
		t.Fatal("no guides in docs/")
	}
	return append([]string{"README.md"}, guides...)
}

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// docBlock is one fenced code block of a markdown file.
type docBlock struct {
	file string
	line int    // of the block's first line of code (1-based)
	lang string // the fence's info string
	code string
}

func (b docBlock) String() string { return fmt.Sprintf("%s:%d", b.file, b.line) }

// fencedBlocks returns the fenced code blocks of a markdown file, in order.
func fencedBlocks(file, text string) []docBlock {
	var out []docBlock
	var cur *docBlock
	var fence string
	var body []string
	for i, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if cur == nil {
			if strings.HasPrefix(trimmed, "```") {
				fence = trimmed[:len(trimmed)-len(strings.TrimLeft(trimmed, "`"))]
				cur = &docBlock{file: file, line: i + 2, lang: strings.TrimSpace(trimmed[len(fence):])}
				body = body[:0]
			}
			continue
		}
		if strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, "`") == "" {
			cur.code = strings.Join(body, "\n") + "\n"
			out = append(out, *cur)
			cur = nil
			continue
		}
		body = append(body, line)
	}
	return out
}

// The counters listed in docs/operations.md ("Their names
// (the event tags of Stats, Stats.Map()): ...") must be eventNames, in order.
func TestDocsListEveryEvent(t *testing.T) {
	s := readDoc(t, filepath.Join("docs", "operations.md"))
	const marker = "Their names (the `event` tags of `Stats`' fields, the keys of `Stats.Map()`):"
	i := strings.Index(s, marker)
	if i < 0 {
		t.Fatalf("docs/operations.md has no %q", marker)
	}
	list := s[i+len(marker):]
	if j := strings.Index(list, "\n\n"); j >= 0 {
		list = list[:j]
	}
	var got []string
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(list, -1) {
		got = append(got, m[1])
	}
	if want := eventNames[:]; !slices.Equal(got, want) {
		t.Errorf("docs/operations.md lists %v\neventNames[:] = %v", got, want)
	}
	// Every name round-trips through Map.
	var st Stats
	for e := range numEvents {
		*st.field(e) = uint64(e) + 1
	}
	m := st.Map()
	for e, name := range eventNames[:] {
		if m[name] != uint64(e)+1 {
			t.Errorf("Map()[%q] = %d", name, m[name])
		}
	}
}

// Every ```go block of the documentation stays true: a complete file
// (one with a package clause) must build in this module; a fragment must at
// least parse, as declarations or as statements. Both are gofmt-ed. Blocks
// that are not Go carry another language tag.
func TestDocsGoBlocks(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	var files []docBlock
	n := 0
	for _, name := range docFiles(t) {
		for _, b := range fencedBlocks(name, readDoc(t, name)) {
			if b.lang != "go" {
				continue
			}
			n++
			if isGoFile(b.code) {
				files = append(files, b)
				continue
			}
			if err := parseFragment(b); err != nil {
				t.Errorf("%s: a Go fragment that parses neither as declarations nor as statements: %v", b, err)
			} else if formatted, err := format.Source([]byte(b.code)); err == nil && !bytes.Equal(formatted, []byte(b.code)) {
				t.Errorf("%s: the Go fragment is not gofmt-ed; gofmt has it as:\n%s", b, formatted)
			}
		}
	}
	if n == 0 {
		t.Fatal("no ```go blocks found")
	}
	if len(files) == 0 {
		t.Fatal("no complete Go file among the ```go blocks (README's quick start is one)")
	}
	for _, b := range files {
		checkGoFile(t, b)
	}
	t.Logf("%d go blocks, %d of them complete files built", n, len(files))
}

// isGoFile reports whether code is a whole source file: its first line
// that is not blank or a comment is a package clause.
func isGoFile(code string) bool {
	for _, line := range strings.Split(code, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "//") {
			continue
		}
		return strings.HasPrefix(line, "package ")
	}
	return false
}

// parseFragment parses a block as the body of a file, else of a function.
func parseFragment(b docBlock) error {
	fset := token.NewFileSet()
	_, declErr := parser.ParseFile(fset, "fragment.go", "package p\n"+b.code, parser.SkipObjectResolution)
	if declErr == nil {
		return nil
	}
	_, stmtErr := parser.ParseFile(fset, "fragment.go", "package p\nfunc _() {\n"+b.code+"\n}", parser.SkipObjectResolution)
	if stmtErr == nil {
		return nil
	}
	return fmt.Errorf("as declarations: %s; as statements: %s", b.at(declErr, 1), b.at(stmtErr, 2))
}

// at places the first error of a parse of the block's code, wrapped in
// `wrap` lines before it, in the markdown file.
func (b docBlock) at(err error, wrap int) string {
	el, ok := err.(scanner.ErrorList)
	if !ok || len(el) == 0 {
		return err.Error()
	}
	return fmt.Sprintf("%s:%d: %s", b.file, b.line+el[0].Pos.Line-wrap-1, el[0].Msg)
}

// checkGoFile builds one complete file as a package of its own inside this
// module, through a build overlay: nothing is written into the module.
func checkGoFile(t *testing.T, b docBlock) {
	t.Helper()
	if formatted, err := format.Source([]byte(b.code)); err != nil {
		t.Errorf("%s: %v", b, err)
		return
	} else if !bytes.Equal(formatted, []byte(b.code)) {
		t.Errorf("%s: the Go file is not gofmt-ed", b)
	}
	root, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	src := filepath.Join(tmp, "doc.go")
	if err := os.WriteFile(src, []byte(b.code), 0o644); err != nil {
		t.Fatal(err)
	}
	// A directory that does not exist, and whose name the go command's
	// ./... patterns skip: only the overlay gives it a file.
	dir := fmt.Sprintf("_docsbuild/%s_%d", strings.NewReplacer("/", "_", ".", "_").Replace(b.file), b.line)
	overlay, err := json.Marshal(map[string]map[string]string{"Replace": {filepath.Join(root, dir, "doc.go"): src}})
	if err != nil {
		t.Fatal(err)
	}
	overlayFile := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(overlayFile, overlay, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(goTool(t), "build", "-overlay="+overlayFile, "-o", filepath.Join(tmp, "out"), "./"+dir)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		// Point the compiler's positions at the markdown file.
		pos := regexp.MustCompile(`(?:` + regexp.QuoteMeta(src) + `|` + regexp.QuoteMeta(dir) + `/doc\.go):(\d+)`)
		msg := pos.ReplaceAllStringFunc(string(out), func(m string) string {
			var l int
			fmt.Sscanf(m[strings.LastIndex(m, ":")+1:], "%d", &l)
			return fmt.Sprintf("%s:%d", b.file, b.line+l-1)
		})
		t.Errorf("%s: the Go file does not build: %v\n%s", b, err, msg)
	}
}

// goTool is the go command that runs the tests.
func goTool(t *testing.T) string {
	t.Helper()
	if p := filepath.Join(runtime.GOROOT(), "bin", "go"); fileExists(p) {
		return p
	}
	p, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build the documentation's Go files with")
	}
	return p
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// Every relative link of the documentation points to a file that exists,
// and its #anchor, if any, to a heading of that file.
func TestDocsLinks(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(file string) map[string]bool {
		if a, ok := anchors[file]; ok {
			return a
		}
		a := headingAnchors(readDoc(t, file))
		anchors[file] = a
		return a
	}
	checked := 0
	for _, name := range docFiles(t) {
		for i, line := range proseLines(readDoc(t, name)) {
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				file := name
				if path != "" {
					file = filepath.Join(filepath.Dir(name), path)
				}
				where := fmt.Sprintf("%s:%d", name, i+1)
				if !fileExists(file) {
					if strings.HasPrefix(filepath.ToSlash(file), "examples/service") {
						t.Logf("%s: %s does not exist yet (examples/service is being written)", where, file)
						continue
					}
					t.Errorf("%s: link to %s: no such file", where, target)
					continue
				}
				checked++
				if anchor != "" && !anchorsOf(file)[anchor] {
					t.Errorf("%s: link to %s: %s has no heading with anchor #%s", where, target, file, anchor)
				}
			}
		}
	}
	t.Logf("%d relative links checked", checked)
}

// proseLines returns the lines of a markdown file with those inside fenced
// code blocks blanked, so that line numbers stay right.
func proseLines(text string) []string {
	lines := strings.Split(text, "\n")
	in := false
	for i, line := range lines {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			in = !in
			lines[i] = ""
			continue
		}
		if in {
			lines[i] = ""
		}
	}
	return lines
}

// headingAnchors returns the anchors GitHub gives a file's headings:
// lower case, punctuation dropped, spaces as hyphens, -1, -2… for repeats.
func headingAnchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, line := range proseLines(text) {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			seen[a]++
			a = fmt.Sprintf("%s-%d", a, n)
		} else {
			seen[a] = 1
		}
		out[a] = true
	}
	return out
}
