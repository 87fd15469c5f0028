package store

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
)

// Task IDs chosen by the client wrapper carry the lock's fingerprint, so the
// middleware finds a task's lock from its ID alone, however it is
// configured:
//
//	dd-<16 or 32 hex fingerprint>-<20 hex random>   locked at enqueue
//	dx-<20 hex random>                              opted out at enqueue
//	da-<16 or 32 hex fingerprint>-<20 hex random>   a busy arrival's copy (Again), for the key it met
//	dk-<16 or 32 hex fingerprint>-<20 hex random>   the copy of a busy task locked at enqueue (Again),
//	                                                which keeps that standing
//
// A task enqueued under a caller-chosen ID has an index key (Keys.Index)
// holding its lock's fingerprint, or OptOutMark. A caller-chosen ID of one
// of these forms would mislead the middleware (Reserved).
const (
	lockedIDPrefix  = "dd-"
	optOutIDPrefix  = "dx-"
	againIDPrefix   = "da-"
	keptIDPrefix    = "dk-"
	randomHexDigits = 20
)

// OptOutMark is the value of the index key of a caller-chosen task ID that
// was enqueued without deduplication. Fingerprints are hex, so it is never
// one.
const OptOutMark = "-"

// NewLockedID returns a fresh task ID for a task locked under fp.
func NewLockedID(fp string) string { return newKeyedID(lockedIDPrefix, fp) }

// newKeyedID is prefix, fp, '-' and random hex digits.
func newKeyedID(prefix, fp string) string {
	b := make([]byte, 0, len(prefix)+len(fp)+1+randomHexDigits)
	b = append(b, prefix...)
	b = append(b, fp...)
	b = append(b, '-')
	var r [randomHexDigits]byte
	randomHex(r[:])
	return string(append(b, r[:]...))
}

// NewOptOutID returns a fresh task ID that marks a task as opted out.
func NewOptOutID() string {
	var b [len(optOutIDPrefix) + randomHexDigits]byte
	copy(b[:], optOutIDPrefix)
	randomHex(b[len(optOutIDPrefix):])
	return string(b[:])
}

// NewAgainID returns a fresh task ID for the copy Again stores of a task
// that met the key fp busy: the copy takes no lock, but carries the key, so
// when it starts it meets that key again, whatever the server's rules.
func NewAgainID(fp string) string { return newKeyedID(againIDPrefix, fp) }

// NewKeptID returns a fresh task ID for the copy Again stores of a task
// locked at enqueue that met the key fp busy on its last attempt: like
// NewAgainID's, but the copy keeps its original's standing (retried while
// the key is busy, never dropped or folded).
func NewKeptID(fp string) string { return newKeyedID(keptIDPrefix, fp) }

// IsOptOutID reports whether id was made by NewOptOutID.
func IsOptOutID(id string) bool {
	rest, ok := strings.CutPrefix(id, optOutIDPrefix)
	return ok && len(rest) == randomHexDigits && isLowerHex(rest)
}

// NewToken returns a fresh random token for one attempt of a task.
func NewToken() string {
	var b [16]byte
	randomHex(b[:])
	return string(b[:])
}

func randomHex(dst []byte) {
	var r [randomHexDigits / 2]byte
	_, _ = rand.Read(r[:]) // crypto/rand.Read never fails (Go ≥ 1.24)
	hex.Encode(dst, r[:len(dst)/2])
}

// ParseLockedID returns the fingerprint of an ID made by NewLockedID.
func ParseLockedID(id string) (fp string, ok bool) { return parseKeyedID(lockedIDPrefix, id) }

// ParseAgainID returns the fingerprint of an ID made by NewAgainID.
func ParseAgainID(id string) (fp string, ok bool) { return parseKeyedID(againIDPrefix, id) }

// ParseKeptID returns the fingerprint of an ID made by NewKeptID.
func ParseKeptID(id string) (fp string, ok bool) { return parseKeyedID(keptIDPrefix, id) }

// parseKeyedID returns the fingerprint of an ID made by newKeyedID with
// prefix.
func parseKeyedID(prefix, id string) (fp string, ok bool) {
	n := len(id) - len(prefix) - 1 - randomHexDigits
	if (n != 16 && n != 32) || !strings.HasPrefix(id, prefix) || id[len(prefix)+n] != '-' {
		return "", false
	}
	fp = id[len(prefix) : len(prefix)+n]
	if !isLowerHex(fp) || !isLowerHex(id[len(prefix)+n+1:]) {
		return "", false
	}
	return fp, true
}

// Reserved reports whether id has the form of an ID this package makes,
// which the middleware reads as such, so a caller may not choose it: for a
// call that takes the lock of fingerprint fp, any but NewLockedID's form
// for fp itself (an ID copied from an earlier task of the key); for a call
// without a lock (fp ""), NewLockedID's, NewAgainID's and NewKeptID's (an
// opted-out form is what it is).
func Reserved(id, fp string) bool {
	if own, ok := ParseLockedID(id); ok {
		return own != fp || fp == ""
	}
	if _, again := ParseAgainID(id); again {
		return true
	}
	if _, kept := ParseKeptID(id); kept {
		return true
	}
	return fp != "" && IsOptOutID(id)
}

// IsFingerprint reports whether s has the form of a fingerprint: 16 (xxhash)
// or 32 (keyed hash) lower-case hex digits.
func IsFingerprint(s string) bool { return (len(s) == 16 || len(s) == 32) && isLowerHex(s) }

// Lock records store their owner's task ID compactly (a lock is mostly its
// owner's ID): an ID made by NewLockedID for the lock's own fingerprint as
// its 20 random hex digits, any other ID as itself, or as "=" + ID where
// that would be ambiguous (20 hex digits, or a leading '='). Locks written
// before this packing, with the whole ID, read back as that ID. The Lua
// scripts never pack or unpack: they compare and copy packed IDs, and are
// given both forms where they need both.

// PackOwner returns task ID id as the lock of fingerprint fp stores it.
func PackOwner(id, fp string) string {
	if rest, ok := strings.CutPrefix(id, lockedIDPrefix); ok {
		if r, ok := strings.CutPrefix(rest, fp); ok && len(r) == 1+randomHexDigits && r[0] == '-' && isLowerHex(r[1:]) {
			return r[1:]
		}
	}
	if strings.HasPrefix(id, "=") || (len(id) == randomHexDigits && isLowerHex(id)) {
		return "=" + id
	}
	return id
}

// UnpackOwner returns the task ID a lock of fingerprint fp stores as s.
func UnpackOwner(s, fp string) string {
	if rest, ok := strings.CutPrefix(s, "="); ok {
		return rest
	}
	if len(s) == randomHexDigits && isLowerHex(s) {
		return lockedIDPrefix + fp + "-" + s
	}
	return s
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
