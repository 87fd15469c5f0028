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

// The mode record: a hash at ModeOf(lock), kept beside a key whose policy
// needs state the lock's value cannot carry, and written only by those
// policies. It is about one holder (FieldHolder): a record about another
// task than the lock's holder is stale, and read as empty. The scripts use
// the same names.
const (
	FieldHolder   = "id" // the task the record is about
	FieldType     = "ty" // the task type the key was taken for
	FieldKeyForm  = "kf" // how the key was chosen (KeyForm): field names, never values
	FieldCoolEnd  = "cd" // the end of the key's cooldown, unix ms: held till then if the task succeeds (Cooldown, Period)
	FieldWindow   = "pw" // a period key's window, "start:end" in unix ms (Window)
	FieldFailHold = "fh" // what a final failure does (FailHold): "-1" hold until released, else hold this many ms
	FieldRunning  = "rp" // running policy (Running): "a" allow, "d" defer
	FieldFollow   = "f"  // the follow-up task owed to the key (RunningDefer)
	FieldFolds    = "n"  // enqueues folded into the holder (Replace, Merge); Merge's version
	FieldError    = "e"  // the holder's last error, once it failed for good and holds the key
	FieldBounded  = "b"  // the type whose waiting set counts the key (MaxPending)
	FieldOutlived = "o"  // until when (unix ms) a handler of the holder that asynq gave up still runs, as its heartbeat renews it
	FieldNoteBy   = "oa" // the attempt whose handler FieldOutlived is about (its token): only its end clears the note
)

// FailHold encodes a fail hold as the mode record carries it: 0 none
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

// Key forms: how a lock's key was chosen, kept in its mode record
// (FieldKeyForm) so that operators can tell what a lock is about without
// its holder's task; never the key's material.
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

// Running is what an enqueue does when the key is held by a running task;
// the mode record keeps a policy other than reject (FieldRunning).
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
	Value     string // the lock's value (value.go)
	Owner     string // the task holding the key
	Kind      Hold
	Type      string    // the task type: the mode record's, else the holder's asynq record's ("" if unknown)
	KeyForm   string    // how the key was chosen (KeyForm), "" when no mode record says
	Follow    string    // owed follow-up task, "" for none
	Taken     int64     // HoldWrap: when the key was taken, unix seconds; else 0
	Until     time.Time // HoldKept: when the key's cooldown ends
	Folds     int64
	TTL       time.Duration // left before the lock expires, -1: no expiry; a kept key cooling down (Kept): before it frees
	TaskState string        // the holder's state in asynq; "missing" when it has no record (or its ID names another key's task now)
	Fields    map[string]string
}

// Lock states as operators see them.
const (
	LockCooling   = "cooling"    // the holder succeeded; the key stays held until the lock expires (Cooldown, Period, a firing)
	LockFailed    = "failed"     // the holder failed for good; the key stays held until the lock expires or is released (OnFailure)
	LockRunning   = "running"    // asynq's record says the holder runs, or a handler of it that asynq gave up still does
	LockRetryWait = "retry-wait" // asynq waits to retry the holder
	LockOrphaned  = "orphaned"   // the holder is gone, completed or archived: the lock heals at the key's next enqueue
	LockWaiting   = "waiting"    // the holder waits to run
)

// Window is a period key's wall-clock window, [Start, End); zero for a
// key of no period.
type Window struct{ Start, End time.Time }

// Arg encodes the window as mode records keep it (FieldWindow): "start:end"
// in unix milliseconds, "" for none.
func (w Window) Arg() string {
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

// State derives what the lock is doing from its value and its holder's
// asynq state.
func (l *Lock) State() string {
	switch {
	case l.Failed():
		return LockFailed
	case l.Kind == HoldCooling, l.Kept(), l.Kind == HoldFiring && (l.TaskState == "missing" || Gone(l.TaskState)):
		return LockCooling
	case l.TaskState == StateActive, l.outlived():
		return LockRunning
	case l.TaskState == StateRetry:
		return LockRetryWait
	case l.TaskState == "missing" || Gone(l.TaskState):
		return LockOrphaned
	}
	return LockWaiting
}

// outlived reports that the mode record notes a handler of the holder that
// asynq gave up, which still runs (FieldOutlived, renewed by its heartbeat).
func (l *Lock) outlived() bool {
	until, err := strconv.ParseInt(l.Fields[FieldOutlived], 10, 64)
	return err == nil && until > time.Now().UnixMilli()
}

// belongs reports whether the stored task (its record's unique_key and
// message) is the holder the lock's value names, not another key's task
// under a caller-chosen ID used again (as lib.lua's belongs decides).
func (l *Lock) belongs(uniqueKey, msg string) bool {
	switch {
	case KindOf(l.Owner) != IDOther:
		return true // (an ID this library made is never used twice)
	case uniqueKey != "":
		return uniqueKey == l.Key
	case msg == "" || strings.Contains(msg, l.Key):
		return true
	}
	// Taken as it started: a task that arrived without a lock names none; one
	// a worker took in another queue than its call's (relocate.go) names its
	// key's lock there.
	v, named := MessageHeaders([]byte(msg))[HeaderLock]
	_, lock, _, _ := ParseLockHeader(v)
	_, _, fp, _ := ParseLockKey(lock)
	return l.Kind == HoldStart && (!named || fp == l.FP)
}

// Failed reports a fail hold: the holder failed for good (asynq
// archived it; an operator may have deleted it since) and its mode record
// holds its error (OnFailure).
func (l *Lock) Failed() bool {
	s := l.TaskState
	return (s == StateArchived || s == "missing" || s == StateActive) && l.Fields[FieldError] != ""
}

// HeldOnPurpose reports a lock a policy keeps past its task: cooling, a
// firing's, a fail hold.
func (l *Lock) HeldOnPurpose() bool {
	return ParseValue(l.Value).HeldOnPurpose() || l.Kept() || l.Failed()
}

// Kept reports a key kept past its task by asynq's record (HoldKept) that
// cools down now: asynq's record says the task completed, and Until has not
// passed.
func (l *Lock) Kept() bool {
	return l.Kind == HoldKept && l.TaskState == StateCompleted && time.Now().Before(l.Until)
}

// Running is the running policy the mode record keeps (RunReject for none).
func (l *Lock) Running() Running {
	if rp := l.Fields[FieldRunning]; rp != "" {
		return Running(rp[0])
	}
	return RunReject
}

// Bounded reports whether the lock is counted in a type's waiting set.
func (l *Lock) Bounded() bool { return l.Fields[FieldBounded] != "" }

// WaitType is the type whose waiting set counts the lock (Keys.Wait).
func (l *Lock) WaitType() string {
	if t := l.Fields[FieldBounded]; t != "" {
		return t
	}
	return l.Type
}

// ReadLocks reads the locks at keys (of k's prefix) in two pipelined round
// trips: their values, lifetimes and mode records, then their holders'
// asynq records. Keys that are not locks of k, or have gone meanwhile, are
// left out.
func ReadLocks(ctx context.Context, c redis.Cmdable, k Keys, keys []string) ([]*Lock, error) {
	out, err := readValues(ctx, c, k, keys)
	if err != nil || len(out) == 0 {
		return nil, err
	}
	tasks := make([]*redis.SliceCmd, len(out))
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, l := range out {
			tasks[i] = p.HMGet(ctx, TaskKey(l.Queue, l.Owner), "state", "msg", "unique_key")
		}
		return nil
	})
	for i, l := range out {
		v, err := tasks[i].Result()
		if err != nil {
			return nil, fmt.Errorf("read asynq task %s: %w", l.Owner, err)
		}
		s, _ := v[0].(string)
		msg, _ := v[1].(string)
		uk, _ := v[2].(string)
		if s != "" && !l.belongs(uk, msg) {
			s, msg = "", ""
		}
		if s == "" {
			s = "missing"
		}
		if l.Type == "" {
			l.Type = MessageType(msg)
		}
		if l.Type == "" && l.Bounded() {
			l.Type = l.WaitType()
		}
		l.TaskState = s
		if l.Kept() {
			l.TTL = time.Until(l.Until)
		}
	}
	return out, nil
}

// readValues reads the values, lifetimes and mode records at keys in one
// round trip.
func readValues(ctx context.Context, c redis.Cmdable, k Keys, keys []string) ([]*Lock, error) {
	type read struct {
		l    *Lock
		v    *redis.StringCmd
		ttl  *redis.DurationCmd
		mode *redis.MapStringStringCmd
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
			reads[i].v = p.Get(ctx, reads[i].l.Key)
			reads[i].ttl = p.PTTL(ctx, reads[i].l.Key)
			reads[i].mode = p.HGetAll(ctx, ModeOf(reads[i].l.Key))
		}
		return nil
	})
	var out []*Lock
	for _, r := range reads {
		v, err := r.v.Result()
		switch {
		case errors.Is(err, redis.Nil):
			continue // gone since the SCAN
		case err != nil && redis.HasErrorPrefix(err, "WRONGTYPE"):
			continue // not a string: something else whose name looks like a lock key
		case err != nil:
			return nil, fmt.Errorf("read %s: %w", r.l.Key, err)
		}
		ttl, err := r.ttl.Result()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.l.Key, err)
		}
		mode, err := r.mode.Result()
		if err != nil && !redis.HasErrorPrefix(err, "WRONGTYPE") {
			return nil, fmt.Errorf("read %s: %w", ModeOf(r.l.Key), err)
		}
		out = append(out, fillLock(r.l, v, mode, ttl))
	}
	return out, nil
}

func fillLock(l *Lock, v string, mode map[string]string, ttl time.Duration) *Lock {
	p := ParseValue(v)
	l.Value, l.Owner, l.Kind = v, p.Holder, p.Kind
	switch p.Kind {
	case HoldWrap:
		l.Taken = p.At.Unix()
	case HoldKept:
		l.Until = p.At
	}
	if mode[FieldHolder] != l.Owner {
		mode = nil // about another task: stale
	}
	l.Fields = mode
	l.Type = mode[FieldType]
	l.KeyForm = mode[FieldKeyForm]
	l.Follow = mode[FieldFollow]
	l.Folds, _ = strconv.ParseInt(mode[FieldFolds], 10, 64)
	l.TTL = ttl
	if ttl < 0 {
		l.TTL = -1
	}
	return l
}

// LockOf reads the key of the lock the stored task id of queue names as its
// unique key; "" when it names none (or has no record).
func LockOf(ctx context.Context, c redis.Cmdable, queue, id string) (string, error) {
	v, err := c.HGet(ctx, TaskKey(queue, id), "unique_key").Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	return v, err
}

// TaskLockOf finds the lock task id of queue was locked under, from its
// asynq record: the unique key it names, else the lock its HeaderLock
// names, in queue (LockIn). lock is "" when it names none (or has no record); optedOut
// reports a task enqueued without deduplication.
func TaskLockOf(ctx context.Context, c redis.Cmdable, queue, id string) (lock string, optedOut bool, err error) {
	if KindOf(id) == IDOptOut {
		return "", true, nil
	}
	v, err := c.HMGet(ctx, TaskKey(queue, id), "unique_key", "msg").Result()
	if err != nil {
		return "", false, err
	}
	if u, _ := v[0].(string); u != "" {
		return u, false, nil
	}
	msg, _ := v[1].(string)
	h, ok := MessageHeaders([]byte(msg))[HeaderLock]
	if !ok {
		return "", false, nil
	}
	_, lock, optedOut, _ = ParseLockHeader(h)
	return LockIn(lock, queue), optedOut, nil // (a task stored in another queue than its call's holds its key there)
}
