package dedup

import (
	"fmt"
	"time"

	"github.com/hibiken/asynq"
)

// optionType is the asynq.optionType of every per-call option of this
// package. It lies outside asynq's own constants, so asynq ignores these
// options; the Client removes them before asynq sees the list anyway.
//
// Per-call options take effect in the Client's calls (Enqueue,
// EnqueueContext, Submit, EnqueueBatch), given to the call or to the task's
// asynq.NewTask (the call's override the task's), and in Scheduler.Register.
// asynq's own Client and Scheduler drop them silently; use Config.Rules for
// tasks enqueued that way.
const optionType asynq.OptionType = 0x6464

// option is a per-call option. It implements asynq.Option.
type option struct {
	apply   func(*resolved) error
	desc    string
	headers map[string]string // dedup.Headers: read by compose, not applied to the rule
}

func (o option) String() string            { return o.desc }
func (o option) Type() asynq.OptionType    { return optionType }
func (o option) Value() any                { return o.desc }
func (o option) applyTo(r *resolved) error { return o.apply(r) }

// Key deduplicates this call on an explicit key, namespaced by the task type.
// The key is hashed, so any bytes are safe in it.
func Key(key string) asynq.Option {
	return keyOption("dedup.Key", key, false)
}

// SharedKey is Key without the type namespace: tasks of different types with
// the same shared key exclude each other (within one queue). A call may not
// carry both Key and SharedKey (ErrInvalidOption), nor either twice with
// different keys.
func SharedKey(key string) asynq.Option {
	return keyOption("dedup.SharedKey", key, true)
}

func keyOption(name, key string, shared bool) asynq.Option {
	return option{desc: name + "(…)", apply: func(r *resolved) error {
		if key == "" {
			return errorf("%w: %s: empty key", ErrInvalidOption, name)
		}
		if r.callKey != "" && (r.callKey != name || r.key != key) {
			return errorf("%w: %s and %s in one call: give one key", ErrInvalidOption, r.callKey, name)
		}
		r.key, r.hasKey, r.keyFunc, r.fields, r.shared, r.optedIn = key, true, nil, nil, shared, true
		r.form = ""
		r.form = keyForm(r) // (the rule's form no longer holds)
		r.callKey = name
		return nil
	}}
}

// TTL sets how long this call's lock lasts while the task waits, overriding
// the type's rule and Config.TTL. With ProcessIn/ProcessAt the delay is added.
// Above 100 years it is 100 years. With Config.OptIn it opts the call in.
func TTL(d time.Duration) asynq.Option {
	return option{desc: fmt.Sprintf("dedup.TTL(%v)", d), apply: func(r *resolved) error {
		if d <= 0 {
			return errorf("%w: TTL %v is not positive", ErrInvalidOption, d)
		}
		r.ttl, r.optedIn = lifetime(d), true
		return nil
	}}
}

// Skip turns deduplication off for this call, whatever other options say:
// no lock, and the middleware will not lock the task at execution either.
func Skip() asynq.Option {
	return option{desc: "dedup.Skip()", apply: func(r *resolved) error {
		r.skip = true
		return nil
	}}
}
