package dedup

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// Tests of field selection (compileFields, selectFields) and of the canonical
// JSON encoding (appendCanonical). Fingerprint-level tests are in
// fingerprint_test.go; property and fuzz tests too.

// mustFieldSet compiles paths or fails the test.
func mustFieldSet(t testing.TB, paths ...string) *fieldSet {
	t.Helper()
	fs, err := compileFields(paths)
	if err != nil {
		t.Fatalf("compileFields(%q): %v", paths, err)
	}
	return fs
}

// canonJSON validates v as one JSON value, as fingerprint does before it
// encodes anything, and returns its canonical encoding.
func canonJSON(v []byte) ([]byte, error) {
	var spans [maxFields]span
	if err := selectFields(v, &fieldSet{}, &spans); err != nil {
		return nil, err
	}
	return appendCanonical(nil, v)
}

func mustCanon(t testing.TB, v string) []byte {
	t.Helper()
	c, err := canonJSON([]byte(v))
	if err != nil {
		t.Fatalf("canonical encoding of %q: %v", v, err)
	}
	return c
}

// selected runs selectFields and returns each path's raw value text, or
// "<missing>".
func selected(t testing.TB, payload string, paths ...string) map[string]string {
	t.Helper()
	fs := mustFieldSet(t, paths...)
	var spans [maxFields]span
	if err := selectFields([]byte(payload), fs, &spans); err != nil {
		t.Fatalf("selectFields(%q): %v", payload, err)
	}
	out := make(map[string]string, len(fs.paths))
	for i, p := range fs.paths {
		if sp := spans[i]; sp.end == 0 {
			out[p] = "<missing>"
		} else {
			out[p] = payload[sp.start:sp.end]
		}
	}
	return out
}

func TestCompileFields(t *testing.T) {
	t.Run("none", func(t *testing.T) {
		for _, in := range [][]string{nil, {}} {
			fs, err := compileFields(in)
			if fs != nil || err != nil {
				t.Errorf("compileFields(%q) = %v, %v; want nil, nil", in, fs, err)
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
			t.Errorf("compileFields reordered the caller's slice: %q", in)
		}
	})
	t.Run("empty segment", func(t *testing.T) {
		for _, p := range []string{"", ".", "a.", ".a", "a..b", "a.b.", "..."} {
			fs, err := compileFields([]string{"ok", p})
			if !errors.Is(err, ErrInvalidOption) || fs != nil {
				t.Errorf("compileFields(%q) = %v, %v; want ErrInvalidOption", p, fs, err)
			}
		}
	})
	t.Run("limit", func(t *testing.T) {
		var ps []string
		for i := range maxFields {
			ps = append(ps, fmt.Sprintf("f%d", i))
		}
		if _, err := compileFields(ps); err != nil {
			t.Errorf("%d fields: %v", maxFields, err)
		}
		// Duplicates don't count towards the limit.
		if _, err := compileFields(append(ps, ps[:10]...)); err != nil {
			t.Errorf("%d fields with duplicates: %v", maxFields, err)
		}
		if _, err := compileFields(append(ps, "one.more")); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%d fields: err = %v, want ErrInvalidOption", maxFields+1, err)
		}
	})
	t.Run("unusual but valid", func(t *testing.T) {
		// Paths are matched against decoded member names byte for byte; any
		// non-empty segment is allowed, including ones that look like JSON
		// escapes (they are not decoded).
		for _, p := range []string{"é", `a\`, `\u0061`, "a b", "0", "a.0.b", `"`} {
			if _, err := compileFields([]string{p}); err != nil {
				t.Errorf("compileFields(%q): %v", p, err)
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
	for i := range maxFields {
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

// badJSON lists inputs that are not one valid JSON value.
var badJSON = []struct{ name, in string }{
	{"empty", ""},
	{"white space only", " \t\n"},
	{"plain text", "hello"},
	{"open object", "{"},
	{"close object", "}"},
	{"open array", "["},
	{"truncated member", `{"a":`},
	{"truncated name", `{"a`},
	{"truncated value", `{"a":"b`},
	{"truncated literal", `{"a":tru`},
	{"truncated nested", `{"a":{"b":[1,2`},
	{"missing colon", `{"a" 1}`},
	{"missing value", `{"a":}`},
	{"missing comma", `{"a":1 "b":2}`},
	{"array missing comma", `[1 2]`},
	{"trailing comma object", `{"a":1,}`},
	{"trailing comma array", `[1,]`},
	{"leading comma array", `[,1]`},
	{"lone comma object", `{,}`},
	{"unquoted name", `{a:1}`},
	{"single quotes", `{'a':1}`},
	{"non-string name", `{1:1}`},
	{"trailing garbage", `{"a":1}x`},
	{"two values", `{"a":1} {"a":1}`},
	{"trailing NUL", "{\"a\":1}\x00"},
	{"trailing bracket", `{"a":1}}`},
	{"BOM", "\xef\xbb\xbf{\"a\":1}"},
	{"comment", `{"a":1 /* c */}`},
	{"raw control char", "{\"a\":\"x\x01y\"}"},
	{"raw newline in string", "{\"a\":\"x\ny\"}"},
	{"raw tab in string", "{\"a\":\"x\ty\"}"},
	{"raw NUL in string", "{\"a\":\"x\x00\"}"},
	{"control char in name", "{\"a\x1f\":1}"},
	{"invalid escape", `{"a":"\x41"}`},
	{"invalid escape quote", `{"a":"\'"}`},
	{"short unicode escape", `{"a":"\u12"}`},
	{"short unicode escape at end", `"\u12`},
	{"non-hex unicode escape", `{"a":"\u12G4"}`},
	{"uppercase U escape", `{"a":"\U0041"}`},
	{"backslash at end", `"abc\`},
	{"escape in name", `{"\q":1}`},
	{"leading zero", `{"a":01}`},
	{"leading zeros negative", `-00`},
	{"plus sign", `+1`},
	{"double minus", `--1`},
	{"lone minus", `-`},
	{"dot first", `.5`},
	{"dot last", `1.`},
	{"exponent without digits", `1e`},
	{"exponent sign only", `1e+`},
	{"double exponent", `1e2e3`},
	{"hex number", `0x10`},
	{"Infinity", `Infinity`},
	{"NaN", `NaN`},
	{"capital literal", `True`},
	{"literal prefix", `nul`},
	{"literal suffix", `nulll`},
	{"literal glued", `truefalse`},
}

// deepJSON nests n arrays (or objects) around a scalar.
func deepJSON(n int, object bool) string {
	if object {
		return strings.Repeat(`{"a":`, n) + "1" + strings.Repeat("}", n)
	}
	return strings.Repeat("[", n) + "1" + strings.Repeat("]", n)
}

func TestSelectFieldsRejectsInvalid(t *testing.T) {
	fs := mustFieldSet(t, "a", "a.b")
	run := func(t *testing.T, in string) {
		t.Helper()
		var spans [maxFields]span
		err := selectFields([]byte(in), fs, &spans)
		var je *jsonError
		if !errors.As(err, &je) {
			t.Fatalf("selectFields(%.40q) = %v, want a *jsonError", in, err)
		}
		if je.off < 0 || je.off > len(in) {
			t.Errorf("error offset %d outside the input (len %d)", je.off, len(in))
		}
	}
	for _, tt := range badJSON {
		t.Run(tt.name, func(t *testing.T) { run(t, tt.in) })
	}
	for _, n := range []int{maxDepth + 1, 1000, 100_000, 1_000_000} {
		t.Run(fmt.Sprintf("nesting %d arrays", n), func(t *testing.T) { run(t, deepJSON(n, false)) })
		t.Run(fmt.Sprintf("nesting %d objects", n), func(t *testing.T) { run(t, deepJSON(n, true)) })
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
		deepJSON(maxDepth, false), deepJSON(maxDepth, true),
	} {
		var spans [maxFields]span
		if err := selectFields([]byte(in), fs, &spans); err != nil {
			t.Errorf("selectFields(%.60q): %v", in, err)
		}
	}
}

// canonCase is a pair of JSON texts and whether they must encode equally.
type canonCase struct {
	a, b string
	eq   bool
}

// canonCases are the equivalences (and non-equivalences) of values; the
// fingerprint tests reuse them for selected fields.
var canonCases = []canonCase{
	// Object member order and white space.
	{`{"a":1,"b":2}`, `{"b":2,"a":1}`, true},
	{`{"a":1,"b":{"x":[1,2],"y":null}}`, `{"b":{"y":null,"x":[1,2]},"a":1}`, true},
	{` { "a" : [ 1 , 2 ] } `, `{"a":[1,2]}`, true},
	{"{\n\t\"a\":\r\n[1,\t2]\n}", `{"a":[1,2]}`, true},
	{`[ ]`, `[]`, true},
	{`{ }`, `{}`, true},
	// String escapes.
	{`"\u00e9"`, `"é"`, true},
	{`"\u00E9"`, `"é"`, true},
	{`"e\u0301"`, `"é"`, false}, // no Unicode normalisation
	{`"\/"`, `"/"`, true},
	{`"\ud83d\ude00"`, `"😀"`, true},
	{`"\uD83D\uDE00"`, `"😀"`, true},
	{`"\n"`, `"\u000a"`, true},
	{`"\""`, `"\u0022"`, true},
	{`"\\"`, `"\u005c"`, true},
	{`"\b\f\n\r\t"`, `"\u0008\u000c\u000A\u000d\u0009"`, true},
	{`"<>&"`, `"\u003c\u003e\u0026"`, true},
	{`"\u2028"`, "\"\u2028\"", true},
	{`"\u0000"`, `""`, false},
	{`"a\u0000"`, `"a"`, false},
	{`"\u0000"`, `"\u0001"`, false},
	{`"\u0001"`, `"\u0001\u0001"`, false},
	{`"a\u0000b"`, `"a\u0000b"`, true},
	// Invalid UTF-8 and lone surrogates become U+FFFD, as in encoding/json.
	{"\"\xff\"", `"\ufffd"`, true},
	{"\"\xff\xfe\"", `"\ufffd\ufffd"`, true},
	{"\"\xed\xa0\x80\"", `"\ufffd\ufffd\ufffd"`, true}, // UTF-8 encoded surrogate
	{`"\ud800"`, `"\ufffd"`, true},
	{`"\udc00"`, `"\ufffd"`, true},
	{`"\ud800A"`, `"\ufffdA"`, true},
	{`"\ud800\u0041"`, `"\ufffdA"`, true},
	{`"\ude00\ud83d"`, `"\ufffd\ufffd"`, true}, // pair in the wrong order
	{`"\ud83d\ud83d\ude00"`, `"\ufffd😀"`, true},
	// Numbers compare as exact decimals.
	{`1`, `1.0`, true},
	{`1`, `1e0`, true},
	{`1`, `1E0`, true},
	{`1`, `1e+0`, true},
	{`1`, `10e-1`, true},
	{`1`, `0.1e1`, true},
	{`1`, `1.000e00`, true},
	{`1`, `0.0001e4`, true},
	{`-0`, `0`, true},
	{`0`, `0.0`, true},
	{`0`, `-0.000e-7`, true},
	{`0`, `0e999`, true},
	{`100`, `1e2`, true},
	{`100`, `1E+2`, true},
	{`100`, `100.00`, true},
	{`100`, `0.001e5`, true},
	{`-1.5`, `-15e-1`, true},
	{`-1.5`, `-0.15E1`, true},
	{`123456789012345678901234567890`, `1.23456789012345678901234567890e29`, true},
	{`9007199254740992`, `9007199254740993`, false}, // 2^53, 2^53+1: one float64
	{`9007199254740993`, `9.007199254740993e15`, true},
	{`0.1`, `0.10000000000000001`, false}, // one float64
	{`1e400`, `1e401`, false},             // both +Inf as float64
	{`1e-400`, `0`, false},                // 0 as float64
	{`1e-400`, `10e-401`, true},
	{`1`, `-1`, false},
	{`1`, `10`, false},
	{`1.5`, `15`, false},
	{`0.01`, `0.1`, false},
	{`12`, `21`, false},
	// Types are distinct.
	{`1`, `"1"`, false},
	{`true`, `"true"`, false},
	{`false`, `"false"`, false},
	{`null`, `"null"`, false},
	{`null`, `""`, false},
	{`null`, `0`, false},
	{`null`, `false`, false},
	{`false`, `0`, false},
	{`true`, `1`, false},
	{`true`, `false`, false},
	{`[]`, `{}`, false},
	{`[]`, `""`, false},
	{`[]`, `null`, false},
	{`[]`, `[null]`, false},
	{`{}`, `{"a":null}`, false},
	{`[[]]`, `[]`, false},
	{`[1]`, `1`, false},
	{`{"a":[1]}`, `{"a":1}`, false},
	// Structure is unambiguous.
	{`[1,2]`, `[2,1]`, false},
	{`["a","b"]`, `["ab"]`, false},
	{`["ab",""]`, `["a","b"]`, false},
	{`[["a"],"b"]`, `["a",["b"]]`, false},
	{`[[],[]]`, `[[[]]]`, false},
	{`{"a":"bc"}`, `{"ab":"c"}`, false},
	{`{"a":{"b":1}}`, `{"a":{},"b":1}`, false},
	{`{"a":1,"b":2}`, `{"a":2,"b":1}`, false},
	{`{"a":[1,2]}`, `{"a":[1],"b":[2]}`, false},
	{`["\u0000",""]`, `["","\u0000"]`, false},
	// Member names decode like strings.
	{`{"\u0061":1}`, `{"a":1}`, true},
	{`{"\/":1}`, `{"/":1}`, true},
	{`{"a":1}`, `{"A":1}`, false},
	// Duplicate member names: the last one wins, as in encoding/json.
	{`{"a":1,"a":2}`, `{"a":2}`, true},
	{`{"a":1,"a":2}`, `{"a":1}`, false},
	{`{"a":1,"b":0,"a":2}`, `{"b":0,"a":2}`, true},
	{`{"a":{"x":1},"a":{"y":2}}`, `{"a":{"y":2}}`, true},
	{`{"a":1,"\u0061":2}`, `{"a":2}`, true},
	{`{"a":1,"a":2,"a":3}`, `{"a":3}`, true},
	{`[{"a":1,"a":2}]`, `[{"a":2}]`, true},
}

func TestAppendCanonical(t *testing.T) {
	for _, tc := range canonCases {
		ca, cb := mustCanon(t, tc.a), mustCanon(t, tc.b)
		if got := bytes.Equal(ca, cb); got != tc.eq {
			t.Errorf("canonical(%s) == canonical(%s): %v, want %v\n  %q\n  %q", tc.a, tc.b, got, tc.eq, ca, cb)
		}
	}
}

func TestAppendCanonicalAppends(t *testing.T) {
	// appendCanonical appends to dst and leaves what is there alone.
	dst := []byte("prefix")
	out, err := appendCanonical(dst, []byte(`{"b":[1,"x"],"a":null}`))
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
	for _, tc := range canonCases {
		encs = append(encs, mustCanon(t, tc.a), mustCanon(t, tc.b))
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
// reference for selectFields, which must find the same spans and fail with
// the same error (offset and message) for every input. (selectFields was
// this scanner before it was tuned.)
type refScanner struct {
	b     []byte
	pos   int
	fs    *fieldSet
	spans *[maxFields]span
}

func refSelectFields(payload []byte, fs *fieldSet, spans *[maxFields]span) error {
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

func (s *refScanner) fail(msg string) error { return &jsonError{s.pos, msg} }

func (s *refScanner) ws() {
	for s.pos < len(s.b) && strings.IndexByte(" \t\n\r", s.b[s.pos]) >= 0 {
		s.pos++
	}
}

func (s *refScanner) value(depth int, active uint64) error {
	if depth > maxDepth {
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
			s.spans[i] = span{}
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
				s.spans[i] = span{start, s.pos}
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

// checkAgainstReference runs selectFields and the reference scanner on
// payload and reports any difference in spans or errors.
func checkAgainstReference(t testing.TB, payload []byte, fs *fieldSet) {
	t.Helper()
	var got, want [maxFields]span
	gotErr := selectFields(payload, fs, &got)
	wantErr := refSelectFields(payload, fs, &want)
	if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
		t.Fatalf("selectFields(%.80q) = %v, reference %v", payload, gotErr, wantErr)
	}
	if gotErr == nil && got != want {
		t.Fatalf("selectFields(%.80q): spans %v, reference %v", payload, got[:len(fs.paths)], want[:len(fs.paths)])
	}
}

// referencePathSets are the field selections payloads are compared under.
var referencePathSets = [][]string{
	nil, // validation only
	benchPaths,
	fuzzPaths,
	{"items", "meta.tags", "report", "report.filters.currency", "x.y"},
	{strings.Repeat("a", 8), strings.Repeat("b", 63), strings.Repeat("c", 64), "k", "a.b"},
}

func referenceFieldSets(t testing.TB) []*fieldSet {
	var sets []*fieldSet
	for _, ps := range referencePathSets {
		if ps == nil {
			sets = append(sets, &fieldSet{})
		} else {
			sets = append(sets, mustFieldSet(t, ps...))
		}
	}
	return sets
}

func TestSelectFieldsMatchesReference(t *testing.T) {
	// selectFields reads strings 8 bytes at a time, skips unselected values
	// without recursion and takes short cuts for compact JSON: none of that
	// may change which spans it finds or where and why it fails. Compare it
	// with the reference on valid payloads, every prefix of them, and
	// random edits (with bytes that matter to the scanner).
	var indented bytes.Buffer
	if err := json.Indent(&indented, benchLarge, "", "\t"); err != nil {
		t.Fatal(err)
	}
	seeds := [][]byte{benchSmall, benchLarge, indented.Bytes()}
	for _, s := range []string{
		`{"a":1, "b" : {"c":"x","d":[1,{"e":2}],"n":null}, "t":true, "o":{}, "arr":[{"k":1}]}`,
		`{"aaaaaaaa":"12345678","bbbbbbbbbbbbbbb":"\u00e9\"\\\/\b\f\n\r\t","k":[[],{},[{}],-0.5e+7,true,false,null]}`,
		`{"` + strings.Repeat("b", 63) + `":{"x":1},"` + strings.Repeat("c", 64) + `":2,"k\u0000":3,"k":"` + strings.Repeat("é", 9) + `"}`,
		"{\"k\xff\":1,\"k\\ufffd\":2,\"a\":{\"b\":{\"c\":\"\xed\xa0\x80\"}},\"a\":{\"b\":{\"c\":3}}}",
		` [ 1 , "x" , { "a" : { "b" : [ ] } } ] `,
		deepJSON(maxDepth, false), deepJSON(maxDepth, true),
		strings.Repeat(`{"a":`, maxDepth) + `{"b":1}` + strings.Repeat("}", maxDepth),
		strings.Repeat(`[`, maxDepth) + `{"b":[]}` + strings.Repeat("]", maxDepth),
	} {
		seeds = append(seeds, []byte(s))
	}
	for _, bad := range badJSON {
		seeds = append(seeds, []byte(bad.in))
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
	f.Add([]byte(benchSmall), "report.kind")
	f.Add([]byte(`{"a":{"b":[1,"\u00e9\"",{"c":null}]},"a":{"b":2}}`), "a.b")
	f.Add([]byte(`{"aaaaaaaa":"x\ty","k":01}`), "aaaaaaaa")
	f.Add([]byte(deepJSON(maxDepth, true)), "")
	f.Fuzz(func(t *testing.T, payload []byte, path string) {
		paths := fuzzPaths
		if _, err := compileFields([]string{path}); err == nil {
			paths = append(paths[:len(paths):len(paths)], path)
		}
		checkAgainstReference(t, payload, mustFieldSet(t, paths...))
		checkAgainstReference(t, payload, &fieldSet{})
	})
}
