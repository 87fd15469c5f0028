package dedup

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"testing"
	"unicode/utf16"

	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/asynq-dedup/dedup/internal/jsonkey/jsonkeytest"

	"pgregory.net/rapid"
)

// Tests of fingerprint: which payloads share a key and which don't, errors
// for payloads that cannot be fingerprinted, property tests over random JSON
// spelled in random equivalent ways, and FuzzFingerprint.

// mustFieldSet compiles paths or fails the test.
func mustFieldSet(t testing.TB, paths ...string) *jsonkey.Fields {
	t.Helper()
	fs, err := jsonkey.Compile(paths)
	if err != nil {
		t.Fatalf("jsonkey.Compile(%q): %v", paths, err)
	}
	return fs
}

// canonJSON validates v as one JSON value, as fingerprint does before it
// encodes anything, and returns its canonical encoding.
func canonJSON(v []byte) ([]byte, error) {
	var spans [jsonkey.MaxFields]jsonkey.Span
	if err := jsonkey.Select(v, nil, &spans); err != nil {
		return nil, err
	}
	return jsonkey.AppendCanonical(nil, v)
}

func fieldsRule(t testing.TB, paths ...string) *resolved {
	t.Helper()
	return &resolved{fields: mustFieldSet(t, paths...)}
}

func keyRule(key string, shared bool) *resolved {
	return &resolved{key: key, hasKey: true, shared: shared}
}

func mustFP(t testing.TB, typ, payload string, r *resolved) uint64 {
	t.Helper()
	fp, err := fingerprint(typ, []byte(payload), r)
	if err != nil {
		t.Fatalf("fingerprint(%q, %.80q): %v", typ, payload, err)
	}
	return fp
}

// TestFingerprintGolden pins the key of a few tasks. A deployment runs old
// and new versions side by side during a rollout; if they computed different
// keys for one task, duplicates would get through. A change here must be
// deliberate (bump fingerprintVersion and say so in the release notes).
func TestFingerprintGolden(t *testing.T) {
	tests := []struct {
		name, typ, payload string
		r                  *resolved
		want               uint64
	}{
		{"raw", "email:send", `{"to":"a@example.com","n":1}`, &resolved{}, 0xcb7bb699f449ba5d},
		{"one field", "email:send", `{"to":"a@example.com","n":1}`, fieldsRule(t, "to"), 0x8ffdf8ff41652551},
		{"fields", "report:build",
			`{"user_id":42,"report":{"kind":"daily","opts":[1,"x",null,true,{"b":1,"a":2}]},"trace_id":"t1"}`,
			fieldsRule(t, "user_id", "report.kind", "report.opts"), 0x5fd6aaeb088e226a},
		{"missing as null", "report:build", `{}`,
			&resolved{fields: mustFieldSet(t, "user_id"), missingAsNull: true}, 0x391ca68aa70e4b08},
		{"key", "email:send", ``, keyRule("user-42", false), 0x7776cb0e082ea048},
		{"shared key", "email:send", ``, keyRule("user-42", true), 0x3a2d0bf92a9ea7fb},
	}
	for _, tt := range tests {
		if got := mustFP(t, tt.typ, tt.payload, tt.r); got != tt.want {
			t.Errorf("%s: fingerprint = %#016x, want %#016x", tt.name, got, tt.want)
		}
	}
}

func TestFingerprintSelectedValueEquivalence(t *testing.T) {
	// Every canonical-encoding case, as a selected field inside payloads
	// whose other members and layout differ.
	r := fieldsRule(t, "v")
	nested := fieldsRule(t, "report.kind")
	for _, tc := range jsonkeytest.CanonCases {
		pa := `{"trace_id":"4bf92f35","v":` + tc.A + `}`
		pb := "{ \"v\" : " + tc.B + " ,\n\"trace_id\":\"00f067aa\", \"extra\":[1,{}]}"
		if got := mustFP(t, "t", pa, r) == mustFP(t, "t", pb, r); got != tc.Equal {
			t.Errorf("v=%s vs v=%s: same fingerprint %v, want %v", tc.A, tc.B, got, tc.Equal)
		}
		na := `{"report":{"kind":` + tc.A + `,"id":1},"id":2}`
		nb := `{"id":3,"report":{"id":4,"kind":` + tc.B + `}}`
		if got := mustFP(t, "t", na, nested) == mustFP(t, "t", nb, nested); got != tc.Equal {
			t.Errorf("report.kind=%s vs %s: same fingerprint %v, want %v", tc.A, tc.B, got, tc.Equal)
		}
	}
}

func TestFingerprintSame(t *testing.T) {
	tests := []struct {
		name   string
		ta, pa string
		ra     *resolved
		tb, pb string
		rb     *resolved
	}{
		{"key order", "t", `{"a":1,"b":"x"}`, fieldsRule(t, "a", "b"), "t", `{"b":"x","a":1}`, fieldsRule(t, "a", "b")},
		{"white space", "t", `{"a":[1,2],"b":{"c":null}}`, fieldsRule(t, "a", "b"),
			"t", "\n{ \"b\" : { \"c\" :\tnull } ,\r\n \"a\" : [ 1 , 2 ] }\n", fieldsRule(t, "a", "b")},
		{"unselected fields ignored", "t", `{"user_id":7,"trace_id":"aaaa"}`, fieldsRule(t, "user_id"),
			"t", `{"trace_id":"bbbb","user_id":7,"sent_at":"2024-01-01T00:00:00Z"}`, fieldsRule(t, "user_id")},
		{"field list order", "t", `{"a":1,"b":2}`, fieldsRule(t, "a", "b"), "t", `{"a":1,"b":2}`, fieldsRule(t, "b", "a")},
		{"field listed twice", "t", `{"a":1,"b":2}`, fieldsRule(t, "a", "b", "a"), "t", `{"a":1,"b":2}`, fieldsRule(t, "b", "a")},
		{"nested path", "t", `{"report":{"kind":"daily","id":1},"x":1}`, fieldsRule(t, "report.kind"),
			"t", `{"x":2,"report":{"id":2,"kind":"\u0064aily"}}`, fieldsRule(t, "report.kind")},
		{"numbers", "t", `{"n":100,"m":-0,"f":1}`, fieldsRule(t, "n", "m", "f"),
			"t", `{"n":1e2,"m":0,"f":0.1e1}`, fieldsRule(t, "n", "m", "f")},
		{"escapes", "t", `{"s":"é/😀"}`, fieldsRule(t, "s"), "t", `{"s":"\u00e9\/\ud83d\ude00"}`, fieldsRule(t, "s")},
		{"duplicate member last wins", "t", `{"a":1,"a":2}`, fieldsRule(t, "a"), "t", `{"a":2}`, fieldsRule(t, "a")},
		{"duplicate parent last wins", "t", `{"r":{"k":1},"r":{"k":2}}`, fieldsRule(t, "r.k"), "t", `{"r":{"k":2}}`, fieldsRule(t, "r.k")},
		{"missing as null", "t", `{"a":1}`, &resolved{fields: mustFieldSet(t, "a", "b"), missingAsNull: true},
			"t", `{"a":1,"b":null}`, &resolved{fields: mustFieldSet(t, "a", "b"), missingAsNull: true}},
		{"missing parent as null", "t", `{"a":1,"r":5}`, &resolved{fields: mustFieldSet(t, "a", "r.k"), missingAsNull: true},
			"t", `{"a":1,"r":{"k":null}}`, &resolved{fields: mustFieldSet(t, "a", "r.k"), missingAsNull: true}},
		{"explicit key ignores payload", "t", `{"a":1}`, keyRule("k", false), "t", "\x00not json", keyRule("k", false)},
		{"explicit key ignores fields", "t", `{"a":1}`, &resolved{fields: mustFieldSet(t, "a"), key: "k", hasKey: true},
			"t", `not json`, keyRule("k", false)},
		{"shared key across types", "email:send", `1`, keyRule("user-1", true), "sms:send", `2`, keyRule("user-1", true)},
		{"key func result is the key", "t", `{"id":"k"}`,
			&resolved{keyFunc: func(string, []byte) (string, error) { return "k", nil }, key: "other", hasKey: true},
			"t", `x`, keyRule("k", false)},
		{"raw payload", "t", "\x0a\x03foo\x10\x96\x01", &resolved{}, "t", "\x0a\x03foo\x10\x96\x01", &resolved{}},
		{"raw nil and empty", "t", "", &resolved{}, "t", "", &resolved{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := mustFP(t, tt.ta, tt.pa, tt.ra), mustFP(t, tt.tb, tt.pb, tt.rb)
			if a != b {
				t.Errorf("fingerprints differ: %#016x != %#016x", a, b)
			}
		})
	}
}

func TestFingerprintDistinct(t *testing.T) {
	withFunc := func(key string) *resolved {
		return &resolved{keyFunc: func(string, []byte) (string, error) { return key, nil }}
	}
	sharedFields := &resolved{fields: mustFieldSet(t, "a"), shared: true}
	tests := []struct {
		name   string
		ta, pa string
		ra     *resolved
		tb, pb string
		rb     *resolved
	}{
		{"2^53 vs 2^53+1", "t", `{"n":9007199254740992}`, fieldsRule(t, "n"), "t", `{"n":9007199254740993}`, fieldsRule(t, "n")},
		{"number vs string", "t", `{"a":1}`, fieldsRule(t, "a"), "t", `{"a":"1"}`, fieldsRule(t, "a")},
		{"bool vs string", "t", `{"a":true}`, fieldsRule(t, "a"), "t", `{"a":"true"}`, fieldsRule(t, "a")},
		{"null vs string", "t", `{"a":null}`, fieldsRule(t, "a"), "t", `{"a":"null"}`, fieldsRule(t, "a")},
		{"selected value", "t", `{"user_id":1,"x":0}`, fieldsRule(t, "user_id"), "t", `{"user_id":2,"x":0}`, fieldsRule(t, "user_id")},
		{"nested value", "t", `{"report":{"kind":"daily"}}`, fieldsRule(t, "report.kind"),
			"t", `{"report":{"kind":"weekly"}}`, fieldsRule(t, "report.kind")},
		{"path name", "t", `{"a":1}`, fieldsRule(t, "a"), "t", `{"b":1}`, fieldsRule(t, "b")},
		{"path depth", "t", `{"a":{"b":1}}`, fieldsRule(t, "a.b"), "t", `{"a":{"b":1}}`, fieldsRule(t, "a")},
		{"values split across fields", "t", `{"a":"x","b":"yz"}`, fieldsRule(t, "a", "b"), "t", `{"a":"xy","b":"z"}`, fieldsRule(t, "a", "b")},
		{"values swapped", "t", `{"a":1,"b":2}`, fieldsRule(t, "a", "b"), "t", `{"a":2,"b":1}`, fieldsRule(t, "a", "b")},
		{"extra field selected", "t", `{"a":1,"b":null}`, fieldsRule(t, "a"), "t", `{"a":1,"b":null}`, fieldsRule(t, "a", "b")},
		{"type, raw", "email:send", `{"a":1}`, &resolved{}, "sms:send", `{"a":1}`, &resolved{}},
		{"type, fields", "email:send", `{"a":1}`, fieldsRule(t, "a"), "sms:send", `{"a":1}`, fieldsRule(t, "a")},
		{"type, key", "email:send", ``, keyRule("k", false), "sms:send", ``, keyRule("k", false)},
		{"type, key func", "email:send", ``, withFunc("k"), "sms:send", ``, withFunc("k")},
		{"key", "t", ``, keyRule("k1", false), "t", ``, keyRule("k2", false)},
		{"key namespaced unless shared", "t", ``, keyRule("k", false), "t", ``, keyRule("k", true)},
		{"type and key unambiguous", "a:b", ``, keyRule("c", false), "a", ``, keyRule("b:c", false)},
		{"type and key unambiguous, no separator", "ab", ``, keyRule("c", false), "a", ``, keyRule("bc", false)},
		{"type and key unambiguous, NUL", "a\x00", ``, keyRule("b", false), "a", ``, keyRule("\x00b", false)},
		{"type and payload unambiguous", "ab", `c`, &resolved{}, "a", `bc`, &resolved{}},
		{"key vs raw payload", "t", `k`, keyRule("k", false), "t", `k`, &resolved{}},
		{"fields vs raw payload", "t", `{"a":1}`, fieldsRule(t, "a"), "t", `{"a":1}`, &resolved{}},
		{"raw payload byte", "t", "\x0a\x03foo", &resolved{}, "t", "\x0a\x03fop", &resolved{}},
		{"raw payload length", "t", "\x0a\x03foo", &resolved{}, "t", "\x0a\x03foo\x00", &resolved{}},
		{"raw payload white space", "t", `{"a":1}`, &resolved{}, "t", `{"a": 1}`, &resolved{}},
		{"raw empty vs type", "t", ``, &resolved{}, "t\x00", ``, &resolved{}},
		// Shared applies to Key/KeyFunc keys only (Rule.Shared); fields of
		// different types stay apart even when the rule sets Shared.
		{"shared does not merge fields of types", "a", `{"a":1}`, sharedFields, "b", `{"a":1}`, sharedFields},
		{"shared does not merge raw payloads of types", "a", `x`, &resolved{shared: true}, "b", `x`, &resolved{shared: true}},
		// Task types are written verbatim, not decoded as JSON.
		{`type "\n" vs newline`, `a\n`, `x`, &resolved{}, "a\n", `x`, &resolved{}},
		{`type "\u0041" vs A`, `\u0041`, `x`, &resolved{}, "A", `x`, &resolved{}},
		{"type invalid UTF-8", "a\xff", `x`, &resolved{}, "a\xfe", `x`, &resolved{}},
		{"type U+FFFD vs invalid UTF-8", "a\uFFFD", `x`, &resolved{}, "a\xff", `x`, &resolved{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := mustFP(t, tt.ta, tt.pa, tt.ra), mustFP(t, tt.tb, tt.pb, tt.rb)
			if a == b {
				t.Errorf("same fingerprint %#016x", a)
			}
		})
	}
}

func TestFingerprintUnusualTypesAndPaths(t *testing.T) {
	// Task types and field paths are arbitrary strings: none may panic.
	for _, typ := range []string{"", `\`, `a\`, `\u`, `\u12`, `\ud800`, `é\`, "\xff\\", "\x00", "\x01", strings.Repeat("é", 300)} {
		for _, r := range []*resolved{{}, keyRule("k", false), fieldsRule(t, "a")} {
			if _, err := fingerprint(typ, []byte(`{"a":1}`), r); err != nil {
				t.Errorf("type %q: %v", typ, err)
			}
		}
	}
	for _, p := range []string{`\`, `é\`, `\u12`, "\xff\\", `a.\`, "é.\\u"} {
		r := &resolved{fields: mustFieldSet(t, p), missingAsNull: true}
		if _, err := fingerprint("t", []byte(`{"a":1}`), r); err != nil {
			t.Errorf("path %q: %v", p, err)
		}
	}
}

func TestFingerprintFieldsOption(t *testing.T) {
	apply := func(t *testing.T, opts ...any) (*resolved, error) {
		t.Helper()
		r := &resolved{}
		for _, o := range opts {
			if err := o.(option).applyTo(r); err != nil {
				return nil, err
			}
		}
		return r, nil
	}
	payload := `{"a":1,"b":{"c":"x"},"trace_id":"123"}`
	ab, err := apply(t, Fields("a", "b.c"))
	if err != nil {
		t.Fatal(err)
	}
	ba, err := apply(t, Fields("b.c", "a"))
	if err != nil {
		t.Fatal(err)
	}
	if mustFP(t, "t", payload, ab) != mustFP(t, "t", payload, ba) {
		t.Error(`Fields("a", "b.c") and Fields("b.c", "a") give different fingerprints`)
	}
	// Fields after SharedKey: the explicit key beats the fields (a Rule's
	// precedence, whatever the order), so the key stays shared across types.
	sf, err := apply(t, SharedKey("k"), Fields("a"))
	if err != nil {
		t.Fatal(err)
	}
	if mustFP(t, "x", payload, sf) != mustFP(t, "y", payload, sf) {
		t.Error("Fields after SharedKey took over: the shared key is no longer shared across types")
	}
	k1, _ := apply(t, Key("k"))
	sk, _ := apply(t, SharedKey("k"))
	if mustFP(t, "x", payload, k1) == mustFP(t, "y", payload, k1) {
		t.Error("Key is not namespaced by type")
	}
	if mustFP(t, "x", payload, sk) != mustFP(t, "y", payload, sk) {
		t.Error("SharedKey is namespaced by type")
	}
	for _, bad := range [][]string{nil, {"a..b"}, {""}, {"a", ".b"}} {
		if _, err := apply(t, Fields(bad...)); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("Fields(%q): err = %v, want ErrInvalidOption", bad, err)
		}
	}
}

// TestFieldErrorTexts pins the texts of the errors for bad field selections
// and bad payloads, which users may log or match: they must not change when
// the JSON code is reorganised.
func TestFieldErrorTexts(t *testing.T) {
	many := make([]string, 65)
	for i := range many {
		many[i] = fmt.Sprintf("f%d", i)
	}
	ruleErr := func(paths ...string) error {
		_, err := compileRules(map[string]Rule{"t": {Fields: paths}})
		return err
	}
	optErr := func(paths ...string) error {
		return Fields(paths...).(option).applyTo(&resolved{})
	}
	fpErr := func(payload string, paths ...string) error {
		_, err := fingerprint("t", []byte(payload), fieldsRule(t, paths...))
		return err
	}
	for _, tt := range []struct {
		err          error
		want         string
		invalidInput bool // ErrInvalidOption, else ErrInvalidPayload
	}{
		{ruleErr("ok", "a..b"), `dedup: invalid option: rule for "t": field path "a..b" has an empty segment`, true},
		{ruleErr(many...), `dedup: invalid option: rule for "t": 65 fields selected, at most 64`, true},
		{optErr("a", ""), `dedup: invalid option: field path "" has an empty segment`, true},
		{optErr(many...), `dedup: invalid option: 65 fields selected, at most 64`, true},
		{optErr(), `dedup: invalid option: Fields needs at least one path`, true},
		{fpErr(`{"a":`, "a"), `dedup: task "t": invalid JSON at offset 5: unexpected end of input`, false},
		{fpErr(`{"a":1}x`, "a"), `dedup: task "t": invalid JSON at offset 7: data after the top-level value`, false},
		{fpErr(jsonkeytest.Deep(600, false), "a"), `dedup: task "t": invalid JSON at offset 513: nesting too deep`, false},
		{fpErr(`{"b":1}`, "a"), `dedup: task "t": field "a": selected field missing`, false},
		{fpErr(`{"a":1e1000000001}`, "a"), `dedup: task "t": field "a": number exponent out of range (|exp| > 1000000000)`, false},
	} {
		if tt.err == nil || tt.err.Error() != tt.want {
			t.Errorf("error %v\n want %s", tt.err, tt.want)
		}
		if want := map[bool]error{true: ErrInvalidOption, false: ErrInvalidPayload}[tt.invalidInput]; !errors.Is(tt.err, want) {
			t.Errorf("%v does not match %v", tt.err, want)
		}
	}
}

// secret is a credential-looking value in test payloads; no error text may
// contain it.
const secret = "s3cr3t-Hunter2-AKIAIOSFODNN7"

func checkPayloadError(t *testing.T, err error, typ, field string) *PayloadError {
	t.Helper()
	if err == nil {
		t.Fatal("no error")
	}
	if !errors.Is(err, ErrInvalidPayload) {
		t.Errorf("errors.Is(%v, ErrInvalidPayload) = false", err)
	}
	var pe *PayloadError
	if !errors.As(err, &pe) {
		t.Fatalf("error %T is not a *PayloadError: %v", err, err)
	}
	if pe.Type != typ {
		t.Errorf("PayloadError.Type = %q, want %q", pe.Type, typ)
	}
	if pe.Field != field {
		t.Errorf("PayloadError.Field = %q, want %q", pe.Field, field)
	}
	if msg := err.Error(); strings.Contains(msg, secret) || strings.Contains(msg, "s3cr3t") || strings.Contains(msg, "Hunter2") {
		t.Errorf("error text quotes the payload: %s", msg)
	}
	return pe
}

func TestFingerprintNotJSON(t *testing.T) {
	r := fieldsRule(t, "a", "b.c")
	const typ = "report:build"
	payloads := []string{
		"\x0a\x1a" + secret + "\x10\x96\x01", // protobuf
		secret,
		`{"password":"` + secret + `","a":`,             // truncated
		`{"password":"` + secret + `","a":1} trailing`,  // trailing garbage
		`{"a":1,"password":"` + secret + "\x01\"}",      // control character
		`{"a":1,"password":"` + secret + `\q"}`,         // invalid escape
		`{"a":1,"b":{"c":2},"password":` + secret + `}`, // unquoted after the selected fields
		`{"a":1,"password":"` + secret + `","deep":` + jsonkeytest.Deep(jsonkey.MaxDepth+1, false) + `}`,
		`{"a":1,"n":` + secret + `}`,
		`{"a":1,"password":"` + secret + `"}` + "\x00",
		"{\"a\":1,\"password\":'" + secret + "'}",
	}
	for _, tt := range jsonkeytest.BadJSON {
		payloads = append(payloads, tt.In)
	}
	for _, n := range []int{jsonkey.MaxDepth + 1, 100_000} {
		payloads = append(payloads, jsonkeytest.Deep(n, false), jsonkeytest.Deep(n, true), `{"a":`+jsonkeytest.Deep(n, true)+`}`)
	}
	for _, p := range payloads {
		_, err := fingerprint(typ, []byte(p), r)
		t.Run(fmt.Sprintf("%.30q", p), func(t *testing.T) {
			checkPayloadError(t, err, typ, "")
			if errors.Is(err, ErrFieldMissing) {
				t.Errorf("invalid JSON reported as a missing field: %v", err)
			}
		})
	}
	// Even with missing fields treated as null, the payload must be JSON.
	_, err := fingerprint(typ, []byte(secret), &resolved{fields: r.fields, missingAsNull: true})
	checkPayloadError(t, err, typ, "")
	// nil payload.
	_, err = fingerprint(typ, nil, r)
	checkPayloadError(t, err, typ, "")
}

func TestFingerprintErrorQuotesNoPayloadByte(t *testing.T) {
	// Not even the one unexpected character is quoted.
	_, err := fingerprint("t", []byte(`{"a":Zebra}`), fieldsRule(t, "a"))
	checkPayloadError(t, err, "t", "")
	if msg := err.Error(); strings.ContainsAny(msg, "Zb") {
		t.Errorf("error text quotes payload bytes: %s", msg)
	}
}

func TestFingerprintFieldMissing(t *testing.T) {
	const typ = "report:build"
	tests := []struct {
		name, payload string
		paths         []string
		field         string
	}{
		{"absent", `{"password":"` + secret + `","b":{"c":1}}`, []string{"a", "b.c"}, "a"},
		{"nested absent", `{"a":1,"b":{"password":"` + secret + `"}}`, []string{"a", "b.c"}, "b.c"},
		{"parent not an object", `{"a":1,"b":"` + secret + `"}`, []string{"a", "b.c"}, "b.c"},
		{"parent an array", `{"a":1,"b":[{"c":"` + secret + `"}]}`, []string{"a", "b.c"}, "b.c"},
		{"top-level array", `["` + secret + `"]`, []string{"a"}, "a"},
		{"top-level string", `"` + secret + `"`, []string{"a"}, "a"},
		{"replaced by duplicate", `{"b":{"c":"` + secret + `"},"b":{},"a":1}`, []string{"a", "b.c"}, "b.c"},
		{"first missing in sorted order", `{"x":"` + secret + `"}`, []string{"z", "b"}, "b"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := fingerprint(typ, []byte(tt.payload), fieldsRule(t, tt.paths...))
			checkPayloadError(t, err, typ, tt.field)
			if !errors.Is(err, ErrFieldMissing) {
				t.Errorf("errors.Is(%v, ErrFieldMissing) = false", err)
			}
			// With MissingAsNull it is fine, and equals an explicit null.
			r := &resolved{fields: mustFieldSet(t, tt.paths...), missingAsNull: true}
			mustFP(t, typ, tt.payload, r)
		})
	}
	// A null that is there is not missing.
	if _, err := fingerprint(typ, []byte(`{"a":null}`), fieldsRule(t, "a")); err != nil {
		t.Errorf("explicit null: %v", err)
	}
}

func TestFingerprintKeyErrors(t *testing.T) {
	cause := errors.New("no id in " + "payload")
	var gotTyp string
	var gotPayload []byte
	r := &resolved{keyFunc: func(typ string, p []byte) (string, error) {
		gotTyp, gotPayload = typ, p
		return "", cause
	}}
	_, err := fingerprint("t", []byte("pb\x00"), r)
	checkPayloadError(t, err, "t", "")
	if !errors.Is(err, cause) {
		t.Errorf("errors.Is(%v, cause) = false", err)
	}
	if gotTyp != "t" || string(gotPayload) != "pb\x00" {
		t.Errorf("KeyFunc called with %q, %q", gotTyp, gotPayload)
	}
	// A key function returning an empty key is an error, not a shared key.
	r.keyFunc = func(string, []byte) (string, error) { return "", nil }
	_, err = fingerprint("t", []byte("x"), r)
	checkPayloadError(t, err, "t", "")
}

func TestFingerprintNumberOutOfRange(t *testing.T) {
	// An exponent past maxExponent is refused (not wrapped, not rounded),
	// naming the field but not quoting the number.
	_, err := fingerprint("t", []byte(`{"a":1,"n":9e1000000001}`), fieldsRule(t, "a", "n"))
	checkPayloadError(t, err, "t", "n")
	if errors.Is(err, ErrFieldMissing) || strings.Contains(err.Error(), "9e1000000001") {
		t.Errorf("unexpected error: %v", err)
	}
	// Unselected, it is just a valid number.
	mustFP(t, "t", `{"a":1,"n":9e1000000001}`, fieldsRule(t, "a"))
}

func TestFingerprintAllocs(t *testing.T) {
	// fingerprint allocates nothing for raw payloads, keys and small scalar
	// fields (decoded strings up to 128 bytes, all selected values up to
	// about 200 bytes encoded; beyond that its stack buffers grow onto the
	// heap).
	escaped := []byte(`{"s":"\u00e9\ud83d\ude00 ` + strings.Repeat("é", 20) + `","n":-12.500e-3,"x":[1,2,{"y":3}]}`)
	for _, tc := range []struct {
		name    string
		r       *resolved
		payload []byte
	}{
		{"fields 200B", fieldsRule(t, jsonkeytest.PayloadPaths...), jsonkeytest.Payload200B},
		{"fields 4KB", fieldsRule(t, jsonkeytest.PayloadPaths...), jsonkeytest.Payload4KB},
		{"raw 200B", &resolved{}, jsonkeytest.Payload200B},
		{"raw 4KB", &resolved{}, jsonkeytest.Payload4KB},
		{"key", keyRule("user-1234567", false), jsonkeytest.Payload200B},
		{"shared key", keyRule("user-1234567", true), jsonkeytest.Payload200B},
		{"escaped string and number", fieldsRule(t, "s", "n"), escaped},
		{"missing as null", &resolved{fields: mustFieldSet(t, "s", "zz"), missingAsNull: true}, escaped},
	} {
		allocs := testing.AllocsPerRun(50, func() {
			if _, err := fingerprint("report:build", tc.payload, tc.r); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 0 {
			t.Errorf("%s: %v allocations per fingerprint, want 0", tc.name, allocs)
		}
	}
}

func TestFingerprintConcurrent(t *testing.T) {
	// fingerprint keeps no shared state: run it in parallel (for -race).
	r := fieldsRule(t, jsonkeytest.PayloadPaths...)
	want := mustFP(t, "t", string(jsonkeytest.Payload4KB), r)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				if got, err := fingerprint("t", jsonkeytest.Payload4KB, r); err != nil || got != want {
					t.Errorf("got %#x, %v; want %#x", got, err, want)
					return
				}
			}
		})
	}
	wg.Wait()
}

// --- Property tests -------------------------------------------------------

// jv is a JSON value model used to generate payloads and spell them in
// random, equivalent ways.
type jv struct {
	kind   byte   // 'z' null, 't' true, 'f' false, 'n' number, 's' string, 'a' array, 'o' object
	neg    bool   // number: sign
	digits string // number: significant digits, "0" for zero, else no leading zero
	exp    int    // number: value = ±digits × 10^exp
	str    string // string
	elems  []jv   // array elements, object values
	keys   []string
}

// genConfig picks the value domain. small makes independently drawn values
// equal often, to test equality and inequality alike.
type genConfig struct {
	small    bool
	maxDepth int
}

var (
	smallStrings = []string{"", "a", "b", "é", "1", "true", "null", "\x00", "a\x00", "😀", `"`, "\\"}
	smallKeys    = []string{"a", "b", "é", ""}
	// smallNumbers are (digits, exp) pairs; value digits×10^exp.
	smallNumbers = []struct {
		d string
		e int
	}{{"0", 0}, {"1", 0}, {"1", 1}, {"10", 0}, {"1", 2}, {"15", -1}, {"9007199254740992", 0}, {"9007199254740993", 0}, {"1", -1}, {"1", 400}}
	// stringRunes exercise escapes, surrogate pairs and the encoding's own
	// escape bytes (0x00, 0x01).
	stringRunes = []rune{'a', 'b', 'Z', ' ', 'é', '😀', '𝄞', '"', '\\', '/', '\n', '\t', '\b', '\f', '\r', 0, 1, 0x1f, 0x7f, '<', '>', '&', 0x2028, 0xfffd, 0xffff, '.', ':'}
)

func genValue(t *rapid.T, cfg genConfig, depth int) jv {
	// rapid favours small indexes: containers first give deeper trees (up
	// to maxDepth), then numbers and strings.
	kinds := "oanszotnafs"
	if depth >= cfg.maxDepth {
		kinds = "nsztnfs"
	}
	k := kinds[rapid.IntRange(0, len(kinds)-1).Draw(t, "kind")]
	v := jv{kind: k}
	switch k {
	case 'n':
		v.neg = rapid.Bool().Draw(t, "neg")
		if cfg.small {
			n := rapid.SampledFrom(smallNumbers).Draw(t, "num")
			v.digits, v.exp = n.d, n.e
			break
		}
		if rapid.IntRange(0, 9).Draw(t, "zero") == 0 {
			v.digits = "0"
			break
		}
		ds := rapid.SliceOfN(rapid.IntRange(0, 9), 0, 25).Draw(t, "digits")
		var sb strings.Builder
		sb.WriteByte(byte('1' + rapid.IntRange(0, 8).Draw(t, "lead")))
		for _, d := range ds {
			sb.WriteByte(byte('0' + d))
		}
		v.digits = sb.String()
		v.exp = rapid.IntRange(-40, 40).Draw(t, "exp")
	case 's':
		if cfg.small {
			v.str = rapid.SampledFrom(smallStrings).Draw(t, "str")
			break
		}
		v.str = rapid.StringOfN(rapid.OneOf(rapid.SampledFrom(stringRunes), rapid.Rune()), 0, 12, -1).Draw(t, "str")
	case 'a':
		n := rapid.IntRange(0, 4).Draw(t, "len")
		for range n {
			v.elems = append(v.elems, genValue(t, cfg, depth+1))
		}
	case 'o':
		var keys []string
		if cfg.small {
			keys = rapid.SliceOfNDistinct(rapid.SampledFrom(smallKeys), 0, 3, rapid.ID[string]).Draw(t, "keys")
		} else {
			keys = rapid.SliceOfNDistinct(rapid.StringOfN(rapid.SampledFrom(stringRunes), 0, 4, -1), 0, 4, rapid.ID[string]).Draw(t, "keys")
		}
		v.keys = keys
		for range keys {
			v.elems = append(v.elems, genValue(t, cfg, depth+1))
		}
	}
	return v
}

// speller writes values in random but equivalent spellings.
type speller struct {
	t    *rapid.T
	b    bytes.Buffer
	dups bool // may insert shadowed duplicate members (the last one wins)
}

func (s *speller) ws() {
	for range rapid.IntRange(0, 2).Draw(s.t, "ws") {
		s.b.WriteByte(" \t\n\r"[rapid.IntRange(0, 3).Draw(s.t, "wsc")])
	}
}

func (s *speller) hex4(r rune) {
	const lower, upper = "0123456789abcdef", "0123456789ABCDEF"
	s.b.WriteString(`\u`)
	for shift := 12; shift >= 0; shift -= 4 {
		d := (r >> shift) & 0xf
		if rapid.Bool().Draw(s.t, "upper") {
			s.b.WriteByte(upper[d])
		} else {
			s.b.WriteByte(lower[d])
		}
	}
}

func (s *speller) uescape(r rune) {
	if r > 0xffff {
		r1, r2 := utf16.EncodeRune(r)
		s.hex4(r1)
		s.hex4(r2)
		return
	}
	s.hex4(r)
}

func (s *speller) str(v string) {
	s.b.WriteByte('"')
	for _, r := range v {
		short := map[rune]string{'"': `\"`, '\\': `\\`, '\b': `\b`, '\f': `\f`, '\n': `\n`, '\r': `\r`, '\t': `\t`, '/': `\/`}[r]
		mustEscape := r == '"' || r == '\\' || r < 0x20
		switch c := rapid.IntRange(0, 2).Draw(s.t, "esc"); {
		case c == 0 && !mustEscape:
			s.b.WriteRune(r)
		case c == 1 && short != "":
			s.b.WriteString(short)
		default:
			s.uescape(r)
		}
	}
	s.b.WriteByte('"')
}

func (s *speller) number(v jv) {
	if v.neg || (v.digits == "0" && rapid.Bool().Draw(s.t, "negzero")) {
		s.b.WriteByte('-')
	}
	d, x := v.digits, v.exp // value d × 10^x
	if d == "0" {
		s.b.WriteByte('0')
		if z := rapid.IntRange(0, 3).Draw(s.t, "fraczeros"); z > 0 {
			s.b.WriteString("." + strings.Repeat("0", z))
		}
		if rapid.Bool().Draw(s.t, "zeroexp") {
			s.exponent(rapid.IntRange(-20, 20).Draw(s.t, "zexp"))
		}
		return
	}
	z := rapid.IntRange(0, 3).Draw(s.t, "trailzeros")
	d += strings.Repeat("0", z)
	x -= z
	// Place the decimal point p digits from the left; p == 0 spells 0.000ddd.
	p := rapid.IntRange(0, len(d)).Draw(s.t, "point")
	var intPart, frac string
	if p == 0 {
		intPart = "0"
		frac = strings.Repeat("0", rapid.IntRange(0, 2).Draw(s.t, "leadzeros")) + d
	} else {
		intPart, frac = d[:p], d[p:]
	}
	// intPart.frac × 10^e == d × 10^x  ⇔  e = x + len(frac) (the digits of
	// intPart followed by frac, with its leading zeros, equal d).
	e := x + len(frac)
	s.b.WriteString(intPart)
	if frac != "" {
		s.b.WriteString("." + frac)
	}
	if e != 0 || rapid.Bool().Draw(s.t, "zeroexp") {
		s.exponent(e)
	}
}

func (s *speller) exponent(e int) {
	s.b.WriteByte("eE"[rapid.IntRange(0, 1).Draw(s.t, "e")])
	if e < 0 {
		s.b.WriteByte('-')
		e = -e
	} else if rapid.Bool().Draw(s.t, "plus") {
		s.b.WriteByte('+')
	}
	s.b.WriteString(strings.Repeat("0", rapid.IntRange(0, 2).Draw(s.t, "expzeros")))
	fmt.Fprint(&s.b, e)
}

func (s *speller) value(v jv) {
	s.ws()
	switch v.kind {
	case 'z':
		s.b.WriteString("null")
	case 't':
		s.b.WriteString("true")
	case 'f':
		s.b.WriteString("false")
	case 'n':
		s.number(v)
	case 's':
		s.str(v.str)
	case 'a':
		s.b.WriteByte('[')
		for i, e := range v.elems {
			if i > 0 {
				s.b.WriteByte(',')
			}
			s.value(e)
		}
		s.ws()
		s.b.WriteByte(']')
	case 'o':
		idx := make([]int, len(v.keys))
		for i := range idx {
			idx[i] = i
		}
		idx = rapid.Permutation(idx).Draw(s.t, "order")
		s.b.WriteByte('{')
		first := true
		member := func(k string, val jv) {
			if !first {
				s.b.WriteByte(',')
			}
			first = false
			s.ws()
			s.str(k)
			s.ws()
			s.b.WriteByte(':')
			s.value(val)
		}
		for _, i := range idx {
			if s.dups && rapid.IntRange(0, 4).Draw(s.t, "dup") == 0 {
				member(v.keys[i], jv{kind: "ztf"[rapid.IntRange(0, 2).Draw(s.t, "shadow")]})
			}
			member(v.keys[i], v.elems[i])
		}
		s.ws()
		s.b.WriteByte('}')
	}
	s.ws()
}

func spell(t *rapid.T, v jv, dups bool) []byte {
	s := speller{t: t, dups: dups}
	s.value(v)
	return s.b.Bytes()
}

// decodeJSON decodes with encoding/json, numbers as json.Number.
func decodeJSON(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("data after the value")
	}
	return v, nil
}

// semEqual is equality of decoded JSON with numbers compared as exact
// rationals (never float64).
func semEqual(a, b any) bool {
	switch a := a.(type) {
	case nil:
		return b == nil
	case bool:
		b, ok := b.(bool)
		return ok && a == b
	case string:
		b, ok := b.(string)
		return ok && a == b
	case json.Number:
		b, ok := b.(json.Number)
		if !ok {
			return false
		}
		ra, ok1 := new(big.Rat).SetString(string(a))
		rb, ok2 := new(big.Rat).SetString(string(b))
		if !ok1 || !ok2 {
			panic(fmt.Sprintf("big.Rat cannot parse %s or %s", a, b))
		}
		return ra.Cmp(rb) == 0
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !semEqual(a[i], b[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, va := range a {
			vb, ok := b[k]
			if !ok || !semEqual(va, vb) {
				return false
			}
		}
		return true
	}
	panic(fmt.Sprintf("unexpected %T", a))
}

func mustDecode(t *rapid.T, b []byte) any {
	v, err := decodeJSON(b)
	if err != nil {
		t.Fatalf("generated invalid JSON %q: %v", b, err)
	}
	return v
}

// wrapSelected puts value text at "v" and "r.v" of a payload with other,
// unselected members around it.
func wrapSelected(t *rapid.T, val []byte, noise int) []byte {
	var b bytes.Buffer
	members := []string{`"v":` + string(val), `"r":{"x":` + fmt.Sprint(noise) + `,"v":` + string(val) + `}`,
		`"trace_id":"` + fmt.Sprint(noise) + `"`, `"n":[` + fmt.Sprint(noise) + `]`}
	members = rapid.Permutation(members).Draw(t, "members")
	b.WriteString("{" + strings.Join(members, ",") + "}")
	return b.Bytes()
}

// checkRepeated runs prop propertyRounds times per rapid check (rapid's
// values stay small; more of them cover more ground, still in milliseconds).
func checkRepeated(t *testing.T, prop func(*rapid.T)) {
	rapid.Check(t, func(t *rapid.T) {
		for range propertyRounds {
			prop(t)
		}
	})
}

const propertyRounds = 20

func TestPropertyRespelledFingerprintEqual(t *testing.T) {
	t.Parallel()
	r := &resolved{fields: mustFieldSet(t, "v", "r.v")}
	checkRepeated(t, func(t *rapid.T) {
		v := genValue(t, genConfig{maxDepth: 3}, 0)
		a := spell(t, v, false)
		b := spell(t, v, true)
		da, db := mustDecode(t, a), mustDecode(t, b)
		if !semEqual(da, db) {
			t.Fatalf("test bug: spellings differ in meaning:\n%s\n%s", a, b)
		}
		ca, erra := canonJSON(a)
		cb, errb := canonJSON(b)
		if erra != nil || errb != nil {
			t.Fatalf("canonical: %v, %v", erra, errb)
		}
		if !bytes.Equal(ca, cb) {
			t.Fatalf("equivalent spellings encode differently:\n%s\n%s\n%q\n%q", a, b, ca, cb)
		}
		pa := wrapSelected(t, a, rapid.Int().Draw(t, "noise"))
		pb := wrapSelected(t, b, rapid.Int().Draw(t, "noise"))
		fa, err := fingerprint("t", pa, r)
		if err != nil {
			t.Fatalf("fingerprint(%s): %v", pa, err)
		}
		fb, err := fingerprint("t", pb, r)
		if err != nil {
			t.Fatalf("fingerprint(%s): %v", pb, err)
		}
		if fa != fb {
			t.Fatalf("equivalent payloads, different fingerprints:\n%s\n%s", pa, pb)
		}
	})
}

// mutate returns v changed in one place; the result may or may not be
// equal in meaning (semEqual decides).
func mutate(t *rapid.T, v jv) jv {
	switch v.kind {
	case 'a':
		if len(v.elems) > 0 && rapid.Bool().Draw(t, "deep") {
			i := rapid.IntRange(0, len(v.elems)-1).Draw(t, "i")
			v.elems = append([]jv(nil), v.elems...)
			v.elems[i] = mutate(t, v.elems[i])
			return v
		}
	case 'o':
		if len(v.keys) > 0 && rapid.Bool().Draw(t, "deep") {
			i := rapid.IntRange(0, len(v.keys)-1).Draw(t, "i")
			v.elems = append([]jv(nil), v.elems...)
			if rapid.Bool().Draw(t, "key") {
				v.keys = append([]string(nil), v.keys...)
				v.keys[i] += "x"
				for j, k := range v.keys {
					if j != i && k == v.keys[i] {
						return jv{kind: 'z'}
					}
				}
			} else {
				v.elems[i] = mutate(t, v.elems[i])
			}
			return v
		}
	}
	switch rapid.IntRange(0, 7).Draw(t, "how") {
	case 0: // another value altogether
		return genValue(t, genConfig{maxDepth: 1}, 0)
	case 1: // a number one unit in the last place away
		if v.kind == 'n' && v.digits != "0" {
			d := []byte(v.digits)
			i := len(d) - 1
			if d[i] < '9' {
				d[i]++
			} else {
				d = append(d, '1')
				v.exp--
			}
			v.digits = string(d)
			return v
		}
	case 2: // the number's spelling as a string
		if v.kind == 'n' {
			return jv{kind: 's', str: v.digits + "e" + fmt.Sprint(v.exp)}
		}
	case 3:
		if v.kind == 'n' {
			v.neg = !v.neg // equal for zero
			return v
		}
	case 4:
		if v.kind == 'n' {
			v.exp++ // equal for zero
			return v
		}
	case 5:
		if v.kind == 's' {
			v.str += string(rapid.SampledFrom(stringRunes).Draw(t, "r"))
			return v
		}
	case 6:
		switch v.kind {
		case 't':
			return jv{kind: 's', str: "true"}
		case 'f':
			return jv{kind: 'n', digits: "0"}
		case 'z':
			return jv{kind: 's', str: "null"}
		case 'a':
			return jv{kind: 'a', elems: append(v.elems, jv{kind: 'z'})}
		case 'o':
			return jv{kind: 'a', elems: v.elems}
		}
	}
	return genValue(t, genConfig{small: true, maxDepth: 1}, 0)
}

func TestPropertyChangedValueChangesFingerprint(t *testing.T) {
	t.Parallel()
	r := &resolved{fields: mustFieldSet(t, "v", "r.v")}
	changed := 0
	checkRepeated(t, func(t *rapid.T) {
		v := genValue(t, genConfig{maxDepth: 3}, 0)
		w := mutate(t, v)
		a, b := spell(t, v, true), spell(t, w, true)
		same := semEqual(mustDecode(t, a), mustDecode(t, b))
		pa := wrapSelected(t, a, 1)
		pb := wrapSelected(t, b, 1)
		fa, erra := fingerprint("t", pa, r)
		fb, errb := fingerprint("t", pb, r)
		if erra != nil || errb != nil {
			t.Fatalf("fingerprint: %v, %v", erra, errb)
		}
		if (fa == fb) != same {
			t.Fatalf("value %s -> %s: equal per encoding/json+big.Rat: %v, same fingerprint: %v", a, b, same, fa == fb)
		}
		if !same {
			changed++
		}
	})
	if changed < 50 {
		t.Errorf("only %d of the mutations changed the value; the test is too weak", changed)
	}
}

func TestPropertyCanonicalAgreesWithEncodingJSON(t *testing.T) {
	equal := 0
	checkRepeated(t, func(t *rapid.T) {
		cfg := genConfig{small: true, maxDepth: 2}
		a := spell(t, genValue(t, cfg, 0), true)
		var b []byte
		if rapid.Bool().Draw(t, "respell") {
			// Same value, other spelling, via encoding/json's own output.
			v := mustDecode(t, a)
			var err error
			if b, err = json.Marshal(v); err != nil {
				t.Fatal(err)
			}
		} else {
			b = spell(t, genValue(t, cfg, 0), true)
		}
		same := semEqual(mustDecode(t, a), mustDecode(t, b))
		ca, erra := canonJSON(a)
		cb, errb := canonJSON(b)
		if erra != nil || errb != nil {
			t.Fatalf("canonical: %v, %v", erra, errb)
		}
		if bytes.Equal(ca, cb) != same {
			t.Fatalf("%s vs %s: encoding/json+big.Rat equal: %v, canonical equal: %v\n%q\n%q", a, b, same, !same, ca, cb)
		}
		if !same && (bytes.HasPrefix(ca, cb) || bytes.HasPrefix(cb, ca)) {
			t.Fatalf("canonical encodings not prefix-free: %q, %q", ca, cb)
		}
		if same {
			equal++
		}
	})
	if equal < 10 {
		t.Errorf("only %d equal pairs; the test is too weak", equal)
	}
}

// --- Fuzzing -------------------------------------------------------------

// jsonDepth returns the deepest nesting of arrays and objects in valid JSON.
func jsonDepth(b []byte) int {
	depth, deepest, inStr := 0, 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; {
		case inStr && c == '\\':
			i++
		case c == '"':
			inStr = !inStr
		case inStr:
		case c == '[' || c == '{':
			depth++
			deepest = max(deepest, depth)
		case c == ']' || c == '}':
			depth--
		}
	}
	return deepest
}

func FuzzFingerprint(f *testing.F) {
	seeds := []string{
		`{"a":1,"b":{"c":"x"}}`,
		`{"b":{"c":[1,2,{"d":null}]},"a":"\u00e9\ud83d\ude00","é":true}`,
		`{"a":1,"a":{"b":{"c":2}},"a":{"b":{"c":3}}}`,
		`{"a":9007199254740993,"b":{"c":1.000e-5}}`,
		`{"a":-0.0E+00,"b":{"c":1e999999999}}`,
		`{"a":"<>&\u2028\u0000\u0001","b":{"c":"\/\b\f\n\r\t"}}`,
		"{\"k\xff\":1,\"k\\ufffd\":2,\"a\":\"\xed\xa0\x80\"}",
		`{"\u0061":{"\u0062":{"c":[]}},"b":{"\u0063":{}}}`,
		`[{"a":1}]`, `"a"`, `null`, `{}`, ``, `{"a":`, `{"a":1}x`, `{"a":01}`, `{"a":"\ud800"}`,
		"\x0a\x03foo\x10\x96\x01",
		jsonkeytest.Deep(jsonkey.MaxDepth, true), jsonkeytest.Deep(jsonkey.MaxDepth+1, false),
	}
	for _, s := range seeds {
		f.Add([]byte(s), "")
	}
	f.Add([]byte(`{"x":{"y":[1,{"z":2}]},"q":"w"}`), "x.y")
	f.Add([]byte(`{"x":{"y":{"z":"1"},"y":{"z":1}}}`), "x.y.z")
	f.Fuzz(func(t *testing.T, payload []byte, path string) {
		paths := jsonkeytest.FuzzPaths
		if _, err := jsonkey.Compile([]string{path}); err == nil {
			paths = append(paths[:len(paths):len(paths)], path)
		}
		fs := mustFieldSet(t, paths...)
		r := &resolved{fields: fs, missingAsNull: true}
		fp, err := fingerprint("fuzz", payload, r)

		// Without MissingAsNull: the same, or a missing field.
		fpStrict, errStrict := fingerprint("fuzz", payload, &resolved{fields: fs})
		switch {
		case errStrict == nil && (err != nil || fpStrict != fp):
			t.Fatalf("strict %#x, %v; with MissingAsNull %#x, %v", fpStrict, errStrict, fp, err)
		case errStrict != nil && err == nil && !errors.Is(errStrict, ErrFieldMissing):
			t.Fatalf("strict mode fails with %v where MissingAsNull succeeds", errStrict)
		}

		// Raw mode takes any bytes.
		if _, err := fingerprint("fuzz", payload, &resolved{}); err != nil {
			t.Fatalf("raw: %v", err)
		}

		valid := json.Valid(payload)
		if err != nil {
			var pe *PayloadError
			if !errors.Is(err, ErrInvalidPayload) || !errors.As(err, &pe) || pe.Type != "fuzz" {
				t.Fatalf("error %v (%T) is not a *PayloadError", err, err)
			}
			var je *jsonkey.SyntaxError
			switch {
			case !valid:
			case errors.As(err, &je) && jsonDepth(payload) > jsonkey.MaxDepth:
				// Deeper than this package accepts; encoding/json allows 10000.
			case !errors.As(err, &je) && pe.Field != "" && strings.Contains(err.Error(), "exponent"):
				// A selected number too large to compare exactly.
			default:
				t.Fatalf("valid JSON refused: %v", err)
			}
			return
		}
		if !valid {
			t.Fatalf("invalid JSON accepted: %q", payload)
		}

		// encoding/json's re-encoding (keys sorted, white space and escapes
		// normalised, duplicates resolved, invalid UTF-8 replaced) has the
		// same fingerprint.
		v, derr := decodeJSON(payload)
		if derr != nil {
			t.Fatalf("encoding/json cannot decode what json.Valid accepts: %v", derr)
		}
		for _, html := range []bool{true, false} {
			var buf bytes.Buffer
			enc := json.NewEncoder(&buf)
			enc.SetEscapeHTML(html)
			if err := enc.Encode(v); err != nil {
				t.Fatalf("re-encoding: %v", err)
			}
			fp2, err := fingerprint("fuzz", buf.Bytes(), r)
			if err != nil {
				t.Fatalf("re-encoded %q: %v", buf.Bytes(), err)
			}
			if fp2 != fp {
				t.Fatalf("re-encoded payload has another fingerprint:\n%q\n%q", payload, buf.Bytes())
			}
		}
	})
}

// FuzzCanonicalEquality checks, for pairs of arbitrary JSON values, that the
// canonical encodings are equal exactly when encoding/json decodes the
// values equally (numbers compared as exact rationals).
func FuzzCanonicalEquality(f *testing.F) {
	for _, tc := range jsonkeytest.CanonCases {
		f.Add([]byte(tc.A), []byte(tc.B))
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		ca, erra := canonJSON(a)
		cb, errb := canonJSON(b)
		if erra != nil || errb != nil {
			return
		}
		da, err1 := decodeJSON(a)
		db, err2 := decodeJSON(b)
		if err1 != nil || err2 != nil {
			t.Fatalf("accepted what encoding/json refuses: %v, %v", err1, err2)
		}
		if !smallExponents(da) || !smallExponents(db) {
			return // big.Rat would need 10^exp exactly
		}
		if same := semEqual(da, db); bytes.Equal(ca, cb) != same {
			t.Fatalf("%q vs %q: encoding/json+big.Rat equal: %v, canonical %q, %q", a, b, same, ca, cb)
		}
		if !bytes.Equal(ca, cb) && (bytes.HasPrefix(ca, cb) || bytes.HasPrefix(cb, ca)) {
			t.Fatalf("canonical encodings not prefix-free: %q, %q", ca, cb)
		}
	})
}

// smallExponents reports whether every number in v has an exponent and
// length big.Rat handles quickly.
func smallExponents(v any) bool {
	switch v := v.(type) {
	case json.Number:
		s := string(v)
		if len(s) > 400 {
			return false
		}
		if i := strings.IndexAny(s, "eE"); i >= 0 {
			e := strings.TrimLeft(s[i+1:], "+-")
			e = strings.TrimLeft(e, "0")
			return len(e) <= 3
		}
	case []any:
		for _, e := range v {
			if !smallExponents(e) {
				return false
			}
		}
	case map[string]any:
		for _, e := range v {
			if !smallExponents(e) {
				return false
			}
		}
	}
	return true
}

// Fields builds its option once per list of paths: the same list gives the
// same key, and lists a cache key could confuse (a NUL inside a path) are
// told apart.
func TestFieldsOptionCache(t *testing.T) {
	payload := `{"a":1,"b":2,"a\u0000b":3}`
	fp := func(opt any) uint64 {
		t.Helper()
		r := &resolved{}
		if err := opt.(option).applyTo(r); err != nil {
			t.Fatal(err)
		}
		return mustFP(t, "t", payload, r)
	}
	if fp(Fields("a", "b")) != fp(Fields("a", "b")) || fp(Fields("a")) != fp(Fields("a")) {
		t.Error("the same fields gave two keys")
	}
	if fp(Fields("a\x00b")) == fp(Fields("a", "b")) {
		t.Error(`Fields("a\x00b") keyed as Fields("a", "b")`)
	}
	if allocs := testing.AllocsPerRun(100, func() { _ = Fields("user_id") }); allocs > 0 {
		t.Errorf("Fields of a list seen before allocates %v times", allocs)
	}
}
