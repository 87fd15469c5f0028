package jsonkey

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/asynq-dedup/dedup/internal/jsonkey/jsonkeytest"
)

// Tests of field selection (Compile, Select) and of the canonical JSON
// encoding (AppendCanonical), and FuzzSelectFields. Tests of the keys made
// from them (equality, property and fuzz tests) are in package dedup's
// fingerprint_test.go.

// mustFieldSet compiles paths or fails the test.
func mustFieldSet(t testing.TB, paths ...string) *Fields {
	t.Helper()
	fs, err := Compile(paths)
	if err != nil {
		t.Fatalf("Compile(%q): %v", paths, err)
	}
	return fs
}

// canonJSON validates v as one JSON value, as Select does before a caller
// encodes any of its spans, and returns its canonical encoding.
func canonJSON(v []byte) ([]byte, error) {
	var spans [MaxFields]Span
	if err := Select(v, &Fields{}, &spans); err != nil {
		return nil, err
	}
	return AppendCanonical(nil, v)
}

func mustCanon(t testing.TB, v string) []byte {
	t.Helper()
	c, err := canonJSON([]byte(v))
	if err != nil {
		t.Fatalf("canonical encoding of %q: %v", v, err)
	}
	return c
}

// selected runs Select and returns each path's raw value text, or
// "<missing>".
func selected(t testing.TB, payload string, paths ...string) map[string]string {
	t.Helper()
	fs := mustFieldSet(t, paths...)
	var spans [MaxFields]Span
	if err := Select([]byte(payload), fs, &spans); err != nil {
		t.Fatalf("Select(%q): %v", payload, err)
	}
	out := make(map[string]string, len(fs.paths))
	for i, p := range fs.paths {
		if sp := spans[i]; sp.End == 0 {
			out[p] = "<missing>"
		} else {
			out[p] = payload[sp.Start:sp.End]
		}
	}
	return out
}

func TestCompileFields(t *testing.T) {
	t.Run("none", func(t *testing.T) {
		for _, in := range [][]string{nil, {}} {
			fs, err := Compile(in)
			if fs != nil || err != nil {
				t.Errorf("Compile(%q) = %v, %v; want nil, nil", in, fs, err)
			}
		}
	})
	t.Run("sorted and de-duplicated", func(t *testing.T) {
		in := []string{"b", "report.kind", "a", "b", "a.z"}
		fs := mustFieldSet(t, in...)
		want := []string{"a", "a.z", "b", "report.kind"}
		if fmt.Sprint(fs.paths) != fmt.Sprint(want) {
			t.Errorf("paths = %q, want %q", fs.paths, want)
		}
		if len(fs.segs) != len(want) || fmt.Sprint(fs.segs[3]) != "[report kind]" || fmt.Sprint(fs.segs[1]) != "[a z]" {
			t.Errorf("segs = %q", fs.segs)
		}
		if in[0] != "b" || in[2] != "a" {
			t.Errorf("Compile reordered the caller's slice: %q", in)
		}
	})
	t.Run("empty segment", func(t *testing.T) {
		for _, p := range []string{"", ".", "a.", ".a", "a..b", "a.b.", "..."} {
			fs, err := Compile([]string{"ok", p})
			// The caller prefixes the text (package dedup: "dedup: invalid option: ").
			want := fmt.Sprintf("field path %q has an empty segment", p)
			if err == nil || err.Error() != want || fs != nil {
				t.Errorf("Compile(%q) = %v, %v; want error %q", p, fs, err, want)
			}
		}
	})
	t.Run("limit", func(t *testing.T) {
		var ps []string
		for i := range MaxFields {
			ps = append(ps, fmt.Sprintf("f%d", i))
		}
		if _, err := Compile(ps); err != nil {
			t.Errorf("%d fields: %v", MaxFields, err)
		}
		// Duplicates don't count towards the limit.
		if _, err := Compile(append(ps, ps[:10]...)); err != nil {
			t.Errorf("%d fields with duplicates: %v", MaxFields, err)
		}
		if _, err := Compile(append(ps, "one.more")); err == nil || err.Error() != "65 fields selected, at most 64" {
			t.Errorf("%d fields: err = %v, want too many fields", MaxFields+1, err)
		}
	})
	t.Run("unusual but valid", func(t *testing.T) {
		// Paths are matched against decoded member names byte for byte; any
		// non-empty segment is allowed, including ones that look like JSON
		// escapes (they are not decoded).
		for _, p := range []string{"é", `a\`, `\u0061`, "a b", "0", "a.0.b", `"`} {
			if _, err := Compile([]string{p}); err != nil {
				t.Errorf("Compile(%q): %v", p, err)
			}
		}
	})
}

func TestSelectFields(t *testing.T) {
	const doc = `{"a":1, "b" : {"c":"x","d":[1,{"e":2}],"n":null}, "t":true, "o":{}, "arr":[{"k":1}]}`
	tests := []struct {
		name    string
		payload string
		paths   []string
		want    map[string]string
	}{
		{"top and nested", doc, []string{"a", "b.c", "b.d", "b.n", "t", "o", "b"},
			map[string]string{"a": "1", "b.c": `"x"`, "b.d": `[1,{"e":2}]`, "b.n": "null", "t": "true", "o": "{}",
				"b": `{"c":"x","d":[1,{"e":2}],"n":null}`}},
		{"absent", doc, []string{"z", "b.z", "b.c.z", "a.b", "o.x"},
			map[string]string{"z": "<missing>", "b.z": "<missing>", "b.c.z": "<missing>", "a.b": "<missing>", "o.x": "<missing>"}},
		{"no descent into arrays", doc, []string{"arr.k", "arr.0.k", "b.d.e", "b.d.1.e"},
			map[string]string{"arr.k": "<missing>", "arr.0.k": "<missing>", "b.d.e": "<missing>", "b.d.1.e": "<missing>"}},
		{"top-level array", `[{"a":1}]`, []string{"a"}, map[string]string{"a": "<missing>"}},
		{"top-level scalar", `"a"`, []string{"a"}, map[string]string{"a": "<missing>"}},
		{"top-level null", `null`, []string{"a"}, map[string]string{"a": "<missing>"}},
		{"depth matters", `{"x":{"a":1},"a":2}`, []string{"a", "x.a", "a.a"},
			map[string]string{"a": "2", "x.a": "1", "a.a": "<missing>"}},
		{"nested only", `{"b":{"a":1}}`, []string{"a"}, map[string]string{"a": "<missing>"}},
		{"escaped member name", `{"\u0061":1,"r\u00e9f":{"\/":2}}`, []string{"a", "réf./"},
			map[string]string{"a": "1", "réf./": "2"}},
		{"dot in member name is not a separator", `{"a.b":1,"a":{"b":2}}`, []string{"a.b"},
			map[string]string{"a.b": "2"}},
		{"white space around values", "{ \"a\" :\t\n 12.5e3 \r, \"b\":{ \"c\" : [ ] } }", []string{"a", "b.c"},
			map[string]string{"a": "12.5e3", "b.c": "[ ]"}},
		{"prefix and path", `{"a":{"b":{"c":3}}}`, []string{"a", "a.b", "a.b.c"},
			map[string]string{"a": `{"b":{"c":3}}`, "a.b": `{"c":3}`, "a.b.c": "3"}},
		// Duplicate member names: the last one wins, as in encoding/json.
		{"duplicate scalar", `{"a":1,"a":2}`, []string{"a"}, map[string]string{"a": "2"}},
		{"duplicate three times", `{"a":1,"b":0,"a":2,"a":"three"}`, []string{"a"}, map[string]string{"a": `"three"`}},
		{"duplicate object replaced by scalar", `{"a":{"b":1},"a":2}`, []string{"a.b"}, map[string]string{"a.b": "<missing>"}},
		{"duplicate object replaced by object", `{"a":{"b":1},"a":{"c":2}}`, []string{"a.b", "a.c"},
			map[string]string{"a.b": "<missing>", "a.c": "2"}},
		{"duplicate scalar replaced by object", `{"a":2,"a":{"b":1}}`, []string{"a.b", "a"},
			map[string]string{"a.b": "1", "a": `{"b":1}`}},
		{"duplicate inner", `{"a":{"b":1,"b":3}}`, []string{"a.b"}, map[string]string{"a.b": "3"}},
		{"duplicate via escape", `{"a":1,"\u0061":2}`, []string{"a"}, map[string]string{"a": "2"}},
		{"duplicate object replaced by array", `{"a":{"b":1},"a":[{"b":2}]}`, []string{"a.b"}, map[string]string{"a.b": "<missing>"}},
		{"other subtree not affected by duplicate", `{"x":{"b":1},"a":{"b":2},"x":{"b":3}}`, []string{"a.b", "x.b"},
			map[string]string{"a.b": "2", "x.b": "3"}},
		// A member name with invalid UTF-8 decodes to U+FFFD, as in
		// encoding/json, escaped or not.
		{"invalid UTF-8 name", "{\"k\xff\":1}", []string{"k\uFFFD"}, map[string]string{"k\uFFFD": "1"}},
		{"lone surrogate name", `{"k\ud800":1}`, []string{"k\uFFFD"}, map[string]string{"k\uFFFD": "1"}},
		{"non-ASCII name", `{"clé":1,"cle":2}`, []string{"clé"}, map[string]string{"clé": "1"}},
		{"long escaped name", `{"` + strings.Repeat(`\u0061`, 100) + `":7}`, []string{strings.Repeat("a", 100)},
			map[string]string{strings.Repeat("a", 100): "7"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := selected(t, tt.payload, tt.paths...)
			for p, w := range tt.want {
				if got[p] != w {
					t.Errorf("path %q: got %s, want %s", p, got[p], w)
				}
			}
		})
	}
}

func TestSelectFieldsMaxFields(t *testing.T) {
	// With 64 paths every bit of the mask is in use.
	var paths []string
	var sb strings.Builder
	sb.WriteString("{")
	for i := range MaxFields {
		p := fmt.Sprintf("f%02d", i)
		paths = append(paths, p)
		if i > 0 {
			sb.WriteString(",")
		}
		fmt.Fprintf(&sb, `%q:%d`, p, i)
	}
	sb.WriteString("}")
	got := selected(t, sb.String(), paths...)
	for i, p := range paths {
		if got[p] != fmt.Sprint(i) {
			t.Errorf("path %q: got %s, want %d", p, got[p], i)
		}
	}
}

func TestSelectFieldsRejectsInvalid(t *testing.T) {
	fs := mustFieldSet(t, "a", "a.b")
	run := func(t *testing.T, in string) {
		t.Helper()
		var spans [MaxFields]Span
		err := Select([]byte(in), fs, &spans)
		var je *SyntaxError
		if !errors.As(err, &je) {
			t.Fatalf("Select(%.40q) = %v, want a *SyntaxError", in, err)
		}
		if je.Offset < 0 || je.Offset > len(in) {
			t.Errorf("error offset %d outside the input (len %d)", je.Offset, len(in))
		}
	}
	for _, tt := range jsonkeytest.BadJSON {
		t.Run(tt.Name, func(t *testing.T) { run(t, tt.In) })
	}
	for _, n := range []int{MaxDepth + 1, 1000, 100_000, 1_000_000} {
		t.Run(fmt.Sprintf("nesting %d arrays", n), func(t *testing.T) { run(t, jsonkeytest.Deep(n, false)) })
		t.Run(fmt.Sprintf("nesting %d objects", n), func(t *testing.T) { run(t, jsonkeytest.Deep(n, true)) })
		// Deeply nested but truncated, and unselected.
		t.Run(fmt.Sprintf("nesting %d unclosed", n), func(t *testing.T) { run(t, `{"z":`+strings.Repeat("[", n)) })
	}
}

func TestSelectFieldsAcceptsValid(t *testing.T) {
	fs := mustFieldSet(t, "a")
	for _, in := range []string{
		`{}`, `[]`, `0`, `-0`, `-0.0e-0`, `1E+2`, `""`, `null`, `true`, `false`,
		" \t\r\n{ } \t\r\n", `{"":1}`, `{"a":[[],{},[{}]]}`,
		`"\"\\\/\b\f\n\r\t\u0000\uFFFF\ud83d\ude00"`,
		"\"\xff\xfe invalid UTF-8 is accepted, as by encoding/json\"",
		`123456789012345678901234567890.123456789e-999999`,
		jsonkeytest.Deep(MaxDepth, false), jsonkeytest.Deep(MaxDepth, true),
	} {
		var spans [MaxFields]Span
		if err := Select([]byte(in), fs, &spans); err != nil {
			t.Errorf("Select(%.60q): %v", in, err)
		}
	}
}

func TestAppendCanonical(t *testing.T) {
	for _, tc := range jsonkeytest.CanonCases {
		ca, cb := mustCanon(t, tc.A), mustCanon(t, tc.B)
		if got := bytes.Equal(ca, cb); got != tc.Equal {
			t.Errorf("canonical(%s) == canonical(%s): %v, want %v\n  %q\n  %q", tc.A, tc.B, got, tc.Equal, ca, cb)
		}
	}
}

func TestAppendCanonicalAppends(t *testing.T) {
	// AppendCanonical appends to dst and leaves what is there alone.
	dst := []byte("prefix")
	out, err := AppendCanonical(dst, []byte(`{"b":[1,"x"],"a":null}`))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(out, []byte("prefix")) || !bytes.Equal(out[len("prefix"):], mustCanon(t, `{"a":null,"b":[1,"x"]}`)) {
		t.Errorf("got %q", out)
	}
	// Leading and trailing white space of the value doesn't matter.
	if c := mustCanon(t, " \n1 \t"); !bytes.Equal(c, mustCanon(t, "1")) {
		t.Errorf("white space around a value changed the encoding: %q", c)
	}
}

func TestAppendCanonicalExponentRange(t *testing.T) {
	// Exponents far beyond float64's range still compare exactly...
	if !bytes.Equal(mustCanon(t, "1e999999999"), mustCanon(t, "10e999999998")) {
		t.Error("1e999999999 != 10e999999998")
	}
	// ...up to a bound that keeps the arithmetic from overflowing; past it
	// the value is refused, never wrapped around.
	for _, in := range []string{"1e1000000001", "1e-1000000001", "1e99999999999999999999999", "-5E+18446744073709551617"} {
		if c, err := canonJSON([]byte(in)); err == nil {
			t.Errorf("canonical(%s) = %q, want an error", in, c)
		} else if strings.Contains(err.Error(), in) {
			t.Errorf("error quotes the number: %v", err)
		}
	}
}

func TestAppendCanonicalPrefixFree(t *testing.T) {
	// No canonical encoding is a proper prefix of another: sequences of
	// encodings can be hashed without separators.
	var encs [][]byte
	for _, tc := range jsonkeytest.CanonCases {
		encs = append(encs, mustCanon(t, tc.A), mustCanon(t, tc.B))
	}
	for _, a := range encs {
		for _, b := range encs {
			if len(a) < len(b) && bytes.HasPrefix(b, a) {
				t.Errorf("%q is a prefix of %q", a, b)
			}
		}
	}
}

// --- Reference scanner ------------------------------------------------------

// refScanner is a plain recursive scanner that reads a byte at a time: the
// reference for Select, which must find the same spans and fail with
// the same error (offset and message) for every input. (Select was
// this scanner before it was tuned.)
type refScanner struct {
	b     []byte
	pos   int
	fs    *Fields
	spans *[MaxFields]Span
}

func refSelectFields(payload []byte, fs *Fields, spans *[MaxFields]Span) error {
	s := refScanner{b: payload, fs: fs, spans: spans}
	all := uint64(1)<<uint(len(fs.paths)) - 1 // 1<<64 - 1 wraps to all ones
	s.ws()
	if err := s.value(0, all); err != nil {
		return err
	}
	if s.ws(); s.pos != len(s.b) {
		return s.fail("data after the top-level value")
	}
	return nil
}

func (s *refScanner) fail(msg string) error { return &SyntaxError{s.pos, msg} }

func (s *refScanner) ws() {
	for s.pos < len(s.b) && strings.IndexByte(" \t\n\r", s.b[s.pos]) >= 0 {
		s.pos++
	}
}

func (s *refScanner) value(depth int, active uint64) error {
	if depth > MaxDepth {
		return s.fail("nesting too deep")
	}
	if s.pos >= len(s.b) {
		return s.fail("unexpected end of input")
	}
	switch c := s.b[s.pos]; {
	case c == '{':
		return s.object(depth, active)
	case c == '[':
		return s.array(depth)
	case c == '"':
		_, _, err := s.str()
		return err
	case c == '-' || c >= '0' && c <= '9':
		return s.number()
	case c == 't':
		return s.lit("true")
	case c == 'f':
		return s.lit("false")
	case c == 'n':
		return s.lit("null")
	}
	return s.fail("unexpected character")
}

func (s *refScanner) lit(word string) error {
	if !bytes.HasPrefix(s.b[s.pos:], []byte(word)) {
		return s.fail("invalid literal")
	}
	s.pos += len(word)
	return nil
}

func (s *refScanner) str() (raw []byte, escaped bool, err error) {
	s.pos++
	start := s.pos
	for s.pos < len(s.b) {
		switch c := s.b[s.pos]; {
		case c == '"':
			s.pos++
			return s.b[start : s.pos-1], escaped, nil
		case c == '\\':
			escaped = true
			if s.pos+1 >= len(s.b) {
				return nil, false, s.fail("unterminated escape")
			}
			switch s.b[s.pos+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.pos += 2
			case 'u':
				if s.pos+6 > len(s.b) {
					return nil, false, s.fail("short \\u escape")
				}
				for _, h := range s.b[s.pos+2 : s.pos+6] {
					if unhex(h) < 0 {
						return nil, false, s.fail("invalid \\u escape")
					}
				}
				s.pos += 6
			default:
				return nil, false, s.fail("invalid escape")
			}
		case c < 0x20:
			return nil, false, s.fail("control character in string")
		default:
			s.pos++
		}
	}
	return nil, false, s.fail("unterminated string")
}

func (s *refScanner) number() error {
	if s.b[s.pos] == '-' {
		s.pos++
	}
	switch {
	case s.pos < len(s.b) && s.b[s.pos] == '0':
		s.pos++
	case s.pos < len(s.b) && s.b[s.pos] >= '1' && s.b[s.pos] <= '9':
		s.digits()
	default:
		return s.fail("invalid number")
	}
	if s.pos < len(s.b) && s.b[s.pos] == '.' {
		s.pos++
		if s.digits() == 0 {
			return s.fail("invalid number fraction")
		}
	}
	if s.pos < len(s.b) && (s.b[s.pos] == 'e' || s.b[s.pos] == 'E') {
		s.pos++
		if s.pos < len(s.b) && (s.b[s.pos] == '+' || s.b[s.pos] == '-') {
			s.pos++
		}
		if s.digits() == 0 {
			return s.fail("invalid number exponent")
		}
	}
	return nil
}

func (s *refScanner) digits() int {
	n := 0
	for ; s.pos < len(s.b) && s.b[s.pos] >= '0' && s.b[s.pos] <= '9'; s.pos++ {
		n++
	}
	return n
}

func (s *refScanner) array(depth int) error {
	s.pos++
	if s.ws(); s.pos < len(s.b) && s.b[s.pos] == ']' {
		s.pos++
		return nil
	}
	for {
		s.ws()
		if err := s.value(depth+1, 0); err != nil {
			return err
		}
		if s.ws(); s.pos >= len(s.b) {
			return s.fail("unterminated array")
		}
		switch s.b[s.pos] {
		case ',':
			s.pos++
		case ']':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or ']'")
		}
	}
}

func (s *refScanner) object(depth int, active uint64) error {
	s.pos++
	if s.ws(); s.pos < len(s.b) && s.b[s.pos] == '}' {
		s.pos++
		return nil
	}
	for {
		if s.ws(); s.pos >= len(s.b) || s.b[s.pos] != '"' {
			return s.fail("expected member name")
		}
		key, _, err := s.str()
		if err != nil {
			return err
		}
		if s.ws(); s.pos >= len(s.b) || s.b[s.pos] != ':' {
			return s.fail("expected ':'")
		}
		s.pos++
		s.ws()
		// Which paths name this member at this depth, ending here or going
		// deeper. A repeated name replaces what an earlier one selected.
		name := string(appendUnescaped(nil, key))
		var ends, deeper uint64
		for i, segs := range s.fs.segs {
			if active&(1<<i) == 0 || segs[depth] != name {
				continue
			}
			s.spans[i] = Span{}
			if depth == len(segs)-1 {
				ends |= 1 << i
			} else {
				deeper |= 1 << i
			}
		}
		start := s.pos
		if err := s.value(depth+1, deeper); err != nil {
			return err
		}
		for i := range s.fs.segs {
			if ends&(1<<i) != 0 {
				s.spans[i] = Span{start, s.pos}
			}
		}
		if s.ws(); s.pos >= len(s.b) {
			return s.fail("unterminated object")
		}
		switch s.b[s.pos] {
		case ',':
			s.pos++
		case '}':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or '}'")
		}
	}
}

// checkAgainstReference runs Select and the reference scanner on
// payload and reports any difference in spans or errors.
func checkAgainstReference(t testing.TB, payload []byte, fs *Fields) {
	t.Helper()
	var got, want [MaxFields]Span
	gotErr := Select(payload, fs, &got)
	wantErr := refSelectFields(payload, fs, &want)
	if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
		t.Fatalf("Select(%.80q) = %v, reference %v", payload, gotErr, wantErr)
	}
	if gotErr == nil && got != want {
		t.Fatalf("Select(%.80q): spans %v, reference %v", payload, got[:len(fs.paths)], want[:len(fs.paths)])
	}
}

// referencePathSets are the field selections payloads are compared under.
var referencePathSets = [][]string{
	nil, // validation only
	jsonkeytest.PayloadPaths,
	jsonkeytest.FuzzPaths,
	{"items", "meta.tags", "report", "report.filters.currency", "x.y"},
	{strings.Repeat("a", 8), strings.Repeat("b", 63), strings.Repeat("c", 64), "k", "a.b"},
}

func referenceFieldSets(t testing.TB) []*Fields {
	var sets []*Fields
	for _, ps := range referencePathSets {
		if ps == nil {
			sets = append(sets, &Fields{})
		} else {
			sets = append(sets, mustFieldSet(t, ps...))
		}
	}
	return sets
}

func TestSelectFieldsMatchesReference(t *testing.T) {
	// Select reads strings 8 bytes at a time, skips unselected values
	// without recursion and takes short cuts for compact JSON: none of that
	// may change which spans it finds or where and why it fails. Compare it
	// with the reference on valid payloads, every prefix of them, and
	// random edits (with bytes that matter to the scanner).
	var indented bytes.Buffer
	if err := json.Indent(&indented, jsonkeytest.Payload4KB, "", "\t"); err != nil {
		t.Fatal(err)
	}
	seeds := [][]byte{jsonkeytest.Payload200B, jsonkeytest.Payload4KB, indented.Bytes()}
	for _, s := range []string{
		`{"a":1, "b" : {"c":"x","d":[1,{"e":2}],"n":null}, "t":true, "o":{}, "arr":[{"k":1}]}`,
		`{"aaaaaaaa":"12345678","bbbbbbbbbbbbbbb":"\u00e9\"\\\/\b\f\n\r\t","k":[[],{},[{}],-0.5e+7,true,false,null]}`,
		`{"` + strings.Repeat("b", 63) + `":{"x":1},"` + strings.Repeat("c", 64) + `":2,"k\u0000":3,"k":"` + strings.Repeat("é", 9) + `"}`,
		"{\"k\xff\":1,\"k\\ufffd\":2,\"a\":{\"b\":{\"c\":\"\xed\xa0\x80\"}},\"a\":{\"b\":{\"c\":3}}}",
		` [ 1 , "x" , { "a" : { "b" : [ ] } } ] `,
		jsonkeytest.Deep(MaxDepth, false), jsonkeytest.Deep(MaxDepth, true),
		strings.Repeat(`{"a":`, MaxDepth) + `{"b":1}` + strings.Repeat("}", MaxDepth),
		strings.Repeat(`[`, MaxDepth) + `{"b":[]}` + strings.Repeat("]", MaxDepth),
	} {
		seeds = append(seeds, []byte(s))
	}
	for _, bad := range jsonkeytest.BadJSON {
		seeds = append(seeds, []byte(bad.In))
	}
	sets := referenceFieldSets(t)
	check := func(p []byte) {
		for _, fs := range sets {
			checkAgainstReference(t, p, fs)
		}
	}
	const edits = " \t\n\r{}[]:,\"\\/ubfnrt0123456789-+.eE\x00\x1f\x7f\x80\xff"
	rng := rand.New(rand.NewPCG(1, 2))
	for _, seed := range seeds {
		step := 1 // every prefix of short seeds, a sample of long ones
		if len(seed) > 500 {
			step = 7 // not a multiple of 8, so the word offsets vary
		}
		for n := 0; n <= len(seed); n += step {
			check(seed[:n])
		}
		p := make([]byte, len(seed)+1)
		for range 200 {
			p = append(p[:0], seed...)
			for range 1 + rng.IntN(3) {
				i := rng.IntN(len(p) + 1)
				c := edits[rng.IntN(len(edits))]
				switch {
				case i == len(p) || rng.IntN(3) == 0:
					p = slices.Insert(p, i, c)
				case rng.IntN(2) == 0:
					p = slices.Delete(p, i, i+1)
				default:
					p[i] = c
				}
			}
			check(p)
		}
	}
}

func FuzzSelectFields(f *testing.F) {
	f.Add([]byte(jsonkeytest.Payload200B), "report.kind")
	f.Add([]byte(`{"a":{"b":[1,"\u00e9\"",{"c":null}]},"a":{"b":2}}`), "a.b")
	f.Add([]byte(`{"aaaaaaaa":"x\ty","k":01}`), "aaaaaaaa")
	f.Add([]byte(jsonkeytest.Deep(MaxDepth, true)), "")
	f.Fuzz(func(t *testing.T, payload []byte, path string) {
		paths := jsonkeytest.FuzzPaths
		if _, err := Compile([]string{path}); err == nil {
			paths = append(paths[:len(paths):len(paths)], path)
		}
		checkAgainstReference(t, payload, mustFieldSet(t, paths...))
		checkAgainstReference(t, payload, &Fields{})
	})
}
