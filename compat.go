package dedup

import (
	"errors"
	"maps"
	"reflect"
	"runtime/debug"
	"strings"
	"sync"
	"unsafe"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// What differs between the asynq versions this package builds against
// (v0.24.1 to v0.26.0; docs/versions.md). One source builds against each,
// so nothing here names an identifier that one of them lacks: what a
// version has is found at run time.
//
//	task headers (Task.Headers, NewTaskWithHeaders, TaskInfo.Headers)   v0.26.0
//	RevokeTask (linked by name), NewClientFromRedisClient (asynqconn)   v0.25.0
//	the task layout the direct path writes (store.AsynqVersion)          v0.26.0 only
//
// Without task headers the lock's mark travels in the task's ID
// (store.NewMarkedID), and a caller-chosen ID cannot carry it.

// headerTask is asynq.Task's method set from v0.26.0 on.
type headerTask interface{ Headers() map[string]string }

// hasHeaders reports whether the linked asynq has task headers.
var hasHeaders = sync.OnceValue(func() bool {
	_, ok := any((*asynq.Task)(nil)).(headerTask)
	_, field := taskHeadersOffset()
	return ok && field
})

// taskHeaders returns a task's headers (nil where asynq has none).
func taskHeaders(t *asynq.Task) map[string]string {
	if h, ok := any(t).(headerTask); ok {
		return h.Headers()
	}
	return nil
}

// newTask makes a task as asynq.NewTaskWithHeaders does, where asynq has
// task headers; elsewhere h is dropped (callers check hasHeaders first).
func newTask(typ string, payload []byte, h map[string]string, opts ...asynq.Option) *asynq.Task {
	t := asynq.NewTask(typ, payload, opts...)
	if off, ok := taskHeadersOffset(); ok && len(h) > 0 {
		*(*map[string]string)(unsafe.Add(unsafe.Pointer(t), off)) = maps.Clone(h)
	}
	return t
}

// taskHeadersOffset is where asynq.Task keeps its headers field.
var taskHeadersOffset = sync.OnceValues(func() (uintptr, bool) {
	return fieldOffset[asynq.Task]("headers", reflect.TypeFor[map[string]string]())
})

// setInfoHeaders sets TaskInfo.Headers where asynq has that field.
func setInfoHeaders(ti *asynq.TaskInfo, h map[string]string) {
	if off, ok := infoHeadersOffset(); ok {
		*(*map[string]string)(unsafe.Add(unsafe.Pointer(ti), off)) = h
	}
}

// infoHeadersOffset is where asynq.TaskInfo keeps its Headers field.
var infoHeadersOffset = sync.OnceValues(func() (uintptr, bool) {
	return fieldOffset[asynq.TaskInfo]("Headers", reflect.TypeFor[map[string]string]())
})

// taskOpts reads asynq.Task's unexported opts (options given to NewTask),
// which asynq offers no way to see. ok is false if the field is not there
// (a changed asynq): then the direct path is never taken.
func taskOpts(t *asynq.Task) (opts []asynq.Option, ok bool) {
	off, ok := taskOptsOffset()
	if !ok {
		return nil, false
	}
	return *(*[]asynq.Option)(unsafe.Add(unsafe.Pointer(t), off)), true
}

// taskOptsOffset is where asynq.Task keeps its opts field, looked up once
// (every enqueue reads it, some more than once).
var taskOptsOffset = sync.OnceValues(func() (uintptr, bool) {
	return fieldOffset[asynq.Task]("opts", reflect.TypeFor[[]asynq.Option]())
})

// fieldOffset is the offset of S's field name of type typ; ok is false
// where the field is not there, or of another type.
func fieldOffset[S any](name string, typ reflect.Type) (uintptr, bool) {
	f, ok := reflect.TypeFor[S]().FieldByName(name)
	if !ok || f.Type != typ {
		return 0, false
	}
	return f.Offset, true
}

// revokeTask is asynq.RevokeTask where the linked asynq has it (v0.25.0
// on), and nil where it has not: this source cannot name it, so it is
// linked by its symbol's name, which on v0.24.1 defines a variable nothing
// sets.
//
//go:linkname revokeTask github.com/hibiken/asynq.RevokeTask
var revokeTask error

// isRevoke reports whether a handler's error is asynq.RevokeTask, or wraps
// it, as asynq's processor decides (before v0.25.0 there is none).
func isRevoke(err error) bool { return revokeTask != nil && errors.Is(err, revokeTask) }

// hasRevoke reports whether the linked asynq has RevokeTask.
func hasRevoke() bool { return revokeTask != nil }

// knownLayout reports whether asynq version v stores tasks as the direct
// path writes them.
func knownLayout(v string) bool { return strings.TrimPrefix(v, "v") == store.AsynqVersion }

// linkedAsynq returns the version of asynq in the binary's build
// information (a replacement's, if replaced); ok is false when the binary
// carries none.
func linkedAsynq() (v string, ok bool) {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "", false
	}
	for _, m := range info.Deps {
		if m.Path == "github.com/hibiken/asynq" {
			if m.Replace != nil {
				m = m.Replace
			}
			return m.Version, m.Version != ""
		}
	}
	return "", false
}
