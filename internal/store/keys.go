package store

import (
	"context"
	_ "embed"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Keys builds the key names of one deployment (one key prefix). Every key
// of a queue carries the queue's hash tag "{<queue>}" exactly as asynq's
// own keys do, so a lock lives in the Redis Cluster slot of its queue, next
// to asynq's records of that queue, and one script can use both:
//
//	<prefix>:{<queue>}:u:<fingerprint>  the lock: a string naming its holder (value.go); the
//	                                    holder's asynq record names it as its unique key
//	<prefix>:{<queue>}:m:<fingerprint>  the key's mode record, a hash (record.go), for keys
//	                                    whose policy keeps state beside the lock
//	<prefix>:{<queue>}:w:<task type>    waiting keys of a type (MaxPending), a sorted set of fingerprints
//	<prefix>:owed                       pub/sub channel (no key, no hash tag): the ID of a running holder
//	                                    an enqueue just made a follow-up of (RunningDefer)
//	<prefix>:stats:types                set of the task types with flushed counters (no hash tag)
//	<prefix>:stats:type:<task type>     one type's flushed counters, a hash of event name → total
//	<prefix>:stats:min:<minute>:<type>  what one type's flushes added in one minute (unix minutes), a hash of event name → count, kept MinuteStatsTTL
//
// The prefix may not contain braces (Config validates it), so the hash tag
// is always the queue's.
type Keys struct{ prefix string }

// NewKeys returns the key names under prefix.
func NewKeys(prefix string) Keys { return Keys{prefix: prefix} }

// Prefix is the key prefix.
func (k Keys) Prefix() string { return k.prefix }

// (Each key is one concatenation: one allocation.)

// Lock is the lock of fingerprint fp in queue.
func (k Keys) Lock(queue, fp string) string { return k.prefix + ":{" + queue + "}:u:" + fp }

// Wait is the set of a type's keys waiting in queue (MaxPending).
func (k Keys) Wait(queue, typ string) string { return k.prefix + ":{" + queue + "}:w:" + typ }

// lockMark and modeMark are what separate a lock key's, and a mode
// record's, queue from its fingerprint.
const (
	lockMark = "}:u:"
	modeMark = "}:m:"
)

// ModeOf is the mode record of the lock at lock (whatever its prefix).
func ModeOf(lock string) string {
	i := strings.LastIndex(lock, lockMark)
	if i < 0 {
		return lock + ":m"
	}
	return lock[:i] + modeMark + lock[i+len(lockMark):]
}

// LockOfMode is the lock whose mode record is at mode (whatever its
// prefix); "" for a key that is not a mode record's.
func LockOfMode(mode string) string {
	i := strings.LastIndex(mode, modeMark)
	if i < 0 {
		return ""
	}
	lock := mode[:i] + lockMark + mode[i+len(modeMark):]
	if _, _, _, ok := ParseLockKey(lock); !ok || ModeOf(lock) != mode {
		return ""
	}
	return lock
}

// WaitOf is the waiting set of typ beside the lock at lock.
func WaitOf(lock, typ string) string {
	prefix, queue, _, _ := ParseLockKey(lock)
	return NewKeys(prefix).Wait(queue, typ)
}

// Owed is the pub/sub channel on which acquire.lua names a running holder it
// made a follow-up of, so that the worker running it settles its end.
func (k Keys) Owed() string { return k.prefix + ":owed" }

// OwedOf is the Owed channel of the prefix of the lock at lock.
func OwedOf(lock string) string {
	prefix, _, _, _ := ParseLockKey(lock)
	return NewKeys(prefix).Owed()
}

// StatsTypes is the set of the task types that have flushed counters.
func (k Keys) StatsTypes() string { return k.prefix + ":stats:types" }

// Stats is the hash of one task type's flushed counters.
func (k Keys) Stats(typ string) string { return k.prefix + ":stats:type:" + typ }

// MinuteStatsTTL is how long a per-minute counter hash (StatsMinute) is
// kept after its last flush.
const MinuteStatsTTL = 2 * time.Hour

//go:embed lua/minute.lua
var minuteSrc string

// AddMinuteStats queues on p the adding of deltas (event name, count
// pairs) to the minute's counter hash key, with its lifetime
// (lua/minute.lua); nothing for no deltas. These counts are best effort:
// a flush whose totals fail is sent again, and counted again here if this
// part went through.
func AddMinuteStats(ctx context.Context, p redis.Pipeliner, key string, deltas []any) {
	if len(deltas) == 0 {
		return
	}
	p.Eval(ctx, minuteSrc, []string{key}, append([]any{MinuteStatsTTL.Milliseconds()}, deltas...)...)
}

// StatsMinute is the hash of what one type's flushes added during one
// minute, minute being unix seconds / 60.
func (k Keys) StatsMinute(typ string, minute int64) string {
	return k.prefix + ":stats:min:" + strconv.FormatInt(minute, 10) + ":" + typ
}

// LockPattern is the SCAN MATCH pattern of the lock keys of queue, or of
// every queue for "".
func (k Keys) LockPattern(queue string) string {
	q := "*"
	if queue != "" {
		q = globEscape(queue)
	}
	return globEscape(k.prefix) + ":{" + q + lockMark + "*"
}

// ModePattern is the SCAN MATCH pattern of the mode records of queue, or of
// every queue for "".
func (k Keys) ModePattern(queue string) string {
	q := "*"
	if queue != "" {
		q = globEscape(queue)
	}
	return globEscape(k.prefix) + ":{" + q + modeMark + "*"
}

// ParseLock splits a lock key of this prefix into its queue and
// fingerprint.
func (k Keys) ParseLock(key string) (queue, fp string, ok bool) {
	prefix, queue, fp, ok := ParseLockKey(key)
	if !ok || prefix != k.prefix {
		return "", "", false
	}
	return queue, fp, true
}

// ParseLockKey splits a lock key of any prefix. The fingerprint is read
// from the end and the prefix up to the first ":{", so queue names holding
// braces or the lock mark still parse.
func ParseLockKey(key string) (prefix, queue, fp string, ok bool) {
	i := strings.Index(key, ":{")
	if i < 1 {
		return "", "", "", false
	}
	for _, n := range []int{16, 32} {
		end := len(key) - n - len(lockMark)
		if end <= i+2 || key[end:end+len(lockMark)] != lockMark || !IsFingerprint(key[end+len(lockMark):]) {
			continue
		}
		return key[:i], key[i+2 : end], key[end+len(lockMark):], true
	}
	return "", "", "", false
}

// LockIn is the lock of the key of the lock at lock in queue: the same
// prefix and fingerprint. A task an enqueuer stored in another queue than
// its call's lock (relocate.go) holds its key there; lock is returned
// unchanged when it is in queue, or not of this layout.
func LockIn(lock, queue string) string {
	prefix, q, fp, ok := ParseLockKey(lock)
	if !ok || q == queue {
		return lock
	}
	return NewKeys(prefix).Lock(queue, fp)
}

// PrefixOf guesses the prefix of what looks like a key of this layout (the
// part before ":{"), or "".
func PrefixOf(key string) string {
	if i := strings.IndexByte(key, '{'); i > 1 && key[i-1] == ':' {
		return key[:i-1]
	}
	return ""
}

// globEscape quotes the characters special to Redis's MATCH patterns.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch r {
		case '*', '?', '[', ']', '\\', '^':
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// asynq v0.26.0's keys (its internal/base), in the queue's slot.

// TaskKey is asynq's hash of one task: fields "msg" (the TaskMessage
// protobuf, see asynq.go), "state", "pending_since", "unique_key" ...
func TaskKey(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// PendingKey is asynq's list of a queue's pending task IDs.
func PendingKey(queue string) string { return "asynq:{" + queue + "}:pending" }

// ScheduledKey is asynq's sorted set of a queue's scheduled task IDs, by
// due time in unix seconds.
func ScheduledKey(queue string) string { return "asynq:{" + queue + "}:scheduled" }

// RetryKey is asynq's sorted set of the tasks of queue waiting for a retry.
func RetryKey(queue string) string { return "asynq:{" + queue + "}:retry" }

// ActiveKey is asynq's list of the tasks of queue being processed.
func ActiveKey(queue string) string { return "asynq:{" + queue + "}:active" }

// LeaseKey is asynq's sorted set of the active tasks of queue, by the unix
// second their worker's lease on them ends (its recoverer retries a task
// whose lease ended more than 30 s ago).
func LeaseKey(queue string) string { return "asynq:{" + queue + "}:lease" }

// ProcessedKey is asynq's count of the queue's tasks it completed
// (processed_total, incremented whether the task is kept or deleted).
func ProcessedKey(queue string) string { return "asynq:{" + queue + "}:processed" }

// QueuesKey is asynq's set of queue names.
const QueuesKey = "asynq:queues"

// Ref names one lock and the task that holds or wants it.
type Ref struct {
	Queue string
	FP    string // fingerprint, hex
	ID    string // task ID
	Type  string // task type
	Lock  string // the lock's key (another prefix's, for a task whose producer used one)
}

// Mode is the key of r's mode record.
func (r *Ref) Mode() string { return ModeOf(r.Lock) }
