package dedup

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
)

// OptionType is the asynq.OptionType of every per-call option of this
// package. It lies outside asynq's own constants, so asynq ignores these
// options; the Client removes them before asynq sees the list anyway.
//
// Per-call options only take effect in Client.Enqueue/EnqueueContext. Given
// to asynq.NewTask or Scheduler.Register they are silently dropped by asynq;
// use Config.Rules for those.
const OptionType asynq.OptionType = 0x6464

// option is a per-call option. It implements asynq.Option.
type option struct {
	apply func(*resolved) error
	desc  string
}

func (o option) String() string            { return o.desc }
func (o option) Type() asynq.OptionType    { return OptionType }
func (o option) Value() any                { return o.desc }
func (o option) applyTo(r *resolved) error { return o.apply(r) }

// Fields deduplicates this call on the given JSON payload paths (dotted for
// nested members: "report.kind"), overriding the type's rule. As in a Rule,
// an explicit key beats fields: with Key or SharedKey in the same call,
// whatever the order, Fields has no effect.
//
// The option for a list of paths is built once and reused (calls mostly
// name their fields per call), for up to maxFieldOptions distinct lists.
func Fields(paths ...string) asynq.Option {
	key, cacheable := fieldsKey(paths)
	if cacheable {
		if o, ok := fieldOptions.m.Load(key); ok {
			return o.(asynq.Option) // (only these are stored)
		}
	}
	var o asynq.Option = newFieldsOption(slices.Clone(paths)) // (paths stays the caller's)
	if cacheable && fieldOptions.n.Load() < maxFieldOptions {
		if _, loaded := fieldOptions.m.LoadOrStore(key, o); !loaded {
			fieldOptions.n.Add(1)
		}
	}
	return o
}

// fieldOptions holds the options Fields built, by fieldsKey.
var fieldOptions struct {
	m sync.Map
	n atomic.Int32
}

// maxFieldOptions bounds fieldOptions, so that paths made at run time
// cannot grow it without end.
const maxFieldOptions = 1024

// fieldsKey is the cache key of a list of paths: the paths joined by NUL,
// which a path holding NUL would make ambiguous (not cached, nor is an
// empty list).
func fieldsKey(paths []string) (string, bool) {
	if len(paths) == 0 {
		return "", false
	}
	for _, p := range paths {
		if strings.IndexByte(p, 0) >= 0 {
			return "", false
		}
	}
	if len(paths) == 1 {
		return paths[0], true
	}
	return strings.Join(paths, "\x00"), true
}

func newFieldsOption(paths []string) option {
	fs, err := compileFields(paths)
	if err == nil && fs == nil {
		err = fmt.Errorf("%w: Fields needs at least one path", ErrInvalidOption)
	}
	return option{desc: fmt.Sprintf("dedup.Fields(%s)", strings.Join(paths, ", ")), apply: func(r *resolved) error {
		if err != nil {
			return err
		}
		r.optedIn = true
		if r.callKey != "" {
			return nil // the call's explicit key beats its fields
		}
		r.fields, r.key, r.hasKey, r.keyFunc = fs, "", false, nil
		return nil
	}}
}

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
			return fmt.Errorf("%w: %s: empty key", ErrInvalidOption, name)
		}
		if r.callKey != "" && (r.callKey != name || r.key != key) {
			return fmt.Errorf("%w: %s and %s in one call: give one key", ErrInvalidOption, r.callKey, name)
		}
		r.key, r.hasKey, r.keyFunc, r.fields, r.shared, r.optedIn = key, true, nil, nil, shared, true
		r.callKey = name
		return nil
	}}
}

// TTL sets how long this call's lock lasts while the task waits, overriding
// the type's rule and Config.TTL. With ProcessIn/ProcessAt the delay is added.
// Above MaxLifetime it is MaxLifetime. With Config.OptIn it opts the call in.
func TTL(d time.Duration) asynq.Option {
	return option{desc: fmt.Sprintf("dedup.TTL(%v)", d), apply: func(r *resolved) error {
		if d <= 0 {
			return fmt.Errorf("%w: TTL %v is not positive", ErrInvalidOption, d)
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
