package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// The key layout, the lock record and what it says of asynq's records are
// the library's (internal/store); this file only presents them.

// notLockKey explains why key is not a lock key of prefix.
func notLockKey(prefix, key string) error {
	if other := store.PrefixOf(key); other != "" && other != prefix {
		if _, _, ok := store.NewKeys(other).ParseLock(key); ok {
			return fmt.Errorf("not a dedup lock key of prefix %q: %q (its prefix is %q: pass --prefix %s)", prefix, key, other, other)
		}
	}
	if q, id, ok := store.NewKeys(prefix).ParseIndex(key); ok {
		return fmt.Errorf("not a dedup lock key: %q is the index key of task %q (use --task %s --queue %s)", key, id, id, q)
	}
	return fmt.Errorf("not a dedup lock key: %q (want %s)", key, store.NewKeys(prefix).Lock("<queue>", "<16 or 32 hex digits>"))
}

// lockInfo is one lock as read from Redis.
type lockInfo struct {
	Key         string            `json:"key"`
	Queue       string            `json:"queue"`
	Fingerprint string            `json:"fingerprint"`
	Type        string            `json:"type"`
	KeyedOn     string            `json:"keyed_on,omitempty"` // how the key was chosen: field names, never values
	Owner       string            `json:"owner"`
	State       string            `json:"state"`      // running, waiting, retry-wait, cooling or orphaned
	TaskState   string            `json:"task_state"` // the owner's state in asynq; "missing" when it is gone
	TTLms       int64             `json:"ttl_ms"`     // -1: no expiry
	TTL         string            `json:"ttl"`
	Coalesced   int64             `json:"coalesced"`
	FollowUp    string            `json:"follow_up,omitempty"`
	Created     int64             `json:"created,omitempty"` // unix seconds
	Node        string            `json:"node,omitempty"`    // cluster master that holds it
	Fields      map[string]string `json:"fields,omitempty"`  // show only: the raw hash

	lock *store.Lock // as read
}

// infoOf presents a lock read by store.ReadLocks.
func infoOf(l *store.Lock) *lockInfo {
	li := &lockInfo{Key: l.Key, Queue: l.Queue, Fingerprint: l.FP, Type: l.Type, Owner: l.Owner, State: l.State(),
		TaskState: l.TaskState, Coalesced: l.Folds, FollowUp: l.Follow, Created: l.Created, Fields: l.Fields, lock: l}
	if l.KeyForm != "" {
		li.KeyedOn = store.DescribeKeyForm(l.KeyForm)
	}
	li.TTLms, li.TTL = -1, "no expiry"
	if l.TTL >= 0 {
		li.TTLms, li.TTL = l.TTL.Milliseconds(), fmtDuration(l.TTL)
	}
	return li
}

// readLocks reads the given keys' locks; keys that are not lock hashes of
// prefix, or have gone meanwhile, are left out.
func readLocks(ctx context.Context, c redis.Cmdable, prefix string, keys []string) ([]*lockInfo, error) {
	ls, err := store.ReadLocks(ctx, c, store.NewKeys(prefix), keys)
	if err != nil {
		return nil, err
	}
	out := make([]*lockInfo, len(ls))
	for i, l := range ls {
		out[i] = infoOf(l)
	}
	return out, nil
}

// scanFilter selects locks.
type scanFilter struct {
	typ   string // task type, "" for all
	queue string // queue, "" for all
}

func (f scanFilter) match(l *lockInfo) bool {
	return (f.typ == "" || l.Type == f.typ) && (f.queue == "" || l.Queue == f.queue)
}

// position is where a listing stopped: a master (index in the sorted list)
// and its SCAN cursor.
type position struct {
	node   int
	cursor uint64
}

// encodeCursor writes a position for --cursor: the SCAN cursor on one
// server, "<master address>/<cursor>" on a cluster.
func encodeCursor(masters []*redis.Client, clustered bool, p position) string {
	if !clustered {
		return strconv.FormatUint(p.cursor, 10)
	}
	return masters[p.node].Options().Addr + "/" + strconv.FormatUint(p.cursor, 10)
}

func decodeCursor(masters []*redis.Client, clustered bool, s string) (position, error) {
	if s == "" {
		return position{}, nil
	}
	addr, num := "", s
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		addr, num = s[:i], s[i+1:]
	}
	cur, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return position{}, usagef("bad --cursor %q: want the value a previous list printed", s)
	}
	if !clustered {
		if addr != "" {
			return position{}, usagef("bad --cursor %q: it names a cluster master, but --cluster is not set", s)
		}
		return position{cursor: cur}, nil
	}
	if addr == "" {
		return position{}, usagef("bad --cursor %q: with --cluster it is <master address>/<cursor>", s)
	}
	for i, m := range masters {
		if m.Options().Addr == addr {
			return position{node: i, cursor: cur}, nil
		}
	}
	return position{}, fmt.Errorf("--cursor %q names master %s, which is not a master now (resharded or failed over?): list again without --cursor", s, addr)
}

// scanner walks the lock keys of every master, one SCAN page at a time.
type scanner struct {
	c       *conn
	masters []*redis.Client
	prefix  string
	filter  scanFilter
	count   int64 // SCAN COUNT
}

func newScanner(ctx context.Context, c *conn, prefix string, f scanFilter, count int64) (*scanner, error) {
	ms, err := c.masters(ctx)
	if err != nil {
		return nil, err
	}
	return &scanner{c: c, masters: ms, prefix: prefix, filter: f, count: count}, nil
}

// page reads one SCAN page at p with COUNT count: the matching locks and the
// position after the page (done when every master has been scanned).
func (s *scanner) page(ctx context.Context, p position, count int64) (locks []*lockInfo, next position, done bool, err error) {
	m := s.masters[p.node]
	keys, cur, err := m.Scan(ctx, p.cursor, store.NewKeys(s.prefix).LockPattern(s.filter.queue), count).Result()
	if err != nil {
		return nil, p, false, fmt.Errorf("SCAN on %s: %w", m.Options().Addr, err)
	}
	// Read through the cluster client when there is one: it follows a slot
	// that moved since the SCAN.
	all, err := readLocks(ctx, s.c.rdb, s.prefix, keys)
	if err != nil {
		return nil, p, false, err
	}
	for _, l := range all {
		if s.filter.match(l) {
			if s.c.cluster != nil {
				l.Node = m.Options().Addr
			}
			locks = append(locks, l)
		}
	}
	next = position{node: p.node, cursor: cur}
	if cur == 0 {
		next = position{node: p.node + 1}
		if next.node == len(s.masters) {
			return locks, next, true, nil
		}
	}
	return locks, next, false, nil
}

// each calls fn for every matching lock on every master.
func (s *scanner) each(ctx context.Context, fn func(*lockInfo)) error {
	var p position
	for {
		locks, next, done, err := s.page(ctx, p, s.count)
		if err != nil {
			return err
		}
		for _, l := range locks {
			fn(l)
		}
		if done {
			return nil
		}
		p = next
	}
}

// collect reads whole SCAN pages from start until limit locks (0: no
// limit). A page that would overflow the limit is left for the next call
// (its cursor is returned), so that resuming never skips a lock; when the
// first page alone overflows it is read again with a smaller COUNT. The
// limit can only be passed by a single hash bucket holding more matching
// keys than it.
func (s *scanner) collect(ctx context.Context, start position, limit int) (locks []*lockInfo, next position, done bool, err error) {
	p := start
	for {
		count := s.count
		if limit > 0 {
			count = min(count, int64(limit-len(locks)))
		}
		for {
			page, after, fin, err := s.page(ctx, p, count)
			if err != nil {
				return nil, p, false, err
			}
			if limit > 0 && len(locks)+len(page) > limit {
				if len(locks) > 0 {
					return locks, p, false, nil // this page comes first next time
				}
				if count > 1 {
					count = max(1, count/2)
					continue
				}
			}
			locks = append(locks, page...)
			if fin {
				return locks, after, true, nil
			}
			p = after
			break
		}
		if limit > 0 && len(locks) >= limit {
			return locks, p, false, nil
		}
	}
}

// sortLocks orders locks by queue, then key.
func sortLocks(ls []*lockInfo) {
	sort.Slice(ls, func(i, j int) bool {
		if ls[i].Queue != ls[j].Queue {
			return ls[i].Queue < ls[j].Queue
		}
		return ls[i].Key < ls[j].Key
	})
}

// fmtDuration prints a TTL the way people read it: 1d02h, 1h05m, 4m09s,
// 12s, 850ms.
func fmtDuration(d time.Duration) string {
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
