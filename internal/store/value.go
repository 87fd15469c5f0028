package store

import (
	"strconv"
	"strings"
	"time"
)

// A lock is a string whose value names the task holding the key, as
// asynq's own unique keys do; asynq's scripts compare it with the task's ID
// and delete it when the task succeeds, is revoked or deleted, if the
// task's record names the lock (its unique key). The other forms are held
// on purpose past the task, or were taken before the task was stored, and
// asynq's scripts leave them alone (prelude.lua's holder_of reads them):
//
//	<task ID>               held by the task (stored with the lock, or taking it as it starts)
//	~w<unix seconds>:<ID>   held by a task enqueued through asynq's client, taken at that
//	                        second before its task was stored (it heals only after the grace)
//	~a<token>:<ID>          taken as the task started, its record naming no lock (a task that
//	                        arrived without one): the task's end releases it. The token is
//	                        the attempt's (may be empty), so that a release of an earlier
//	                        attempt's, arriving late, leaves a later one's lock alone
//	~c:<ID>                 cooling: the task succeeded; held until the lock expires
//	~k<unix ms>:<ID>        held by its task, stored with the lock, which asynq's scripts never
//	                        release: once asynq's record says the task completed (its
//	                        Retention keeps that record past the unix ms), cooling until then;
//	                        gone, archived, or completed with the time passed: it heals
//	~x:<ID>                 a Scheduler firing's: held until it expires, whatever its task does
//
// A fail hold (OnFailure) keeps the value as it is: an archived (or
// since deleted) holder whose mode record holds its error (FieldError)
// holds the key until the lock expires or someone releases it; asynq
// releases it if it runs the task again and the task succeeds.
//
// A caller-chosen task ID may therefore not begin with '~' (Reserved).

// Hold is the kind of a lock's value.
type Hold byte

// Kinds of lock values.
const (
	HoldTask    Hold = 0   // held by its task
	HoldWrap    Hold = 'w' // taken before its task was stored (asynq's client enqueues it)
	HoldStart   Hold = 'a' // taken as its task started
	HoldCooling Hold = 'c' // cooling after its task's success
	HoldKept    Hold = 'k' // held by its task; cooling until At once asynq's record says it completed
	HoldFiring  Hold = 'x' // a Scheduler firing's, held until it expires
)

// heldFailed is the kind the scripts report for a key held after its task
// failed for good (a fail hold).
const heldFailed = "f"

// Value is the lock value of a key held by task id.
func Value(id string) string { return id }

// WrapValue is the lock value of a key taken at at for task id, which
// asynq's client stores next.
func WrapValue(id string, at time.Time) string {
	return "~w" + strconv.FormatInt(at.Unix(), 10) + ":" + id
}

// StartValue is the lock value of a key task id takes as it starts, its
// record naming no lock.
func StartValue(id, token string) string { return "~a" + token + ":" + id }

// KeptValue is the lock value of a key held by task id, stored with the
// lock, that cools down until until once asynq records the task completed.
func KeptValue(id string, until time.Time) string {
	return "~k" + strconv.FormatInt(until.UnixMilli(), 10) + ":" + id
}

// FiringValue is the lock value of a Scheduler firing's key.
func FiringValue(id string) string { return "~x:" + id }

// Parsed is a lock value read.
type Parsed struct {
	Holder string // the task the value names
	Kind   Hold
	At     time.Time // HoldWrap: when the key was taken; HoldKept: when its cooldown ends
}

// ParseValue reads a lock value.
func ParseValue(v string) Parsed {
	if !strings.HasPrefix(v, "~") || len(v) < 3 {
		return Parsed{Holder: v}
	}
	i := strings.IndexByte(v, ':')
	if i < 2 {
		return Parsed{Holder: v}
	}
	p := Parsed{Holder: v[i+1:], Kind: Hold(v[1])}
	n, _ := strconv.ParseInt(v[2:i], 10, 64)
	switch p.Kind {
	case HoldWrap:
		p.At = time.Unix(n, 0)
	case HoldKept:
		p.At = time.UnixMilli(n)
	}
	return p
}

// HeldOnPurpose reports whether the value holds the key past its task:
// cooling, or a firing's.
func (p Parsed) HeldOnPurpose() bool { return p.Kind == HoldCooling || p.Kind == HoldFiring }
