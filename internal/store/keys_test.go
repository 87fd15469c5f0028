package store

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

func TestParseLockKey(t *testing.T) {
	fp16, fp32 := "0123456789abcdef", "0123456789abcdef0123456789abcdef"
	for _, c := range []struct {
		key, queue, fp string
		ok             bool
	}{
		{"dedup:{critical}:u:" + fp16, "critical", fp16, true},
		{"dedup:{critical}:u:" + fp32, "critical", fp32, true},
		{"dedup:{a}:u:b}:u:" + fp16, "a}:u:b", fp16, true}, // parsed from the end
		{"dedup:{{x}}:u:" + fp16, "{x}", fp16, true},
		{"dedup:{}:u:" + fp16, "", "", false},                     // empty queue
		{"dedup:{q}:u:0123456789ABCDEF", "", "", false},           // upper case: never written
		{"dedup:{q}:u:0123456789abcde", "", "", false},            // 15 digits
		{"dedup:{q}:m:" + fp16, "", "", false},                    // the mode record
		{"dedup:{q}:l:" + fp16, "", "", false},                    // the old layout's hash lock
		{"other:{q}:u:" + fp16, "", "", false},                    // other prefix
		{"dedupx:{q}:u:" + fp16, "", "", false},                   // prefix is not a word prefix
		{"dedup:{q}:u:" + fp16 + "0", "", "", false},              // 17 digits
		{"asynq:{q}:t:dd-" + fp16 + "-0123", "", "", false},       // asynq's key
		{"dedup:{q}:u:" + strings.Repeat("g", 16), "", "", false}, // not hex
	} {
		q, fp, ok := NewKeys("dedup").ParseLock(c.key)
		if ok != c.ok || q != c.queue || fp != c.fp {
			t.Errorf("ParseLock(%q) = %q, %q, %v; want %q, %q, %v", c.key, q, fp, ok, c.queue, c.fp, c.ok)
		}
	}
}

// A lock's mode record and waiting set are found from the lock's key alone,
// in its queue's slot, whatever the queue's name holds.
func TestKeysBesideTheLock(t *testing.T) {
	k := NewKeys("dedup")
	fp := "0123456789abcdef"
	for _, q := range []string{"critical", "a}:u:b", "a}:m:b", "{x}"} {
		lock := k.Lock(q, fp)
		if got, want := ModeOf(lock), "dedup:{"+q+"}:m:"+fp; got != want {
			t.Errorf("ModeOf(%q) = %q, want %q", lock, got, want)
		}
		if got := LockOfMode(ModeOf(lock)); got != lock {
			t.Errorf("LockOfMode(%q) = %q, want %q", ModeOf(lock), got, lock)
		}
		if got, want := WaitOf(lock, "t"), k.Wait(q, "t"); got != want {
			t.Errorf("WaitOf(%q) = %q, want %q", lock, got, want)
		}
		if p, gotQ, gotFP, ok := ParseLockKey(lock); !ok || p != "dedup" || gotQ != q || gotFP != fp {
			t.Errorf("ParseLockKey(%q) = %q, %q, %q, %v", lock, p, gotQ, gotFP, ok)
		}
	}
}

// A key that is not a mode record names no lock.
func TestLockOfModeOfOtherKeys(t *testing.T) {
	for _, key := range []string{"dedup:{q}:u:0123456789abcdef", "dedup:{q}:m:0123456789abcde", "dedup:{q}:m:", "asynq:{q}:t:x", ""} {
		if got := LockOfMode(key); got != "" {
			t.Errorf("LockOfMode(%q) = %q, want \"\"", key, got)
		}
	}
}

// Each ID form this package makes is told apart by its form alone, the
// middleware's only clue for a plain task; a caller may choose none of them,
// nor any ID beginning with '~' (a lock value's mark).
func TestIDForms(t *testing.T) {
	fp, fp32 := "0123456789abcdef", "0123456789abcdef0123456789abcdef"
	rnd := "0123456789abcdef0123"
	for id, want := range map[string]IDKind{
		NewPlainID():                     IDPlain,
		NewOptOutID():                    IDOptOut,
		NewFollowID():                    IDFollow,
		NewKeptID():                      IDKept,
		NewAgainID(fp):                   IDAgain,
		NewAgainID(fp32):                 IDAgain,
		"dd-" + rnd:                      IDPlain,
		"dd-" + rnd + "0":                IDOther, // 21 digits
		"dd-" + rnd[1:]:                  IDOther, // 19
		"dd-0123456789ABCDEF0123":        IDOther, // upper case
		"dz-" + rnd:                      IDOther, // no such form
		"da-" + fp + "-" + rnd:           IDAgain,
		"da-" + fp[1:] + "-" + rnd + "0": IDOther,
		"da-" + fp + "x" + rnd:           IDOther,
		NewMarkedID("sw", fp):            IDMarked,
		NewMarkedID("", fp32):            IDMarked,
		"dm-scw-" + fp + "-" + rnd:       IDMarked,
		"dm-sz-" + fp + "-" + rnd:        IDOther, // no such flag
		"dm-s-" + fp[1:] + "-" + rnd:     IDOther,
		"dm-s-" + fp + "-" + rnd[1:]:     IDOther,
		"dm-s" + fp + "-" + rnd:          IDOther,
		"my-own-id":                      IDOther,
		"":                               IDOther,
	} {
		if got := KindOf(id); got != want {
			t.Errorf("KindOf(%q) = %v, want %v", id, got, want)
		}
		if got := Reserved(id); got != (want != IDOther) {
			t.Errorf("Reserved(%q) = %v", id, got)
		}
	}
	for _, id := range []string{"~w1:x", "~c:x", "~"} {
		if !Reserved(id) {
			t.Errorf("Reserved(%q) = false: a lock value's mark", id)
		}
	}
	for _, f := range []string{fp, fp32} {
		if got, ok := ParseAgainID(NewAgainID(f)); !ok || got != f {
			t.Errorf("ParseAgainID(NewAgainID(%q)) = %q, %v", f, got, ok)
		}
	}
	if _, ok := ParseAgainID(NewPlainID()); ok {
		t.Error("ParseAgainID read a plain ID")
	}
	for _, f := range []Flags{"", "sw", "sacfdw"} {
		if got, gotFP, ok := ParseMarkedID(NewMarkedID(f, fp)); !ok || got != f || gotFP != fp {
			t.Errorf("ParseMarkedID(NewMarkedID(%q, %q)) = %q, %q, %v", f, fp, got, gotFP, ok)
		}
	}
}

// A task stored in another queue than its call's lock holds its key in
// the queue it is in: same prefix and fingerprint (relocate.go).
func TestLockInIsTheSameKeyInAnotherQueue(t *testing.T) {
	k := NewKeys("p")
	fp := "00000000000000a1"
	if got, want := LockIn(k.Lock("asked", fp), "runs"), k.Lock("runs", fp); got != want {
		t.Fatalf("LockIn: %s, want %s", got, want)
	}
	for _, lock := range []string{k.Lock("runs", fp), "not-a-lock"} {
		if got := LockIn(lock, "runs"); got != lock {
			t.Fatalf("LockIn(%q): %s, want it unchanged", lock, got)
		}
	}
}

// TaskLockOf of a task an enqueuer stored in another queue than its call's
// (its header names the lock of the queue asked for) is its key's lock in
// the queue it is in, where it holds the key (what dedupctl show --task
// and the lock browser describe).
func TestTaskLockOfARelocatedTaskIsItsKeyInTheQueueItIsIn(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	k, q, fp := NewKeys("p-"+redistest.Uniq(t)), redistest.Uniq(t), "00000000000000a2"
	m := &Message{Type: "t", ID: "caller-1", Queue: q, Retry: 25, Timeout: time.Minute,
		Headers: map[string]string{HeaderLock: LockHeader("", k.Lock(q+"-asked", fp))}}
	rdb.HSet(ctx, TaskKey(q, m.ID), "msg", m.Encode(), "state", "retry")
	lock, optedOut, err := TaskLockOf(ctx, rdb, q, m.ID)
	if err != nil || optedOut || lock != k.Lock(q, fp) {
		t.Fatalf("TaskLockOf: %q, %v, %v; want %s", lock, optedOut, err, k.Lock(q, fp))
	}
}
