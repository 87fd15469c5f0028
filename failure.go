package dedup

import (
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"
)

// Failure says what becomes of a key when its task fails for good: asynq
// archives it after its last retry, or at once for asynq.SkipRetry (a
// panic counts as an error). A revoked task (asynq.RevokeTask), one an
// operator deletes, and one that succeeds are not failures: their keys
// free (or cool down) as usual. The policy is recorded in the lock when
// the key is taken, so the server needs no matching configuration.
//
// A held key answers every enqueue with a *DuplicateTaskError whose Failed
// is set, and the middleware drops a task that arrives without a lock at
// it, as it does at a cooling key. The holder's last error is kept in the
// lock (Lookup, dedupctl show, the lock browser). Dedup.Release (dedupctl
// release, the lock browser's release) frees it by hand; running the
// archived task again (Inspector.RunTask) makes it the key's running holder
// again.
//
// One case holds nothing: a worker killed during the task's last attempt.
// asynq's recoverer archives the task without running any middleware, so
// no hold is written: the key is held until then, and heals at its next
// enqueue after.
type Failure int

const (
	// FailRelease frees the key when its task fails for good (the default).
	FailRelease Failure = iota
	// FailHold keeps the key held for a while after its task fails for
	// good (a failing job is not re-run for a while).
	FailHold
	// FailHoldUntilReleased keeps the key held after its task fails for
	// good until someone releases it (a person looks first). The lock has
	// no expiry then.
	FailHoldUntilReleased
)

// String returns the policy's name: "release", "hold" or
// "hold_until_released".
func (f Failure) String() string {
	switch f {
	case FailRelease:
		return "release"
	case FailHold:
		return "hold"
	case FailHoldUntilReleased:
		return "hold_until_released"
	}
	return fmt.Sprintf("Failure(%d)", int(f))
}

// goName is f as Go code names it ("FailHold"), for the description of an
// OnFailure option.
func (f Failure) goName() string {
	switch f {
	case FailRelease:
		return "FailRelease"
	case FailHold:
		return "FailHold"
	case FailHoldUntilReleased:
		return "FailHoldUntilReleased"
	}
	return fmt.Sprintf("Failure(%d)", int(f))
}

// OnFailure sets this call's failure policy (see Rule.OnFailure),
// overriding the type's rule: hold is how long FailHold holds the key
// (above 100 years it is 100 years) and must be 0 for the other
// policies. It applies when this call takes the key; a call folded into a
// waiting task leaves that key's policy as it was. With Config.OptIn it
// opts the call in.
func OnFailure(f Failure, hold time.Duration) asynq.Option {
	desc := fmt.Sprintf("dedup.OnFailure(%s, %v)", f.goName(), hold)
	return option{desc: desc, apply: func(r *resolved) error {
		d, err := failHold(f, hold)
		if err != nil {
			return err
		}
		r.failHold, r.failSet, r.optedIn = d, true, true
		r.callKept = append(r.callKept[:len(r.callKept):len(r.callKept)], desc) // (a copy: the rule's slice is shared)
		return nil
	}}
}

// failHold checks a failure policy and returns the hold it records: 0
// release, negative until released, else the hold.
func failHold(f Failure, hold time.Duration) (time.Duration, error) {
	switch {
	case f < FailRelease || f > FailHoldUntilReleased:
		return 0, errorf("%w: unknown OnFailure %v", ErrInvalidOption, f)
	case f == FailHold && hold <= 0:
		return 0, errorf("%w: OnFailure FailHold needs a positive hold (FailHoldFor), not %v", ErrInvalidOption, hold)
	case f != FailHold && hold != 0:
		return 0, errorf("%w: a hold of %v goes with OnFailure FailHold only, not %s", ErrInvalidOption, hold, f.goName())
	case f == FailHold:
		return lifetime(hold), nil
	case f == FailHoldUntilReleased:
		return -1, nil
	}
	return 0, nil
}

// maxFailureText bounds the error a lock keeps after a final failure, in
// bytes, with the mark of a cut (the scripts cut at 1000 bytes).
const maxFailureText = 996

// failureText is err's text as a held lock keeps it: at most
// maxFailureText bytes, cut at a character boundary and marked "…". (A
// panic is kept as errPanicked: its value may quote the payload.)
func failureText(err error) string {
	s := err.Error()
	if len(s) <= maxFailureText {
		return s
	}
	cut := maxFailureText - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
