// Package jsonkeytest holds JSON test inputs shared by the tests of package
// jsonkey and of the packages that use it: malformed JSON, pairs of values
// that must (or must not) encode equally, and typical task payloads. It
// imports nothing of this module, so jsonkey's own tests can use it.
package jsonkeytest

import (
	"fmt"
	"strings"
)

// Payload200B is a ~200 byte task payload. The selected fields sit early
// (user_id), in a nested object (report.kind) and last (tenant).
var Payload200B = []byte(`{"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","user_id":1234567,` +
	`"report":{"kind":"daily","format":"pdf","range":{"from":"2024-01-01","to":"2024-01-31"}},` +
	`"locale":"en-GB","priority":3,"tenant":"acme-corp"}`)

// Payload4KB is a ~4 KB task payload of the same shape, with a long array of
// line items between report and tenant, so tenant is near the end.
var Payload4KB = func() []byte {
	var sb strings.Builder
	sb.WriteString(`{"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","user_id":1234567,`)
	sb.WriteString(`"meta":{"source":"web","ip":"203.0.113.7","ua":"Mozilla/5.0 (X11; Linux x86_64)","tags":["a","b","c"]},`)
	sb.WriteString(`"report":{"kind":"daily","format":"pdf","range":{"from":"2024-01-01","to":"2024-01-31"},` +
		`"filters":{"region":["eu-west-1","us-east-1"],"min_amount":12.50,"currency":"EUR","include_refunds":false}},`)
	sb.WriteString(`"items":[`)
	for i := 0; i < 28; i++ {
		if i > 0 {
			sb.WriteByte(',')
		}
		fmt.Fprintf(&sb, `{"sku":"SKU-%06d","name":"Item n\u00b0%d \"deluxe\"","qty":%d,"price":%d.%02d,"attrs":{"color":"blue","size":null}}`,
			i*7919, i, i%5+1, 10+i, i%100)
	}
	sb.WriteString(`],"locale":"en-GB","priority":3,"tenant":"acme-corp","requested_at":"2024-02-01T08:00:00Z"}`)
	return []byte(sb.String())
}()

// PayloadPaths are the three paths the benchmarks select from Payload200B
// and Payload4KB.
var PayloadPaths = []string{"user_id", "report.kind", "tenant"}

// FuzzPaths are paths the fuzz targets select, besides one the fuzzer picks:
// nested, non-ASCII, and U+FFFD (what invalid UTF-8 in a name decodes to).
var FuzzPaths = []string{"a", "b.c", "é", "k\uFFFD", "a.b.c"}

// Deep nests n arrays (or objects, each with one member "a") around a
// scalar.
func Deep(n int, object bool) string {
	if object {
		return strings.Repeat(`{"a":`, n) + "1" + strings.Repeat("}", n)
	}
	return strings.Repeat("[", n) + "1" + strings.Repeat("]", n)
}

// BadJSON lists inputs that are not one valid JSON value.
var BadJSON = []struct {
	Name string // what is wrong, for subtest names
	In   string // the input
}{
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

// CanonCase is a pair of JSON texts and whether they must encode equally.
type CanonCase struct {
	A, B  string // two JSON values
	Equal bool   // whether encoding/json decodes them equally
}

// CanonCases are the equivalences (and non-equivalences) of values, for the
// canonical encoding and for keys made from selected fields.
var CanonCases = []CanonCase{
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
