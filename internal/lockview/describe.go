package lockview

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/asynqconn"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Target is a resolved lock key.
type Target struct {
	Key, Queue, FP string
	Task           string // the task ID that led to it, if any
}

// ByKey checks that key is a lock key of prefix.
func ByKey(prefix, key string) (*Target, error) {
	q, fp, ok := store.NewKeys(prefix).ParseLock(key)
	if !ok {
		return nil, NotLockKey(prefix, key)
	}
	return &Target{Key: key, Queue: q, FP: fp}, nil
}

// ByTask finds the lock of task ID task in queue, or in every queue asynq
// knows when queue is "".
func ByTask(ctx context.Context, src Source, prefix, task, queue string) (*Target, error) {
	keys := store.NewKeys(prefix)
	queues, err := taskQueues(ctx, src, task, queue)
	if err != nil {
		return nil, err
	}
	found, err := findTaskLocks(ctx, src, keys, queues, task)
	if err != nil {
		return nil, err
	}
	if len(found) == 0 {
		return nil, noTaskLock(keys, task, queue, queues)
	}
	return pickMine(ctx, src, keys, found, task)
}

// taskQueues lists the queues to look for a task in: queue, or every
// queue asynq knows.
func taskQueues(ctx context.Context, src Source, task, queue string) ([]string, error) {
	if queue != "" {
		return []string{queue}, nil
	}
	all, err := AsynqQueues(ctx, src)
	if err != nil {
		return nil, err
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("no lock for task %q: asynq knows no queues (pass --queue)", task)
	}
	return all, nil
}

// AsynqQueues lists the queues asynq knows, sorted.
func AsynqQueues(ctx context.Context, src Source) ([]string, error) {
	all, err := bounded(ctx, asynqconn.Inspector(src.RDB).Queues)
	if err != nil {
		return nil, fmt.Errorf("list asynq queues: %w", err)
	}
	sort.Strings(all)
	return all, nil
}

// findTaskLocks finds the task's lock in each queue.
func findTaskLocks(ctx context.Context, src Source, keys store.Keys, queues []string, task string) ([]*Target, error) {
	var found []*Target
	for _, q := range queues {
		lock, optedOut, err := store.TaskLockOf(ctx, src.RDB, q, task)
		if err == nil && lock == "" {
			lock, err = markedLock(ctx, src, keys, q, task)
		}
		switch {
		case err != nil:
			return nil, err
		case optedOut:
			return nil, fmt.Errorf("task %q in queue %s was enqueued with deduplication off (dedup.Skip): it has no lock", task, q)
		case lock == "":
			continue
		}
		if lq, fp, ok := keys.ParseLock(lock); ok && lq == q {
			found = append(found, &Target{Key: lock, Queue: q, FP: fp, Task: task})
		}
	}
	return found, nil
}

// markedLock is the lock a task stored in queue q names in its ID (an
// asynq without task headers: store.NewMarkedID), or "".
func markedLock(ctx context.Context, src Source, keys store.Keys, q, task string) (string, error) {
	_, fp, ok := store.ParseMarkedID(task)
	if !ok {
		return "", nil
	}
	n, err := src.RDB.Exists(ctx, store.TaskKey(q, task)).Result()
	if err != nil || n == 0 {
		return "", err
	}
	return keys.Lock(q, fp), nil
}

// noTaskLock explains that no queue has a lock for the task.
func noTaskLock(keys store.Keys, task, queue string, queues []string) error {
	where := "queue " + queue
	if queue == "" {
		where = "any queue (" + strings.Join(queues, ", ") + ")"
	}
	return fmt.Errorf("no such lock: task %q in %s names no lock of prefix %q (it was not enqueued through a dedup Client, or its record is gone; find its lock by key instead)", task, where, keys.Prefix())
}

// pickMine chooses among the locks found for a task: the same work may be
// locked in several queues, so it keeps the lock the task owns (or is owed
// as follow-up).
func pickMine(ctx context.Context, src Source, keys store.Keys, found []*Target, task string) (*Target, error) {
	if len(found) == 1 {
		return found[0], nil
	}
	var mine []*Target
	for _, t := range found {
		ls, err := store.ReadLocks(ctx, src.RDB, keys, []string{t.Key})
		if err != nil {
			return nil, err
		}
		if len(ls) == 1 && (ls[0].Owner == task || ls[0].Follow == task) {
			mine = append(mine, t)
		}
	}
	if len(mine) == 1 {
		return mine[0], nil
	}
	var qs []string
	for _, t := range found {
		qs = append(qs, t.Queue)
	}
	return nil, fmt.Errorf("task %q has a lock in several queues (%s): pass --queue", task, strings.Join(qs, ", "))
}

// ErrNoLock is wrapped by ReadOne's error when the key holds no lock.
var ErrNoLock = errors.New("no such lock")

// ReadOne reads one lock, or explains why there is none.
func ReadOne(ctx context.Context, src Source, prefix string, t *Target) (*Info, error) {
	ls, err := ReadLocks(ctx, src.RDB, prefix, []string{t.Key})
	if err != nil {
		return nil, err
	}
	if len(ls) == 1 {
		if src.Cluster != nil {
			if m, err := src.Cluster.MasterForKey(ctx, t.Key); err == nil {
				ls[0].Node = m.Options().Addr
			}
		}
		return ls[0], nil
	}
	typ, err := src.RDB.Type(ctx, t.Key).Result()
	if err != nil {
		return nil, err
	}
	if typ != "none" {
		return nil, fmt.Errorf("not a dedup lock: %s is a %s without a holder", t.Key, typ)
	}
	return nil, fmt.Errorf("%w: %s (released, expired, or never taken)", ErrNoLock, t.Key)
}

// TaskInfo is what asynq says about a task.
type TaskInfo struct {
	ID            string     `json:"id"`
	Exists        bool       `json:"exists"`
	State         string     `json:"state"` // asynq's state, or "missing"
	Type          string     `json:"type,omitempty"`
	Retried       int        `json:"retried"`
	MaxRetry      int        `json:"max_retry"`
	LastError     string     `json:"last_error,omitempty"`
	NextProcessAt *time.Time `json:"next_process_at,omitempty"`
	WorkerLost    bool       `json:"worker_lost,omitempty"` // active, but no worker renews it
	Note          string     `json:"note"`

	Payload []byte `json:"-"` // the task's payload, for a caller that may show it
}

// bounded runs f, a call of asynq's Inspector (which takes no context),
// and returns at ctx's end if f has not: f goes on in the background until
// the client's own timeouts end it.
func bounded[T any](ctx context.Context, f func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := f()
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}

// InspectTask asks asynq's Inspector about a task, until ctx ends.
func InspectTask(ctx context.Context, insp *asynq.Inspector, queue, id string, now time.Time) (*TaskInfo, error) {
	ti := &TaskInfo{ID: id}
	info, err := bounded(ctx, func() (*asynq.TaskInfo, error) { return insp.GetTaskInfo(queue, id) })
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound):
		ti.State = "missing"
		ti.Note = "missing (the lock is orphaned; it heals at the next enqueue)"
		return ti, nil
	case err != nil:
		return nil, fmt.Errorf("asynq inspector, task %s: %w", id, err)
	}
	ti.Exists, ti.State, ti.Type, ti.Payload = true, info.State.String(), info.Type, info.Payload
	ti.Retried, ti.MaxRetry = info.Retried, info.MaxRetry
	ti.LastError = info.LastErr
	ti.WorkerLost = info.IsOrphaned
	if !info.NextProcessAt.IsZero() {
		t := info.NextProcessAt.UTC()
		ti.NextProcessAt = &t
	}
	ti.Note = taskNote(info, now)
	return ti, nil
}

// taskNote says in words where a task stands.
func taskNote(info *asynq.TaskInfo, now time.Time) string {
	state := info.State.String()
	retries := fmt.Sprintf("retried %d/%d", info.Retried, info.MaxRetry)
	var note string
	switch info.State {
	case asynq.TaskStateCompleted, asynq.TaskStateArchived:
		note = state + " (the lock is orphaned; it heals at the next enqueue)"
	case asynq.TaskStateActive:
		note = "active (" + retries + ")"
		if info.IsOrphaned {
			note = "active, but its worker is gone (asynq's recoverer makes it a retry, which keeps the key)"
		}
	case asynq.TaskStateScheduled, asynq.TaskStateRetry:
		note = state + " (" + retries
		switch left := info.NextProcessAt.Sub(now); {
		case info.NextProcessAt.IsZero():
		case left < 0:
			note += ", due " + FmtDuration(-left) + " ago: runs when a server picks it up"
		default:
			note += ", runs in " + FmtDuration(left)
		}
		note += ")"
	default:
		note = state + " (" + retries + ")"
	}
	if info.LastErr != "" {
		note += "; last error: " + info.LastErr
	}
	return note
}

// Detail is one lock in full: what asynq and its mode record say about it.
type Detail struct {
	Info
	HolderTask     *TaskInfo `json:"holder_task"`
	FollowUpTask   *TaskInfo `json:"follow_up_task,omitempty"`
	ModeKey        string    `json:"mode_key,omitempty"` // <prefix>:{q}:m:<fp>, when the key has a mode record
	RunningPolicy  string    `json:"running_policy,omitempty"`
	PayloadVersion string    `json:"payload_version,omitempty"`
	WaitingSet     string    `json:"waiting_set,omitempty"`
	OnFailure      string    `json:"on_failure,omitempty"` // the failure policy recorded (OnFailure), "" for release
	LastError      string    `json:"last_error,omitempty"` // a lock held after its holder failed for good: the holder's last error
	Window         string    `json:"window,omitempty"`     // a period key's window, "start – end" (RFC 3339, UTC)
	Task           string    `json:"task,omitempty"`       // the task ID the lock was found by
	TaskRole       string    `json:"task_role,omitempty"`  // holder, follow-up or other
}

// Describe adds what asynq and the mode record say about a lock.
func Describe(ctx context.Context, src Source, prefix string, l *Info, t *Target) (*Detail, error) {
	insp := asynqconn.Inspector(src.RDB)
	out := &Detail{Info: *l, Task: t.Task}
	var err error
	if out.HolderTask, err = InspectTask(ctx, insp, l.Queue, l.Holder, time.Now()); err != nil {
		return nil, err
	}
	if note := holdNote(l); note != "" {
		out.HolderTask.Note = out.HolderTask.State + " (" + note + ")"
	}
	describePolicies(l, out)
	if l.FollowUp != "" {
		if out.FollowUpTask, err = InspectTask(ctx, insp, l.Queue, l.FollowUp, time.Now()); err != nil {
			return nil, err
		}
	}
	out.RunningPolicy = runningPolicy(l.lock.Running())
	out.PayloadVersion = l.Fields[store.FieldFolds] // the fold count doubles as the merge version
	if l.lock.Bounded() {
		out.WaitingSet = store.NewKeys(prefix).Wait(l.Queue, l.lock.WaitType())
	}
	if l.Fields != nil {
		out.ModeKey = store.ModeOf(l.Key)
	}
	switch {
	case t.Task == "":
	case t.Task == l.Holder:
		out.TaskRole = "holder"
	case t.Task == l.FollowUp:
		out.TaskRole = "follow-up"
	default:
		out.TaskRole = "other"
	}
	return out, nil
}

// holdNote says why a lock whose holder is done, or not stored yet, still
// holds its key; "" when asynq's state of the holder says all.
func holdNote(l *Info) string {
	switch {
	case l.lock.Kind == store.HoldFiring && l.State == store.LockCooling:
		return "a Scheduler firing's key: held until its window ends"
	case l.lock.Kind == store.HoldKept && l.State == store.LockCooling:
		return "it succeeded, as asynq's record of it says; the key cools down until its Cooldown ends"
	case l.State == store.LockCooling:
		return "it succeeded; the key cools down until the lock expires, Cooldown or Period"
	case l.State == store.LockFailed:
		return "it failed for good; the key is held, OnFailure"
	case l.lock.Kind == store.HoldWrap && l.TaskState == "missing":
		return "or not stored yet: the lock was taken before its task, which its producer stores next; it heals once older than the heal grace"
	}
	return ""
}

// CooldownLeft says how long the key's cooldown has left at now, or "over";
// "" for a key without one. A key cools down until then if its task
// succeeds (Cooldown, Period).
func CooldownLeft(l *Info, now time.Time) string {
	ms, err := strconv.ParseInt(l.Fields[store.FieldCoolEnd], 10, 64)
	if err != nil {
		return ""
	}
	if left := time.UnixMilli(ms).Sub(now); left > 0 {
		return FmtDuration(left)
	}
	return "over"
}

// runningPolicy says a running policy in words; "" for the default
// (reject: a duplicate enqueued while the holder runs is refused).
func runningPolicy(rp store.Running) string {
	switch rp {
	case store.RunAllow:
		return "allow: the key frees when its task starts, so a duplicate enqueued while it runs is a new task"
	case store.RunDefer:
		return "defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends"
	}
	return ""
}

// describePolicies adds the lock's failure policy, the last error of an
// holder that failed for good and a period key's window.
func describePolicies(l *Info, out *Detail) {
	switch fh := l.Fields[store.FieldFailHold]; fh {
	case "":
	case "-1":
		out.OnFailure = "hold until released"
	default:
		if n, err := strconv.ParseInt(fh, 10, 64); err == nil {
			out.OnFailure = "hold " + FmtDuration(time.Duration(n)*time.Millisecond)
		}
	}
	out.LastError = l.Fields[store.FieldError]
	if w := l.lock.Window(); !w.Start.IsZero() {
		out.Window = w.Start.UTC().Format(time.RFC3339) + " – " + w.End.UTC().Format(time.RFC3339)
	}
}

// LockQueues returns the queues that hold locks of prefix, by a SCAN of
// their key names (every master of a cluster), sorted: a queue asynq no
// longer lists (removed with its locks' holders) may still hold one, a
// fail hold or a cooldown.
func LockQueues(ctx context.Context, src Source, prefix string) ([]string, error) {
	masters, err := src.Masters(ctx)
	if err != nil {
		return nil, err
	}
	keys := store.NewKeys(prefix)
	seen := map[string]bool{}
	for _, m := range masters {
		iter := m.Scan(ctx, 0, keys.LockPattern(""), 1000).Iterator()
		for iter.Next(ctx) {
			if q, _, ok := keys.ParseLock(iter.Val()); ok {
				seen[q] = true
			}
		}
		if err := iter.Err(); err != nil {
			return nil, fmt.Errorf("scan the lock keys: %w", err)
		}
	}
	out := make([]string, 0, len(seen))
	for q := range seen {
		out = append(out, q)
	}
	sort.Strings(out)
	return out, nil
}
