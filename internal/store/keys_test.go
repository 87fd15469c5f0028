package store

import (
	"strings"
	"testing"
)

func TestParseLockKey(t *testing.T) {
	fp16, fp32 := "0123456789abcdef", "0123456789abcdef0123456789abcdef"
	for _, c := range []struct {
		key, queue, fp string
		ok             bool
	}{
		{"dedup:{critical}:l:" + fp16, "critical", fp16, true},
		{"dedup:{critical}:l:" + fp32, "critical", fp32, true},
		{"dedup:{a}:l:b}:l:" + fp16, "a}:l:b", fp16, true}, // parsed from the end
		{"dedup:{{x}}:l:" + fp16, "{x}", fp16, true},
		{"dedup:{}:l:" + fp16, "", "", false},                     // empty queue
		{"dedup:{q}:l:0123456789ABCDEF", "", "", false},           // upper case: never written
		{"dedup:{q}:l:0123456789abcde", "", "", false},            // 15 digits
		{"dedup:{q}:i:" + fp16, "", "", false},                    // index key
		{"other:{q}:l:" + fp16, "", "", false},                    // other prefix
		{"dedupx:{q}:l:" + fp16, "", "", false},                   // prefix is not a word prefix
		{"dedup:{q}:l:" + fp16 + "0", "", "", false},              // 17 digits
		{"asynq:{q}:t:dd-" + fp16 + "-0123", "", "", false},       // asynq's key
		{"dedup:{q}:l:" + strings.Repeat("g", 16), "", "", false}, // not hex
	} {
		q, fp, ok := NewKeys("dedup").ParseLock(c.key)
		if ok != c.ok || q != c.queue || fp != c.fp {
			t.Errorf("parseLockKey(%q) = %q, %q, %v; want %q, %q, %v", c.key, q, fp, ok, c.queue, c.fp, c.ok)
		}
	}
}

func TestParseLockedID(t *testing.T) {
	fp := "0123456789abcdef"
	rnd := "0123456789abcdef0123"
	for id, want := range map[string]string{
		"dd-" + fp + "-" + rnd:          fp,
		"dd-" + fp + fp + "-" + rnd:     fp + fp,
		"dx-" + rnd:                     "",
		"dd-" + fp + "-" + rnd + "0":    "",
		"my-own-id":                     "",
		"dd-" + fp + "x" + rnd:          "",
		"dd-" + fp[:15] + "-" + rnd[1:]: "",
	} {
		got, ok := ParseLockedID(id)
		if got != want || ok != (want != "") {
			t.Errorf("parseLockedID(%q) = %q, %v; want %q", id, got, ok, want)
		}
	}
}
