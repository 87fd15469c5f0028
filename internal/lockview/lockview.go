// Package lockview reads, pages through, describes, checks and releases
// the locks of github.com/asynq-dedup/dedup for operators: it is the one
// implementation behind dedupctl and the dedupweb handler. The key layout,
// the lock record and what it says of asynq's records are internal/store's;
// this package only presents them.
package lockview

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// UsageError is input the caller can correct (a bad cursor, a key
// selection that makes no sense): dedupctl exits 2 on it, dedupweb answers
// 400.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

// Usagef returns a *UsageError.
func Usagef(format string, args ...any) error {
	return &UsageError{Msg: fmt.Sprintf(format, args...)}
}

// Source is the Redis the locks are read from: one server, or a cluster.
type Source struct {
	RDB     redis.UniversalClient
	Cluster *redis.ClusterClient // nil for one server
}

// NewSource wraps a client; a *redis.ClusterClient is scanned master by
// master.
func NewSource(rdb redis.UniversalClient) Source {
	c, _ := rdb.(*redis.ClusterClient)
	return Source{RDB: rdb, Cluster: c}
}

// Masters returns the clients to SCAN: the one server, or every master of
// the cluster, sorted by address so that a cursor can name where it stopped.
func (s Source) Masters(ctx context.Context) ([]*redis.Client, error) {
	if s.Cluster == nil {
		c, ok := s.RDB.(*redis.Client)
		if !ok {
			return nil, fmt.Errorf("cannot SCAN through a %T: use a *redis.Client or a *redis.ClusterClient", s.RDB)
		}
		return []*redis.Client{c}, nil
	}
	var (
		mu  sync.Mutex
		out []*redis.Client
	)
	err := s.Cluster.ForEachMaster(ctx, func(_ context.Context, m *redis.Client) error {
		mu.Lock()
		out = append(out, m)
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list cluster masters: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Options().Addr < out[j].Options().Addr })
	return out, nil
}

// NotLockKey explains why key is not a lock key of prefix: a *UsageError,
// as the key is input the caller can correct.
func NotLockKey(prefix, key string) error {
	if other := store.PrefixOf(key); other != "" && other != prefix {
		if _, _, ok := store.NewKeys(other).ParseLock(key); ok {
			return Usagef("not a dedup lock key of prefix %q: %q (its prefix is %q: pass --prefix %s)", prefix, key, other, other)
		}
	}
	if i := strings.LastIndex(key, "}:m:"); i >= 0 {
		if lock := key[:i] + "}:u:" + key[i+len("}:m:"):]; store.ModeOf(lock) == key {
			if _, _, ok := store.NewKeys(prefix).ParseLock(lock); ok {
				return Usagef("not a dedup lock key: %q is the mode record of lock %q (show that key)", key, lock)
			}
		}
	}
	want := store.NewKeys(prefix).Lock("<queue>", "<16 or 32 hex digits>")
	if fault := lockKeyFault(prefix, key); fault != "" {
		return Usagef("not a dedup lock key: %q: %s (want %s)", key, fault, want)
	}
	return Usagef("not a dedup lock key: %q (want %s)", key, want)
}

// lockKeyFault says what part of key is not as in a lock key of prefix
// (<prefix>:{<queue>}:u:<fingerprint>); "" when it finds none.
func lockKeyFault(prefix, key string) string {
	head, mark := prefix+":{", "}:u:"
	if !strings.HasPrefix(key, head) {
		return fmt.Sprintf("it does not begin with %q", head)
	}
	i := strings.LastIndex(key, mark)
	switch {
	case i < len(head):
		return fmt.Sprintf("it has no %q before its fingerprint", mark)
	case i == len(head):
		return "its queue is empty"
	}
	fp := key[i+len(mark):]
	switch {
	case len(fp) != 16 && len(fp) != 32:
		return fmt.Sprintf("its fingerprint %q has %d characters, not 16 or 32", fp, len(fp))
	case !store.IsFingerprint(fp):
		return fmt.Sprintf("its fingerprint %q is not lower-case hex", fp)
	}
	return ""
}

// Info is one lock as read from Redis.
type Info struct {
	Key         string            `json:"key"`
	Queue       string            `json:"queue"`
	Fingerprint string            `json:"fingerprint"`
	Type        string            `json:"type"`               // the mode record's, else the holder's asynq record's; "" when neither says
	KeyedOn     string            `json:"keyed_on,omitempty"` // how the key was chosen: field names, never values
	Holder      string            `json:"holder"`
	Hold        string            `json:"hold,omitempty"` // the lock's value, when it holds the key past its task ("~c:…" cooling, "~x:…" a firing's)
	State       string            `json:"state"`          // waiting, running, retry-wait, cooling, failed or orphaned
	TaskState   string            `json:"task_state"`     // the holder's state in asynq; "missing" when it is gone
	TTLms       int64             `json:"ttl_ms"`         // -1: no expiry
	TTL         string            `json:"ttl"`
	Folds       int64             `json:"folds"`
	FollowUp    string            `json:"follow_up,omitempty"`
	Created     int64             `json:"created,omitempty"` // unix seconds, for a lock taken before its task was stored
	Node        string            `json:"node,omitempty"`    // cluster master that holds it
	Fields      map[string]string `json:"fields,omitempty"`  // show only: the mode record, for a key whose policy keeps one

	lock *store.Lock // as read
}

// Raw is the lock as store.ReadLocks read it.
func (i *Info) Raw() *store.Lock { return i.lock }

// InfoOf presents a lock read by store.ReadLocks.
func InfoOf(l *store.Lock) *Info {
	li := &Info{Key: l.Key, Queue: l.Queue, Fingerprint: l.FP, Type: l.Type, Holder: l.Owner, State: l.State(),
		TaskState: l.TaskState, Folds: l.Folds, FollowUp: l.Follow, Created: l.Taken, Fields: l.Fields, lock: l}
	if store.ParseValue(l.Value).HeldOnPurpose() || l.Kept() {
		li.Hold = l.Value
	}
	if l.KeyForm != "" {
		li.KeyedOn = store.DescribeKeyForm(l.KeyForm)
	}
	li.TTLms, li.TTL = -1, "no expiry"
	if l.TTL >= 0 {
		li.TTLms, li.TTL = l.TTL.Milliseconds(), FmtDuration(l.TTL)
	}
	return li
}

// ReadLocks reads the given keys' locks; keys that are not locks of
// prefix, or have gone meanwhile, are left out.
func ReadLocks(ctx context.Context, c redis.Cmdable, prefix string, keys []string) ([]*Info, error) {
	ls, err := store.ReadLocks(ctx, c, store.NewKeys(prefix), keys)
	if err != nil {
		return nil, err
	}
	out := make([]*Info, len(ls))
	for i, l := range ls {
		out[i] = InfoOf(l)
	}
	return out, nil
}

// Filter selects locks.
type Filter struct {
	Type  string // task type, "" for all
	Queue string // queue, "" for all
	State string // lock state, "" for all
}

// Match reports whether l passes the filter.
func (f Filter) Match(l *Info) bool {
	return (f.Type == "" || l.Type == f.Type) && (f.Queue == "" || l.Queue == f.Queue) && (f.State == "" || l.State == f.State)
}

// SortLocks orders locks by queue, then key.
func SortLocks(ls []*Info) {
	sort.Slice(ls, func(i, j int) bool {
		if ls[i].Queue != ls[j].Queue {
			return ls[i].Queue < ls[j].Queue
		}
		return ls[i].Key < ls[j].Key
	})
}

// FmtDuration prints a TTL the way people read it: 1d02h, 1h05m, 4m09s,
// 12s, 850ms.
func FmtDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "-"
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d/time.Minute), int(d%time.Minute/time.Second))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d/time.Hour), int(d%time.Hour/time.Minute))
	}
	return fmt.Sprintf("%dd%02dh", int(d/(24*time.Hour)), int(d%(24*time.Hour)/time.Hour))
}

// itoa is strconv.FormatUint for cursors.
func itoa(n uint64) string { return strconv.FormatUint(n, 10) }

// splitCursor splits "<addr>/<n>" (or "<n>").
func splitCursor(s string) (addr, num string) {
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		return s[:i], s[i+1:]
	}
	return "", s
}
