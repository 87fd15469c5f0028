package jsonkey

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/asynq-dedup/dedup/internal/jsonkey/jsonkeytest"
)

// Benchmarks of the two halves of a fields fingerprint (package dedup's
// BenchmarkFingerprint measures them together, with the hash):
//
//	go test -run='^$' -bench=. -benchmem -count=10 ./internal/jsonkey

var benchSink int

func BenchmarkSelect(b *testing.B) {
	var indented bytes.Buffer
	if err := json.Indent(&indented, jsonkeytest.Payload4KB, "", "\t"); err != nil {
		b.Fatal(err)
	}
	fs, err := Compile(jsonkeytest.PayloadPaths)
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range []struct {
		name    string
		payload []byte
		fs      *Fields
	}{
		{"fields3/200B", jsonkeytest.Payload200B, fs},
		{"fields3/4KB", jsonkeytest.Payload4KB, fs},
		{"fields3/4KB-indented", indented.Bytes(), fs},
		{"validate/4KB", jsonkeytest.Payload4KB, nil},
	} {
		b.Run(p.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(p.payload)))
			var spans [MaxFields]Span
			for b.Loop() {
				if err := Select(p.payload, p.fs, &spans); err != nil {
					b.Fatal(err)
				}
			}
			benchSink = spans[0].End
		})
	}
}

func BenchmarkAppendCanonical(b *testing.B) {
	fs, err := Compile([]string{"items", "report", "trace_id", "user_id"})
	if err != nil {
		b.Fatal(err)
	}
	var spans [MaxFields]Span
	payload := jsonkeytest.Payload4KB
	if err := Select(payload, fs, &spans); err != nil {
		b.Fatal(err)
	}
	for i, p := range fs.Paths() {
		v := payload[spans[i].Start:spans[i].End]
		b.Run(p, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(v)))
			var buf [256]byte
			for b.Loop() {
				out, err := AppendCanonical(buf[:0], v)
				if err != nil {
					b.Fatal(err)
				}
				benchSink = len(out)
			}
		})
	}
}
