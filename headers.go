package dedup

import (
	"maps"

	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
)

// Headers adds h to the headers of the task this call creates (asynq
// v0.26.0 task headers, Task.Headers), on top of the task's own
// (asynq.NewTaskWithHeaders): a name in both takes h's value; several
// Headers options in one call are merged, the last winning. The task's
// asynq.NewTask options are kept. It is how a wrapper such as package
// dedupotel adds a trace context to a task without rebuilding it.
//
// Headers belong to the task a call creates: on the NewClient direct path,
// through WrapClient's Enqueuer, and for a call that is not deduplicated.
// A call folded into another task (Replaced, Merged, Deferred) leaves that
// task's headers as they are, and Result.NotApplied names "dedup.Headers(…)".
// Headers does not opt a call in under Config.OptIn. Default: no headers
// added. A nil or empty h adds none. With an asynq before v0.26.0, which has
// no task headers, no call applies it, and Result.NotApplied names it.
func Headers(h map[string]string) asynq.Option {
	return option{desc: headersDesc, headers: maps.Clone(h), apply: func(*resolved) error { return nil }}
}

// headersDesc names the Headers option in Result.NotApplied.
const headersDesc = "dedup.Headers(…)"

// addHeaders records the headers of a Headers option on the call.
func (k *call) addHeaders(h map[string]string) {
	if len(h) == 0 {
		return
	}
	if k.headers == nil {
		k.headers = make(map[string]string, len(h))
	}
	maps.Copy(k.headers, h)
}

// applyHeaders makes the task again with the call's headers (dedup.Headers,
// and the lock header prepare adds) and without the ones this package
// writes that it carried (a task a handler enqueues again); a task that
// needs neither stays as it is.
func (k *call) applyHeaders() error {
	if !hasHeaders() {
		return k.headerless()
	}
	own := taskHeaders(k.task)
	_, lock := own[store.HeaderLock]
	_, lost := own[store.HeaderLost]
	if k.headers == nil && !lock && !lost {
		return nil
	}
	opts, ok := taskOpts(k.task)
	if !ok {
		return errorf("%w: this asynq version's task options cannot be read, so the task cannot be made again with its headers", ErrInvalidOption)
	}
	h := make(map[string]string, len(own)+len(k.headers))
	maps.Copy(h, own)
	delete(h, store.HeaderLock)
	delete(h, store.HeaderLost)
	maps.Copy(h, k.headers)
	k.task = newTask(k.typ, k.task.Payload(), h, opts...)
	return nil
}

// headerless stands in for applyHeaders where asynq has no task headers
// (before v0.26.0; compat.go): a task under an ID of this package's carries
// its mark in the ID (markID), and one under a caller-chosen ID cannot
// carry it, so the call is refused before anything is written. The call's
// dedup.Headers are not applied (Result.NotApplied names them).
func (k *call) headerless() error {
	v, marked := k.headers[store.HeaderLock]
	if !marked || k.callerID == "" {
		return nil
	}
	what := "its lock"
	if v == store.OptedOut {
		what = "dedup.Skip's mark (which keeps a server's execution guard off it)"
	}
	return errorf("%w: task ID %q: the linked asynq has no task headers (they came in v0.26.0), so a task under a caller-chosen ID cannot carry %s; leave the ID to this package, or use asynq v0.26.0", ErrInvalidOption, k.callerID, what)
}

// headersDropped reports whether the call's dedup.Headers were dropped for
// want of task headers in the linked asynq.
func (k *call) headersDropped() bool { return k.userHeaders && !hasHeaders() }
