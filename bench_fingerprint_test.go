package dedup

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/asynq-dedup/dedup/internal/jsonkey/jsonkeytest"

	"github.com/cespare/xxhash/v2"
)

// Benchmarks of fingerprint against the obvious alternatives, side by side:
//
//	go test -run='^$' -bench=Fingerprint -benchmem -count=3 .
//
// Targets: ≤ 1 µs on the 200 B payload, ≤ 5 µs on the 4 KB one, ≤ 1
// allocation per fingerprint (TestFingerprintAllocs enforces the allocation
// count, see fingerprint_test.go).

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
	fs, err := jsonkey.Compile(jsonkeytest.PayloadPaths)
	if err != nil {
		b.Fatal(err)
	}
	fields := &resolved{fields: fs}
	raw := &resolved{}
	key := &resolved{key: "user-1234567", hasKey: true}
	for _, p := range []struct {
		name    string
		payload []byte
	}{{"200B", jsonkeytest.Payload200B}, {"4KB", jsonkeytest.Payload4KB}} {
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
	fs, err := jsonkey.Compile([]string{"report", "tenant"})
	if err != nil {
		b.Fatal(err)
	}
	benchFP(b, jsonkeytest.Payload4KB, &resolved{fields: fs})
}

// BenchmarkFingerprintIndented is fields3/4KB with the payload indented
// (json.Indent, tabs): the scanner's paths for white space.
func BenchmarkFingerprintIndented(b *testing.B) {
	var buf bytes.Buffer
	if err := json.Indent(&buf, jsonkeytest.Payload4KB, "", "\t"); err != nil {
		b.Fatal(err)
	}
	fs, err := jsonkey.Compile(jsonkeytest.PayloadPaths)
	if err != nil {
		b.Fatal(err)
	}
	benchFP(b, buf.Bytes(), &resolved{fields: fs})
}
