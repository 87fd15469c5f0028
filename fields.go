package dedup

// Field selection: keying a task on some members of its JSON payload.
//
// Paths are dot-separated member names ("user_id", "report.kind"). A member
// whose name holds a dot cannot be addressed, and paths do not descend into
// arrays: an array is one value. The payload is scanned once, without
// building maps (internal/jsonkey), and must be one valid JSON value.
//
// Selected values are canonical, so these do not change the key: member
// order and white space at any depth; string escapes ("\u00e9" is "é",
// invalid UTF-8 and lone surrogates become U+FFFD, as in encoding/json);
// number spelling (exact decimals: 1 = 1.0 = 1e0 = 10e-1, -0 = 0, never
// converted to float64; exponents beyond ±10⁹ are refused); a member
// repeated in one object (the last counts, as in encoding/json). Types stay
// distinct: 1, "1" and true are three keys, and null is not missing.
//
// A missing field is a *PayloadError matching ErrFieldMissing, unless
// Rule.MissingAsNull is set; a payload that is not JSON is a *PayloadError
// too. Either way nothing is locked or enqueued, and the error never quotes
// the payload.

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

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
		err = errorf("%w: Fields needs at least one path", ErrInvalidOption)
	}
	var form string // once per option, not per call
	if fs != nil {
		form = store.KeyFormFields(fs.Paths())
	}
	return option{desc: fmt.Sprintf("dedup.Fields(%s)", strings.Join(paths, ", ")), apply: func(r *resolved) error {
		if err != nil {
			return err
		}
		r.optedIn = true
		if r.callKey != "" {
			return nil // the call's explicit key beats its fields
		}
		r.fields, r.key, r.hasKey, r.keyFunc, r.form = fs, "", false, nil, form
		return nil
	}}
}

// compileFields compiles a field selection (nil for none), with errors
// matching ErrInvalidOption.
func compileFields(paths []string) (*jsonkey.Fields, error) {
	fs, err := jsonkey.Compile(paths)
	if err != nil {
		return nil, errorf("%w: %w", ErrInvalidOption, err)
	}
	return fs, nil
}

// PayloadError reports a payload that cannot be fingerprinted. It names the
// task type and, where there is one, the field; it never quotes the payload.
type PayloadError struct {
	Type  string // task type
	Field string // selected field path, or "" when not about one field
	Err   error  // cause
}

func (e *PayloadError) Error() string {
	if e.Field != "" {
		return fmt.Sprintf("dedup: task %q: field %q: %s", e.Type, e.Field, unprefixed(e.Err))
	}
	return fmt.Sprintf("dedup: task %q: %s", e.Type, unprefixed(e.Err))
}

// Is reports whether target is ErrInvalidPayload.
func (e *PayloadError) Is(target error) bool { return target == ErrInvalidPayload }

// Unwrap returns the cause.
func (e *PayloadError) Unwrap() error { return e.Err }
