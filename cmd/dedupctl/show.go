package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// selector names a lock: by key, or by a task ID (and queue).
type selector struct {
	task  string
	queue string
}

func (s *selector) register(fs *flag.FlagSet, verb string) {
	fs.StringVar(&s.task, "task", "", "find the lock "+verb+" by asynq task `ID` instead of KEY")
	fs.StringVar(&s.queue, "queue", "", "with --task: the task's `queue` (default: search asynq's queues)")
}

// target is a resolved lock key.
type target struct {
	key, queue, fp string
	task           string // the --task that led to it, if any
}

// check refuses a command line that names no lock, or names it twice.
func (s selector) check(args []string) error {
	switch {
	case len(args) == 1 && s.task != "":
		return usagef("give KEY or --task, not both")
	case len(args) == 0 && s.task == "":
		return usagef("missing argument: KEY (or --task ID [--queue Q])")
	case s.queue != "" && s.task == "":
		return usagef("--queue goes with --task; KEY names its queue itself")
	}
	return nil
}

// resolve turns KEY or --task/--queue into a lock key, refusing anything
// that is not one.
func (a *app) resolve(ctx context.Context, c *conn, args []string, s selector) (*target, error) {
	if err := s.check(args); err != nil {
		return nil, err
	}
	keys := store.NewKeys(a.g.prefix)
	if s.task == "" {
		q, fp, ok := keys.ParseLock(args[0])
		if !ok {
			return nil, notLockKey(a.g.prefix, args[0])
		}
		return &target{key: args[0], queue: q, fp: fp}, nil
	}
	queues, err := taskQueues(c, s)
	if err != nil {
		return nil, err
	}
	found, err := findTaskLocks(ctx, c, keys, queues, s.task)
	if err != nil {
		return nil, err
	}
	if len(found) == 0 {
		return nil, noTaskLock(keys, s, queues)
	}
	return pickMine(ctx, c, keys, found, s.task)
}

// taskQueues lists the queues to look for --task in: --queue, or every
// queue asynq knows.
func taskQueues(c *conn, s selector) ([]string, error) {
	if s.queue != "" {
		return []string{s.queue}, nil
	}
	all, err := asynq.NewInspectorFromRedisClient(c.rdb).Queues()
	if err != nil {
		return nil, fmt.Errorf("list asynq queues: %w", err)
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("no lock for task %q: asynq knows no queues (pass --queue)", s.task)
	}
	sort.Strings(all)
	return all, nil
}

// findTaskLocks finds the task's lock in each queue.
func findTaskLocks(ctx context.Context, c *conn, keys store.Keys, queues []string, task string) ([]*target, error) {
	var found []*target
	for _, q := range queues {
		tl, err := store.FindLock(ctx, c.rdb, keys, q, task)
		switch {
		case err != nil:
			return nil, err
		case tl.OptOut:
			return nil, fmt.Errorf("task %q in queue %s was enqueued with deduplication off (dedup.Skip): it has no lock", task, q)
		case tl.Found:
			found = append(found, &target{key: keys.Lock(q, tl.FP), queue: q, fp: tl.FP, task: task})
		}
	}
	return found, nil
}

// noTaskLock explains that no queue has a lock for --task.
func noTaskLock(keys store.Keys, s selector, queues []string) error {
	where := "queue " + s.queue
	if s.queue == "" {
		where = "any queue (" + strings.Join(queues, ", ") + ")"
	}
	if fp, ok := store.ParseLockedID(s.task); ok {
		return fmt.Errorf("no such lock: task %q would hold %s in %s, and there is none", s.task, keys.Lock("<queue>", fp), where)
	}
	return fmt.Errorf("no such lock: no index key %s for task %q in %s (the task was not enqueued through the dedup wrapper with its own ID, or its lock is gone)", keys.Index("<queue>", s.task), s.task, where)
}

// pickMine chooses among the locks found for a task: the same work may be
// locked in several queues, so it keeps the lock the task owns (or is owed
// as follow-up).
func pickMine(ctx context.Context, c *conn, keys store.Keys, found []*target, task string) (*target, error) {
	if len(found) == 1 {
		return found[0], nil
	}
	var mine []*target
	for _, t := range found {
		ls, err := store.ReadLocks(ctx, c.rdb, keys, []string{t.key})
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
		qs = append(qs, t.queue)
	}
	return nil, fmt.Errorf("task %q has a lock in several queues (%s): pass --queue", task, strings.Join(qs, ", "))
}

// readOne reads one lock, or explains why there is none.
func readOne(ctx context.Context, c *conn, prefix string, t *target) (*lockInfo, error) {
	ls, err := readLocks(ctx, c.rdb, prefix, []string{t.key})
	if err != nil {
		return nil, err
	}
	if len(ls) == 1 {
		if c.cluster != nil {
			if m, err := c.cluster.MasterForKey(ctx, t.key); err == nil {
				ls[0].Node = m.Options().Addr
			}
		}
		return ls[0], nil
	}
	typ, err := c.rdb.Type(ctx, t.key).Result()
	if err != nil {
		return nil, err
	}
	if typ != "none" {
		return nil, fmt.Errorf("not a dedup lock: %s is a %s without an owner", t.key, typ)
	}
	return nil, fmt.Errorf("no such lock: %s (released, expired, or never taken)", t.key)
}

// taskInfo is what asynq says about a task.
type taskInfo struct {
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
}

// inspectTask asks asynq's Inspector about a task.
func inspectTask(insp *asynq.Inspector, queue, id string, now time.Time) (*taskInfo, error) {
	ti := &taskInfo{ID: id}
	info, err := insp.GetTaskInfo(queue, id)
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound):
		ti.State = "missing"
		ti.Note = "missing (the lock is orphaned; it heals at the next enqueue)"
		return ti, nil
	case err != nil:
		return nil, fmt.Errorf("asynq inspector, task %s: %w", id, err)
	}
	ti.Exists = true
	ti.State = info.State.String()
	ti.Type = info.Type
	ti.Retried, ti.MaxRetry = info.Retried, info.MaxRetry
	ti.LastError = info.LastErr
	ti.WorkerLost = info.IsOrphaned
	if !info.NextProcessAt.IsZero() {
		t := info.NextProcessAt.UTC()
		ti.NextProcessAt = &t
	}
	retries := fmt.Sprintf("retried %d/%d", info.Retried, info.MaxRetry)
	switch info.State {
	case asynq.TaskStateCompleted, asynq.TaskStateArchived:
		ti.Note = ti.State + " (the lock is orphaned; it heals at the next enqueue)"
	case asynq.TaskStateActive:
		ti.Note = "active (" + retries + ")"
		if info.IsOrphaned {
			ti.Note = "active, but its worker is gone (asynq will retry it; the lock expires within one lease)"
		}
	case asynq.TaskStateScheduled, asynq.TaskStateRetry:
		ti.Note = ti.State + " (" + retries
		switch left := info.NextProcessAt.Sub(now); {
		case info.NextProcessAt.IsZero():
		case left < 0:
			ti.Note += ", due " + fmtDuration(-left) + " ago: runs when a server picks it up"
		default:
			ti.Note += ", runs in " + fmtDuration(left)
		}
		ti.Note += ")"
	default:
		ti.Note = ti.State + " (" + retries + ")"
	}
	if info.LastErr != "" {
		ti.Note += "; last error: " + info.LastErr
	}
	return ti, nil
}

type showOutput struct {
	lockInfo
	OwnerTask      *taskInfo `json:"owner_task"`
	FollowUpTask   *taskInfo `json:"follow_up_task,omitempty"`
	FollowUpKey    string    `json:"follow_up_key,omitempty"` // <prefix>:{q}:f:<fp>, when present
	RunningPolicy  string    `json:"running_policy,omitempty"`
	PayloadVersion string    `json:"payload_version,omitempty"`
	WaitingSet     string    `json:"waiting_set,omitempty"`
	IndexKey       string    `json:"index_key,omitempty"`
	Task           string    `json:"task,omitempty"`      // --task
	TaskRole       string    `json:"task_role,omitempty"` // owner, follow-up or other
}

func showCommand() *command {
	return &command{
		name:     "show",
		synopsis: "KEY | --task ID [--queue Q]",
		summary:  "one lock in full, and whether its owner task still exists in asynq",
		help: `Shows one lock in full: every field, TTL left, and what asynq says about its
owner task (and its owed follow-up). An owner that is missing, completed or
archived means the lock is orphaned: the library heals it at the key's next
enqueue.

KEY is a lock key, ` + lockKeyForm + `, as list prints
it. With --task the lock is found from a task ID: dd-<fingerprint>-<random>
IDs carry the fingerprint, and caller-chosen IDs have an index key.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			s := &selector{}
			s.register(fs, "to show")
			return func(a *app, args []string) error { return runShow(a, args, *s) }
		},
		maxArgs: 1,
	}
}

func runShow(a *app, args []string, s selector) error {
	return a.withLock(args, s, func(ctx context.Context, c *conn, t *target, l *lockInfo) error {
		out, err := describe(ctx, c, a.g.prefix, l, t)
		if err != nil {
			return err
		}
		if a.g.json {
			return writeJSON(a.stdout, out)
		}
		printShow(a.stdout, out, time.Now())
		return nil
	})
}

// describe adds what asynq and the side keys say about a lock.
func describe(ctx context.Context, c *conn, prefix string, l *lockInfo, t *target) (*showOutput, error) {
	insp := asynq.NewInspectorFromRedisClient(c.rdb)
	out := &showOutput{lockInfo: *l, Task: t.task}
	var err error
	if out.OwnerTask, err = inspectTask(insp, l.Queue, l.Owner, time.Now()); err != nil {
		return nil, err
	}
	if l.State == store.LockCooling {
		out.OwnerTask.Note = out.OwnerTask.State + " (it succeeded; the key cools down until the lock expires, Cooldown)"
	}
	if l.FollowUp != "" {
		if out.FollowUpTask, err = inspectTask(insp, l.Queue, l.FollowUp, time.Now()); err != nil {
			return nil, err
		}
	}
	switch rp := l.lock.RunningPolicy(); rp {
	case string(store.RunAllow):
		out.RunningPolicy = "allow (a)"
	case string(store.RunDefer):
		out.RunningPolicy = "defer (d)"
	case "":
	default:
		out.RunningPolicy = rp
	}
	out.PayloadVersion = l.Fields[store.FieldFolds] // the fold count doubles as the merge version
	keys := store.NewKeys(prefix)
	if l.lock.Bounded() {
		out.WaitingSet = keys.Wait(l.Queue, l.lock.WaitType())
	}
	if err := describeSideKeys(ctx, c, keys, l, out); err != nil {
		return nil, err
	}
	switch {
	case t.task == "":
	case t.task == l.Owner:
		out.TaskRole = "owner"
	case t.task == l.FollowUp:
		out.TaskRole = "follow-up"
	default:
		out.TaskRole = "other"
	}
	return out, nil
}

// describeSideKeys adds the owner's index key (when it points to this
// lock) and the key's follow-up pointer, with the follow-up a dead run left
// owed.
func describeSideKeys(ctx context.Context, c *conn, keys store.Keys, l *lockInfo, out *showOutput) error {
	if _, ok := store.ParseLockedID(l.Owner); !ok {
		ik := keys.Index(l.Queue, l.Owner)
		if v, err := c.rdb.Get(ctx, ik).Result(); err == nil && v == l.Fingerprint {
			out.IndexKey = ik
		} else if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
	}
	fk := keys.Follow(l.Queue, l.Fingerprint)
	v, err := c.rdb.Get(ctx, fk).Result()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		return err
	}
	out.FollowUpKey = fk
	if l.FollowUp == "" && v != "" {
		// A follow-up owed by a run that died: the next enqueue adopts it.
		if out.FollowUpTask, err = inspectTask(asynq.NewInspectorFromRedisClient(c.rdb), l.Queue, v, time.Now()); err != nil {
			return err
		}
	}
	return nil
}

func printShow(w io.Writer, o *showOutput, now time.Time) {
	row := func(k, v string) { fmt.Fprintf(w, "%-17s%s\n", k, text(v)) }
	row("key", o.Key)
	row("queue", o.Queue)
	if o.Node != "" {
		row("node", o.Node)
	}
	row("fingerprint", o.Fingerprint)
	row("type", orDash(o.Type))
	row("keyed on", orDash(o.KeyedOn))
	row("state", o.State)
	row("owner", o.Owner)
	row("owner in asynq", o.OwnerTask.Note)
	switch o.TaskRole {
	case "follow-up":
		row("--task", o.Task+" is the owed follow-up, not the owner")
	case "other":
		row("--task", o.Task+" does not hold this lock")
	}
	if o.Created > 0 {
		c := time.Unix(o.Created, 0).UTC()
		row("created", c.Format(time.RFC3339)+" ("+fmtDuration(now.Sub(c))+" ago)")
	}
	row("TTL left", o.TTL)
	row("coalesced", fmt.Sprintf("%d", o.Coalesced))
	if o.FollowUpTask != nil {
		row("follow-up", o.FollowUpTask.ID+": "+o.FollowUpTask.Note)
	}
	if o.FollowUpKey != "" {
		row("follow-up key", o.FollowUpKey)
	}
	if o.RunningPolicy != "" {
		row("running policy", o.RunningPolicy)
	}
	if o.PayloadVersion != "" {
		row("payload version", o.PayloadVersion)
	}
	if o.WaitingSet != "" {
		row("waiting set", o.WaitingSet)
	}
	if o.IndexKey != "" {
		row("index key", o.IndexKey)
	}
	names := make([]string, 0, len(o.Fields))
	for k := range o.Fields {
		names = append(names, k)
	}
	sort.Strings(names)
	var fields []string
	for _, k := range names {
		fields = append(fields, text(k)+"="+text(o.Fields[k]))
	}
	row("fields", strings.Join(fields, " "))
}
