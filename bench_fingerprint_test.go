package dedup

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// Benchmarks of fingerprint against the obvious alternatives, side by side:
//
//	go test -run='^$' -bench=Fingerprint -benchmem -count=3 .
//
// Targets: ≤ 1 µs on the 200 B payload, ≤ 5 µs on the 4 KB one, ≤ 1
// allocation per fingerprint (TestFingerprintAllocs enforces the allocation
// count, see fingerprint_test.go).

// benchSmall is a ~200 byte task payload. The selected fields sit early
// (user_id), in a nested object (report.kind) and last (tenant).
var benchSmall = []byte(`{"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","user_id":1234567,` +
	`"report":{"kind":"daily","format":"pdf","range":{"from":"2024-01-01","to":"2024-01-31"}},` +
	`"locale":"en-GB","priority":3,"tenant":"acme-corp"}`)

// benchLarge is a ~4 KB task payload of the same shape, with a long array of
// line items between report and tenant, so tenant is near the end.
var benchLarge = func() []byte {
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

var benchPaths = []string{"user_id", "report.kind", "tenant"}

// benchStruct is what a hand-written decoder of the three fields would use.
type benchStruct struct {
	UserID json.Number `json:"user_id"`
	Report struct {
		Kind string `json:"kind"`
	} `json:"report"`
	Tenant string `json:"tenant"`
}

var benchSink uint64

func BenchmarkFingerprint(b *testing.B) {
	fs, err := compileFields(benchPaths)
	if err != nil {
		b.Fatal(err)
	}
	fields := &resolved{fields: fs}
	raw := &resolved{}
	key := &resolved{key: "user-1234567", hasKey: true}
	for _, p := range []struct {
		name    string
		payload []byte
	}{{"200B", benchSmall}, {"4KB", benchLarge}} {
		payload := p.payload
		b.Run("fields3/"+p.name, func(b *testing.B) {
			benchFP(b, payload, fields)
		})
		b.Run("raw/"+p.name, func(b *testing.B) {
			benchFP(b, payload, raw)
		})
		b.Run("key/"+p.name, func(b *testing.B) {
			benchFP(b, payload, key)
		})
		// Baseline: decode everything into maps, re-marshal the three fields.
		b.Run("baseline-map/"+p.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(payload)))
			for b.Loop() {
				var m map[string]any
				if err := json.Unmarshal(payload, &m); err != nil {
					b.Fatal(err)
				}
				sel := map[string]any{"user_id": m["user_id"], "tenant": m["tenant"]}
				if rep, ok := m["report"].(map[string]any); ok {
					sel["report.kind"] = rep["kind"]
				}
				out, err := json.Marshal(sel)
				if err != nil {
					b.Fatal(err)
				}
				benchSink = xxhash.Sum64(out)
			}
		})
		// Baseline: decode into a struct of the three fields (no
		// canonicalisation at all, and it needs a type per task).
		b.Run("baseline-struct/"+p.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(payload)))
			for b.Loop() {
				var s benchStruct
				if err := json.Unmarshal(payload, &s); err != nil {
					b.Fatal(err)
				}
				benchSink = xxhash.Sum64String(string(s.UserID)) ^ xxhash.Sum64String(s.Report.Kind) ^ xxhash.Sum64String(s.Tenant)
			}
		})
	}
}

func benchFP(b *testing.B, payload []byte, r *resolved) {
	b.ReportAllocs()
	b.SetBytes(int64(len(payload)))
	for b.Loop() {
		fp, err := fingerprint("report:build", payload, r)
		if err != nil {
			b.Fatal(err)
		}
		benchSink = fp
	}
}

// BenchmarkFingerprintObjectField selects a whole object (report), which
// takes the slower path that sorts members.
func BenchmarkFingerprintObjectField(b *testing.B) {
	fs, err := compileFields([]string{"report", "tenant"})
	if err != nil {
		b.Fatal(err)
	}
	benchFP(b, benchLarge, &resolved{fields: fs})
}

// BenchmarkFingerprintIndented is fields3/4KB with the payload indented
// (json.Indent, tabs): the scanner's paths for white space.
func BenchmarkFingerprintIndented(b *testing.B) {
	var buf bytes.Buffer
	if err := json.Indent(&buf, benchLarge, "", "\t"); err != nil {
		b.Fatal(err)
	}
	fs, err := compileFields(benchPaths)
	if err != nil {
		b.Fatal(err)
	}
	benchFP(b, buf.Bytes(), &resolved{fields: fs})
}
