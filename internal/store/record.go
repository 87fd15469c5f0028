package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/redis/go-redis/v9"
)

// The lock record: a hash at Keys.Lock with these fields. The Lua scripts
// use the same names.
const (
	FieldOwner    = "id"  // owner task ID, packed (PackOwner)
	FieldCreated  = "c"   // when the owner took the lock, unix seconds (heal grace)
	FieldToken    = "tok" // the running attempt's token; present while an attempt runs
	FieldRunning  = "rp"  // running policy: "a" allow, "d" defer; absent: reject
	FieldBounded  = "b"   // counted in the waiting set (Keys.Wait) of this type ("1" in locks of the earlier layout)
	FieldFolds    = "n"   // enqueues folded into the key; Merge's version
	FieldFollow   = "f"   // the follow-up task owed to the key (RunningDefer), whole ID
	FieldStored   = "v"   // written with its owner's asynq record (no enqueue gap): heals without the grace
	FieldCoolEnd  = "cd"  // the end of the key's cooldown, unix milliseconds: kept till then if the task succeeds
	FieldCooling  = "k"   // the owner succeeded and the key cools down until the lock expires
	FieldType     = "ty"  // the task type the key was taken for
	FieldKeyForm  = "kf"  // how the key was chosen (KeyForm): field names, never values
	FieldFailHold = "fh"  // what a final failure of the owner does (FailHold): absent release, "-1" hold until released, else hold this many ms
	FieldError    = "e"   // a lock held after its owner failed for good (FieldCooling "f"): the owner's last error
	FieldWindow   = "pw"  // a period key's window, "start:end" in unix milliseconds (Window)
	FieldCoolAll  = "ca"  // "1": the cooldown follows any end of the task but a final failure, a revoke too (Scheduler firings)
)

// CoolingFailed is FieldCooling's value in a lock held after its owner
// failed for good (OnFailure); any other value is a cooldown after success.
const CoolingFailed = "f"

// FailHold encodes a failure hold as locks and scripts carry it: 0 none
// (""), negative until released by hand ("-1"), else integer milliseconds.
func FailHold(d time.Duration) string {
	switch {
	case d == 0:
		return ""
	case d < 0:
		return "-1"
	}
	return strconv.FormatInt(ms(d), 10)
}

// Key forms: how a lock's key was chosen, kept in its record
// (FieldKeyForm) so that operators can tell what a lock is about without
// its owner's task; never the key's material.
const (
	KeyFormPayload    = "p"   // the whole raw payload
	KeyFormKey        = "k"   // an explicit key, namespaced by type
	KeyFormShared     = "s"   // an explicit key shared across types
	KeyFormFunc       = "fn"  // a key function's result, namespaced by type
	KeyFormSharedFunc = "sfn" // a key function's result, shared across types
	keyFormFields     = "f:"  // followed by the selected paths, NUL-separated (a path may hold a comma)
)

// KeyFormFields is the key form of a selection of JSON fields.
func KeyFormFields(paths []string) string { return keyFormFields + strings.Join(paths, "\x00") }

// DescribeKeyForm says what a key form means, for people.
func DescribeKeyForm(kf string) string {
	if paths, ok := strings.CutPrefix(kf, keyFormFields); ok {
		ps := strings.Split(paths, "\x00")
		for i, p := range ps {
			if strings.ContainsAny(p, ", \"") || strings.IndexFunc(p, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 {
				ps[i] = strconv.Quote(p) // one path, however it reads
			}
		}
		return "fields " + strings.Join(ps, ", ")
	}
	switch kf {
	case KeyFormPayload:
		return "whole payload"
	case KeyFormKey:
		return "key (explicit)"
	case KeyFormShared:
		return "shared key"
	case KeyFormFunc:
		return "key function"
	case KeyFormSharedFunc:
		return "key function, shared key"
	}
	return "-"
}

// Running is what acquire does when the key is held by a running task; a
// lock records it (FieldRunning), so the server needs no configuration.
type Running byte

// Running policies, as the record and the scripts spell them.
const (
	RunReject Running = 'x' // name the holder (not recorded: the default)
	RunAllow  Running = 'a' // the lock is dropped when its task starts
	RunDefer  Running = 'd' // fold into one follow-up task, queued when the run ends
)

// Lock is one lock as read from Redis, for operators (dedupctl).
type Lock struct {
	Key       string
	Queue     string
	FP        string
	Owner     string // task ID
	Type      string // the task type the key was taken for, from the lock or its owner's asynq record ("" if unknown)
	KeyForm   string // how the key was chosen (KeyForm), "" in locks of the earlier layout
	Follow    string // owed follow-up task, "" for none
	Created   int64  // unix seconds
	Folds     int64
	TTL       time.Duration // -1: no expiry
	TaskState string        // the owner's state in asynq; "missing" when it has no record
	Fields    map[string]string
}

// Lock states as operators see them.
const (
	LockCooling   = "cooling"    // the owner succeeded; the key stays held until the lock expires (Cooldown, Period)
	LockFailed    = "failed"     // the owner failed for good; the key stays held until the lock expires or is released (OnFailure)
	LockRunning   = "running"    // the owner runs: an attempt holds the lock, or asynq's record says active
	LockRetryWait = "retry-wait" // asynq waits to retry the owner
	LockOrphaned  = "orphaned"   // the owner is gone, completed or archived: the lock heals at the key's next enqueue
	LockWaiting   = "waiting"    // the owner waits to run
)

// Window is a period key's wall-clock window, [Start, End); zero for a
// key of no period.
type Window struct{ Start, End time.Time }

// arg encodes the window as locks keep it (FieldWindow): "start:end" in
// unix milliseconds, "" for none.
func (w Window) arg() string {
	if w.Start.IsZero() {
		return ""
	}
	return strconv.FormatInt(w.Start.UnixMilli(), 10) + ":" + strconv.FormatInt(w.End.UnixMilli(), 10)
}

// Window returns a period key's window from its record; zero for a lock
// of no period.
func (l *Lock) Window() Window {
	if l == nil {
		return Window{}
	}
	a, b, ok := strings.Cut(l.Fields[FieldWindow], ":")
	s, err1 := strconv.ParseInt(a, 10, 64)
	e, err2 := strconv.ParseInt(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return Window{}
	}
	return Window{Start: time.UnixMilli(s), End: time.UnixMilli(e)}
}

// State derives what the lock is doing from its record and its owner's
// asynq state.
func (l *Lock) State() string {
	switch {
	case l.Fields[FieldCooling] == CoolingFailed,
		l.TaskState == StateArchived && l.Fields[FieldToken] == "" && l.Fields[FieldFailHold] != "" && l.Fields[FieldError] != "":
		return LockFailed // (the second: the next call that meets it marks it)
	case l.Fields[FieldCooling] != "":
		return LockCooling
	case l.Fields[FieldToken] != "" || l.TaskState == StateActive:
		return LockRunning // (asynq dequeued it: its start may not have run yet)
	case l.TaskState == StateRetry:
		return LockRetryWait
	case l.TaskState == "missing" || Gone(l.TaskState):
		return LockOrphaned
	}
	return LockWaiting
}

// RunningPolicy is the record's running policy code ("" for reject).
func (l *Lock) RunningPolicy() string { return l.Fields[FieldRunning] }

// Bounded reports whether the lock is counted in its type's waiting set.
func (l *Lock) Bounded() bool { return l.Fields[FieldBounded] != "" }

// WaitType is the type whose waiting set counts the lock (Keys.Wait).
func (l *Lock) WaitType() string {
	if t := l.Fields[FieldBounded]; t != "" && t != "1" {
		return t
	}
	return l.Type
}

// OwnerStored is the owner as the record stores it, for owner-checked
// release.
func (l *Lock) OwnerStored() string { return l.Fields[FieldOwner] }

// ReadLocks reads the locks at keys in two pipelined round trips (the
// records and their TTLs, then their owners' asynq records). Keys that are
// not lock hashes of k, or have gone meanwhile, are left out.
func ReadLocks(ctx context.Context, c redis.Cmdable, k Keys, keys []string) ([]*Lock, error) {
	out, err := readRecords(ctx, c, k, keys)
	if err != nil || len(out) == 0 {
		return nil, err
	}
	tasks := make([]*redis.SliceCmd, len(out))
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, l := range out {
			tasks[i] = p.HMGet(ctx, TaskKey(l.Queue, l.Owner), "state", "msg")
		}
		return nil
	})
	for i, l := range out {
		v, err := tasks[i].Result()
		if err != nil {
			return nil, fmt.Errorf("read asynq task %s: %w", l.Owner, err)
		}
		s, _ := v[0].(string)
		if s == "" {
			s = "missing"
		}
		if msg, _ := v[1].(string); l.Type == "" {
			l.Type = MessageType(msg)
		}
		if l.Type == "" && l.Bounded() {
			l.Type = l.WaitType() // the owner is gone; a counted lock still names its type
		}
		l.TaskState = s
	}
	return out, nil
}

// readRecords reads the lock hashes and TTLs at keys in one round trip.
func readRecords(ctx context.Context, c redis.Cmdable, k Keys, keys []string) ([]*Lock, error) {
	type read struct {
		l   *Lock
		h   *redis.MapStringStringCmd
		ttl *redis.DurationCmd
	}
	var reads []read
	for _, key := range keys {
		if q, fp, ok := k.ParseLock(key); ok {
			reads = append(reads, read{l: &Lock{Key: key, Queue: q, FP: fp}})
		}
	}
	if len(reads) == 0 {
		return nil, nil
	}
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range reads {
			reads[i].h = p.HGetAll(ctx, reads[i].l.Key)
			reads[i].ttl = p.PTTL(ctx, reads[i].l.Key)
		}
		return nil
	})
	var out []*Lock
	for _, r := range reads {
		h, err := r.h.Result()
		if err != nil && strings.HasPrefix(err.Error(), "WRONGTYPE") {
			continue // a string or set whose name looks like a lock key
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.l.Key, err)
		}
		ttl, err := r.ttl.Result()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.l.Key, err)
		}
		if len(h) == 0 || h[FieldOwner] == "" || ttl == -2 {
			continue // gone since the SCAN, or not a lock
		}
		out = append(out, fillLock(r.l, h, ttl))
	}
	return out, nil
}

func fillLock(l *Lock, h map[string]string, ttl time.Duration) *Lock {
	l.Fields = h
	l.Owner = UnpackOwner(h[FieldOwner], l.FP)
	l.Type = h[FieldType]
	l.KeyForm = h[FieldKeyForm]
	l.Follow = h[FieldFollow]
	l.Folds, _ = strconv.ParseInt(h[FieldFolds], 10, 64)
	l.Created, _ = strconv.ParseInt(h[FieldCreated], 10, 64)
	l.TTL = ttl
	if ttl < 0 {
		l.TTL = -1
	}
	return l
}

// TaskLock is where a task's lock is, as found from the task's ID.
type TaskLock struct {
	FP     string // the lock's fingerprint
	Found  bool   // the lock (wrapper-chosen ID) or the index key (caller-chosen ID) exists
	OptOut bool   // the caller-chosen ID was enqueued without deduplication
}

// FindLock finds the lock of task id in queue: an ID the wrapper chose
// carries the fingerprint (found when that lock exists); a caller-chosen ID
// has an index key.
func FindLock(ctx context.Context, c redis.Cmdable, k Keys, queue, id string) (TaskLock, error) {
	if fp, ok := ParseLockedID(id); ok {
		n, err := c.Exists(ctx, k.Lock(queue, fp)).Result()
		return TaskLock{FP: fp, Found: n == 1}, err
	}
	v, err := c.Get(ctx, k.Index(queue, id)).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return TaskLock{}, nil
	case err != nil:
		return TaskLock{}, err
	case v == OptOutMark:
		return TaskLock{Found: true, OptOut: true}, nil
	case !IsFingerprint(v):
		return TaskLock{}, fmt.Errorf("index key %s holds %q, not a fingerprint", k.Index(queue, id), v)
	}
	return TaskLock{FP: v, Found: true}, nil
}
