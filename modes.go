package dedup

import (
	"strconv"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// A key whose policy acts only at enqueue (Reject, Replace, Merge, Debounce)
// needs nothing beside its lock: asynq's record of the holder says all, and
// asynq's scripts release the lock. The modes that act when the task starts
// or ends need two things more, worked out here once per call: the flags
// the task carries (so that the middleware knows, without a Redis call,
// which calls its attempts make) and the key's mode record (the state
// those calls read: a cooldown's end, a fail hold, the running policy,
// the waiting set that counts the key, and the type and key form operators
// read).

// terms is what a call's policy needs beside its lock.
type terms struct {
	flags store.Flags
	mode  []any // the mode record (field, value pairs), nil for none
}

// termsOf works out the terms of a key taken now for task id of type typ
// under rule r. release: the task's record will not name the lock, so its
// end must release it (asynq's client stores the task). kept: a cooldown or
// period window is kept by asynq's own record of the task's success
// (call.keptFor), with no call at its end.
func termsOf(r *resolved, typ, id string, now time.Time, release, kept bool) terms {
	var f []byte
	var mode []any
	add := func(field, value string) { mode = append(mode, field, value) }
	if cool, w := r.lockTerms(now); cool > 0 {
		f = append(f, store.FlagCool)
		if kept {
			f[len(f)-1] = store.FlagKept
		}
		add(store.FieldCoolEnd, strconv.FormatInt(now.Add(cool).UnixMilli(), 10))
		if arg := w.Arg(); arg != "" {
			add(store.FieldWindow, arg)
		}
	}
	if r.failHold != 0 {
		f = append(f, store.FlagFail)
		add(store.FieldFailHold, store.FailHold(r.failHold))
	}
	switch r.running {
	case RunningAllow:
		f = append(f, store.FlagAllow)
		add(store.FieldRunning, string(store.RunAllow))
	case RunningDefer:
		f = append(f, store.FlagDefer)
		add(store.FieldRunning, string(store.RunDefer))
	}
	if r.maxPending > 0 {
		f = append(f, store.FlagStart)
		add(store.FieldBounded, typ)
	}
	if mode != nil {
		mode = append([]any{store.FieldHolder, id, store.FieldType, typ, store.FieldKeyForm, keyForm(r)}, mode...)
	}
	if release {
		f = append(f, store.FlagRelease)
	}
	return terms{flags: store.Flags(f), mode: mode}
}

// lockTTL is how long a key taken now lives while its task waits: the
// rule's TTL (with the delay of a task due later), and at least until a
// cooldown or period window ends.
func (d *Dedup) lockTTL(r *resolved, processAt, now time.Time) time.Duration {
	ttl := waitTTL(d.ttlOf(r), processAt)
	if cool, _ := r.lockTerms(now); cool > ttl {
		ttl = cool
	}
	return ttl
}
