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
//	<prefix>:{<queue>}:l:<fingerprint>  lock (a hash, see record.go)
//	<prefix>:{<queue>}:i:<task ID>      index: fingerprint of a caller-chosen task ID's lock, or OptOutMark
//	<prefix>:{<queue>}:w:<task type>    waiting keys of a type (MaxPending), a sorted set of fingerprints
//	<prefix>:{<queue>}:f:<fingerprint>  follow-up task owed to the key (RunningDefer)
//	<prefix>:{<queue>}:s:<task ID>      superseded: the follow-up carrying a newer payload than this task (Replace with RunningDefer)
//	<prefix>:stats:types                set of the task types with flushed counters (no hash tag)
//	<prefix>:stats:type:<task type>     one type's flushed counters, a hash of event name → total
//	<prefix>:stats:min:<minute>:<type>  what one type's flushes added in one minute (unix minutes), a hash of event name → count, kept MinuteStatsTTL
//	dedup:{<queue>}:prefixes            set of the prefixes whose locks are in the queue (PrefixesKey)
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
func (k Keys) Lock(queue, fp string) string { return k.prefix + ":{" + queue + "}:l:" + fp }

// Index is the index key of a caller-chosen task ID.
func (k Keys) Index(queue, id string) string { return k.prefix + ":{" + queue + "}:i:" + id }

// Wait is the set of a type's keys waiting in queue (MaxPending).
func (k Keys) Wait(queue, typ string) string { return k.prefix + ":{" + queue + "}:w:" + typ }

// Follow is the pointer to the follow-up task owed to a key (RunningDefer).
func (k Keys) Follow(queue, fp string) string { return k.prefix + ":{" + queue + "}:f:" + fp }

// Superseded marks a task whose follow-up carries a newer payload (Replace
// with RunningDefer): if the task starts again after losing its lock (its
// worker died), the follow-up has run or will, and it must not.
func (k Keys) Superseded(queue, id string) string { return k.prefix + ":{" + queue + "}:s:" + id }

// PrefixesKey is the set of the key prefixes of the Stores that lock
// tasks of queue (whatever their own prefix, it starts with "dedup"): a
// server whose prefix is not its producers' finds their locks through it.
func PrefixesKey(queue string) string { return "dedup:{" + queue + "}:prefixes" }

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
	return globEscape(k.prefix) + ":{" + q + "}:l:*"
}

// ParseLock splits a lock key into its queue and fingerprint. The
// fingerprint is read from the end, so queue names holding braces or ":l:"
// still parse.
func (k Keys) ParseLock(key string) (queue, fp string, ok bool) {
	head := k.prefix + ":{"
	if !strings.HasPrefix(key, head) {
		return "", "", false
	}
	for _, n := range []int{16, 32} {
		end := len(key) - n - len("}:l:")
		if end <= len(head) || key[end:end+4] != "}:l:" || !IsFingerprint(key[end+4:]) {
			continue
		}
		return key[len(head):end], key[end+4:], true
	}
	return "", "", false
}

// ParseIndex splits an index key into its queue and task ID.
func (k Keys) ParseIndex(key string) (queue, id string, ok bool) {
	rest, ok := strings.CutPrefix(key, k.prefix+":{")
	if !ok {
		return "", "", false
	}
	queue, id, ok = strings.Cut(rest, "}:i:")
	return queue, id, ok && queue != "" && id != ""
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
// protobuf, see asynq.go), "state", "pending_since", ...
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

// ProcessedKey is asynq's count of the queue's tasks it completed
// (processed_total, incremented whether the task is kept or deleted).
func ProcessedKey(queue string) string { return "asynq:{" + queue + "}:processed" }

// QueuesKey is asynq's set of queue names.
const QueuesKey = "asynq:queues"

// Ref names one lock and the task that owns or wants it.
type Ref struct {
	Queue   string
	FP      string // fingerprint, hex
	ID      string // task ID
	Type    string // task type
	Indexed bool   // the ID is caller-chosen: an index key leads to the lock
}

// LockOf is the key of r's lock.
func (k Keys) LockOf(r *Ref) string { return k.Lock(r.Queue, r.FP) }

// stored is r's task ID as its lock record stores it.
func (r *Ref) stored() string { return PackOwner(r.ID, r.FP) }

// direct reports whether r is a task the wrapper locked at enqueue under
// an ID of its own (NewLockedID for r's key): the lock begin and done
// settle in the common case.
func (r *Ref) direct() bool {
	fp, ok := ParseLockedID(r.ID)
	return ok && fp == r.FP && !r.Indexed
}
