package store

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
)

// What a task carries for the middleware, so that it needs no Redis call to
// know what to do with a task of a plain key: its ID's form, and for other
// tasks the header HeaderLock.
//
//	dd-<20 hex>                 locked at enqueue (NewClient's direct path): the lock is the
//	                            task's unique key, which asynq's scripts release; no header
//	dx-<20 hex>                 opted out at enqueue: never locked
//	df-<20 hex>                 a RunningDefer follow-up (its header is its holder's)
//	da-<fingerprint>-<20 hex>   the copy Again stores of a task that arrived without a lock and
//	                            met the key of that fingerprint busy on its last attempt
//	dk-<20 hex>                 the copy Again stores of a task locked at enqueue that met its
//	                            key busy on its last attempt (it keeps the original's standing)
//	dm-<flags>-<fingerprint>-<20 hex>
//	                            locked at enqueue where asynq has no task headers (before
//	                            v0.26.0): the ID carries what HeaderLock would (the lock is
//	                            the fingerprint's key in the task's queue)
//
// Any other task locked at enqueue (a caller-chosen ID, a policy that acts
// at start or end, asynq's client storing it) carries HeaderLock.
const (
	plainIDPrefix   = "dd-"
	optOutIDPrefix  = "dx-"
	followIDPrefix  = "df-"
	againIDPrefix   = "da-"
	keptIDPrefix    = "dk-"
	markedIDPrefix  = "dm-"
	randomHexDigits = 20
)

// Task headers this package writes.
const (
	// HeaderLock is "<flags> <lock key>" for a task locked at enqueue that
	// is not plain (the flags say what the middleware does; see Flags), or
	// "-" for a task opted out under a caller-chosen ID.
	HeaderLock = "dedup"
	// HeaderLost marks a task whose key is no longer its own: it lost the
	// key while it waited, was archived or failed ("healed": the key's next
	// enqueue took it over; "released": an operator released it), and its
	// next run checks the key; or an attempt of it ended and settled the key
	// ("ended": a success or revoke asynq had not yet recorded when it put
	// the task back), and it does not run again; or asynq gave an attempt up
	// while its handler ran on ("outlived": a shutdown put the task back),
	// and its next run checks the key, which that handler holds.
	HeaderLost = "dedup-lost"
)

// OptedOut is HeaderLock's value on a task enqueued without deduplication.
const OptedOut = "-"

// Lost reasons, HeaderLost's values.
const (
	LostHealed   = "healed"
	LostReleased = "released"
	LostEnded    = "ended"
	LostOutlived = "outlived"
	// LostOwed: it ended with no call (the owed signal) and asynq put it
	// back (a shutdown) while a follow-up was made of it: its next run
	// checks the key and, at its end, hands the key to that follow-up.
	LostOwed = "owed"
)

// Flags say what the middleware does with a task locked at enqueue, in
// HeaderLock.
type Flags string

// Flag letters.
const (
	FlagStart   = 's' // check the key at start (MaxPending: the key waits no more)
	FlagAllow   = 'a' // RunningAllow: free the key at start
	FlagCool    = 'c' // Cooldown, Period: hold the key after a success
	FlagKept    = 'k' // Cooldown: asynq's completed record holds the key after a success (HoldKept); release it at revoke
	FlagFail    = 'f' // OnFailure: hold the key after a final failure
	FlagDefer   = 'd' // RunningDefer: at any end, hand the key to the follow-up it owes
	FlagRelease = 'w' // the task's record does not name the lock: release it at success and revoke
)

// flagLetters are the flag letters, as a string.
const flagLetters = string(FlagStart) + string(FlagAllow) + string(FlagCool) + string(FlagKept) + string(FlagFail) + string(FlagDefer) + string(FlagRelease)

// Has reports whether f holds flag c.
func (f Flags) Has(c byte) bool { return strings.IndexByte(string(f), c) >= 0 }

// LockHeader is HeaderLock's value for a task of lock with flags.
func LockHeader(flags Flags, lock string) string { return string(flags) + " " + lock }

// ParseLockHeader reads HeaderLock's value; ok is false for none or a
// malformed one (optedOut for OptedOut).
func ParseLockHeader(v string) (flags Flags, lock string, optedOut, ok bool) {
	if v == OptedOut {
		return "", "", true, true
	}
	f, l, found := strings.Cut(v, " ")
	if !found || l == "" {
		return "", "", false, false
	}
	return Flags(f), l, false, true
}

func newRandomID(prefix string) string {
	var b [3 + randomHexDigits]byte
	copy(b[:], prefix)
	randomHex(b[3:])
	return string(b[:])
}

// NewPlainID returns a fresh ID for a task locked at enqueue on the direct
// path whose policy acts neither at start nor at end.
func NewPlainID() string { return newRandomID(plainIDPrefix) }

// NewOptOutID returns a fresh ID for a task enqueued without deduplication.
func NewOptOutID() string { return newRandomID(optOutIDPrefix) }

// NewFollowID returns a fresh ID for a RunningDefer follow-up.
func NewFollowID() string { return newRandomID(followIDPrefix) }

// NewKeptID returns a fresh ID for the copy Again stores of a task locked
// at enqueue.
func NewKeptID() string { return newRandomID(keptIDPrefix) }

// NewAgainID returns a fresh ID for the copy Again stores of a task that
// arrived without a lock and met the key fp busy: the copy carries the key,
// so that it meets that key again, whatever the server's rules.
func NewAgainID(fp string) string {
	b := make([]byte, 0, len(againIDPrefix)+len(fp)+1+randomHexDigits)
	b = append(b, againIDPrefix...)
	b = append(b, fp...)
	b = append(b, '-')
	var r [randomHexDigits]byte
	randomHex(r[:])
	return string(append(b, r[:]...))
}

// IDKind is what an ID's form says of its task.
type IDKind int

// ID kinds.
const (
	IDOther  IDKind = iota // not of this package's forms
	IDPlain                // NewPlainID
	IDOptOut               // NewOptOutID
	IDFollow               // NewFollowID
	IDAgain                // NewAgainID (its fingerprint: ParseAgainID)
	IDKept                 // NewKeptID
	IDMarked               // NewMarkedID (its flags and fingerprint: ParseMarkedID)
)

// KindOf tells an ID's form.
func KindOf(id string) IDKind {
	if len(id) < 3 || id[0] != 'd' || id[2] != '-' {
		return IDOther
	}
	if len(id) == 3+randomHexDigits && isLowerHex(id[3:]) {
		switch id[:3] {
		case plainIDPrefix:
			return IDPlain
		case optOutIDPrefix:
			return IDOptOut
		case followIDPrefix:
			return IDFollow
		case keptIDPrefix:
			return IDKept
		}
	}
	if _, ok := ParseAgainID(id); ok {
		return IDAgain
	}
	if _, _, ok := ParseMarkedID(id); ok {
		return IDMarked
	}
	return IDOther
}

// NewMarkedID returns a fresh ID for a task locked at enqueue under key fp
// with flags, for an asynq without task headers: the ID carries the mark.
func NewMarkedID(flags Flags, fp string) string {
	b := make([]byte, 0, len(markedIDPrefix)+len(flags)+1+len(fp)+1+randomHexDigits)
	b = append(b, markedIDPrefix...)
	b = append(b, flags...)
	b = append(b, '-')
	b = append(b, fp...)
	b = append(b, '-')
	var r [randomHexDigits]byte
	randomHex(r[:])
	return string(append(b, r[:]...))
}

// ParseMarkedID returns the flags and fingerprint of an ID made by
// NewMarkedID.
func ParseMarkedID(id string) (flags Flags, fp string, ok bool) {
	rest, found := strings.CutPrefix(id, markedIDPrefix)
	f, rest, found2 := strings.Cut(rest, "-")
	fp, r, found3 := strings.Cut(rest, "-")
	if !found || !found2 || !found3 || !IsFingerprint(fp) || len(r) != randomHexDigits || !isLowerHex(r) {
		return "", "", false
	}
	for i := 0; i < len(f); i++ {
		if !strings.ContainsRune(flagLetters, rune(f[i])) {
			return "", "", false
		}
	}
	return Flags(f), fp, true
}

// ParseAgainID returns the fingerprint of an ID made by NewAgainID.
func ParseAgainID(id string) (fp string, ok bool) {
	n := len(id) - len(againIDPrefix) - 1 - randomHexDigits
	if (n != 16 && n != 32) || !strings.HasPrefix(id, againIDPrefix) || id[len(againIDPrefix)+n] != '-' {
		return "", false
	}
	fp = id[len(againIDPrefix) : len(againIDPrefix)+n]
	if !isLowerHex(fp) || !isLowerHex(id[len(againIDPrefix)+n+1:]) {
		return "", false
	}
	return fp, true
}

// Reserved reports whether a caller may not choose id: it has the form of
// an ID this package makes (which the middleware reads as such), or begins
// with '~' (the mark of a lock value's other forms, value.go).
func Reserved(id string) bool { return KindOf(id) != IDOther || strings.HasPrefix(id, "~") }

// IsFingerprint reports whether s has the form of a fingerprint: 16 (xxhash)
// or 32 (keyed hash) lower-case hex digits.
func IsFingerprint(s string) bool { return (len(s) == 16 || len(s) == 32) && isLowerHex(s) }

func randomHex(dst []byte) {
	var r [randomHexDigits / 2]byte
	_, _ = rand.Read(r[:]) // crypto/rand.Read never fails (Go ≥ 1.24)
	hex.Encode(dst, r[:len(dst)/2])
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
