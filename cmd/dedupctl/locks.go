package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"google.golang.org/protobuf/encoding/protowire"
)

// The dedup key layout (fingerprint.go in the library):
//
//	<prefix>:{<queue>}:l:<16 or 32 hex digits>   lock, a hash
//	<prefix>:{<queue>}:i:<task ID>               index of a caller-chosen task ID → fingerprint
//	<prefix>:{<queue>}:w:<task type>             waiting keys (MaxPending), a sorted set
//	<prefix>:{<queue>}:f:<fingerprint>           owed follow-up task ID (RunningDefer)
//
// Lock fields: id (owner task, packed: see unpackOwner), c (created, unix s),
// tok (running attempt's token: present = running), rp (running policy), b
// (counted in w:), n (enqueues folded in, also the merge version), f (owed
// follow-up). Locks written by older versions also hold ty (the type); the
// type is otherwise read from the owner's asynq task message.
//
// asynq v0.26.0 keeps a task in the hash asynq:{<queue>}:t:<id>, field
// "state" (the library reads it the same way to heal orphaned locks, and
// pins the layout with a test).

func lockKey(prefix, queue, fp string) string  { return prefix + ":{" + queue + "}:l:" + fp }
func indexKey(prefix, queue, id string) string { return prefix + ":{" + queue + "}:i:" + id }
func waitKey(prefix, queue, typ string) string { return prefix + ":{" + queue + "}:w:" + typ }
func followKey(prefix, queue, fp string) string {
	return prefix + ":{" + queue + "}:f:" + fp
}
func asynqTaskKey(queue, id string) string { return "asynq:{" + queue + "}:t:" + id }

// optOutMark is the value of an index key whose task was enqueued with
// dedup.Skip (client.go).
const optOutMark = "-"

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// parseLockKey splits a lock key of prefix into queue and fingerprint. The
// fingerprint is read from the end, so queue names holding braces or
// ":l:" still parse.
func parseLockKey(prefix, key string) (queue, fp string, ok bool) {
	head := prefix + ":{"
	if !strings.HasPrefix(key, head) {
		return "", "", false
	}
	for _, n := range []int{16, 32} {
		end := len(key) - n - len("}:l:")
		if end <= len(head) || key[end:end+4] != "}:l:" || !isHex(key[end+4:]) {
			continue
		}
		return key[len(head):end], key[end+4:], true
	}
	return "", "", false
}

// notLockKey explains why key is not a lock key of prefix.
func notLockKey(prefix, key string) error {
	if i := strings.IndexByte(key, '{'); i > 1 && key[i-1] == ':' {
		if other := key[:i-1]; other != prefix {
			if _, _, ok := parseLockKey(other, key); ok {
				return fmt.Errorf("not a dedup lock key of prefix %q: %q (its prefix is %q: pass --prefix %s)", prefix, key, other, other)
			}
		}
	}
	head := prefix + ":{"
	if strings.HasPrefix(key, head) {
		if q, id, ok := strings.Cut(key[len(head):], "}:i:"); ok && q != "" && id != "" {
			return fmt.Errorf("not a dedup lock key: %q is the index key of task %q (use --task %s --queue %s)", key, id, id, q)
		}
	}
	return fmt.Errorf("not a dedup lock key: %q (want %s:{<queue>}:l:<16 or 32 hex digits>)", key, prefix)
}

// unpackOwner returns the task ID a lock of fingerprint fp stores as s: the
// library keeps the 20 random hex digits of an ID it chose for the key
// (dd-<fp>-<20 hex>), other IDs whole, or "=" + ID where that is ambiguous
// (packLockID in fingerprint.go).
func unpackOwner(s, fp string) string {
	if rest, ok := strings.CutPrefix(s, "="); ok {
		return rest
	}
	if len(s) == 20 && isHex(s) && strings.ToLower(s) == s {
		return "dd-" + fp + "-" + s
	}
	return s
}

// msgType returns the task type (field 1) of an asynq v0.26.0 TaskMessage,
// or "" if msg is not one.
func msgType(msg string) string {
	b := []byte(msg)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return ""
			}
			return string(v)
		}
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return ""
		}
		b = b[m:]
	}
	return ""
}

// parseLockedID returns the fingerprint in a wrapper-chosen task ID,
// dd-<16 or 32 hex>-<20 hex> (fingerprint.go).
func parseLockedID(id string) (fp string, ok bool) {
	const pre, rnd = "dd-", 20
	n := len(id) - len(pre) - 1 - rnd
	if (n != 16 && n != 32) || !strings.HasPrefix(id, pre) || id[len(pre)+n] != '-' {
		return "", false
	}
	fp = id[len(pre) : len(pre)+n]
	if !isHex(fp) || !isHex(id[len(pre)+n+1:]) {
		return "", false
	}
	return fp, true
}

// lockInfo is one lock as read from Redis.
type lockInfo struct {
	Key         string            `json:"key"`
	Queue       string            `json:"queue"`
	Fingerprint string            `json:"fingerprint"`
	Type        string            `json:"type"`
	Owner       string            `json:"owner"`
	State       string            `json:"state"`      // running, waiting, retry-wait or orphaned
	TaskState   string            `json:"task_state"` // the owner's state in asynq; "missing" when it is gone
	TTLms       int64             `json:"ttl_ms"`     // -1: no expiry
	TTL         string            `json:"ttl"`
	Coalesced   int64             `json:"coalesced"`
	FollowUp    string            `json:"follow_up,omitempty"`
	Created     int64             `json:"created,omitempty"` // unix seconds
	Node        string            `json:"node,omitempty"`    // cluster master that holds it
	Fields      map[string]string `json:"fields,omitempty"`  // show only: the raw hash
}

// lockState derives the state shown for a lock: running while an attempt
// holds its token, retry-wait while asynq waits to retry the owner,
// orphaned when the owner is gone, completed or archived (the library heals
// such a lock at the key's next enqueue), waiting otherwise.
func lockState(fields map[string]string, taskState string) string {
	switch {
	case fields["tok"] != "":
		return "running"
	case taskState == "retry":
		return "retry-wait"
	case taskState == "missing" || taskState == "completed" || taskState == "archived":
		return "orphaned"
	}
	return "waiting"
}

// readLocks reads the given keys' locks in two pipelined round trips
// (HGETALL and PTTL, then the owners' asynq state). Keys that are not lock
// hashes of prefix, or have gone meanwhile, are left out.
func readLocks(ctx context.Context, c redis.Cmdable, prefix string, keys []string) ([]*lockInfo, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	type read struct {
		key, queue, fp string
		h              *redis.MapStringStringCmd
		ttl            *redis.DurationCmd
	}
	reads := make([]read, 0, len(keys))
	for _, k := range keys {
		if q, fp, ok := parseLockKey(prefix, k); ok {
			reads = append(reads, read{key: k, queue: q, fp: fp})
		}
	}
	if len(reads) == 0 {
		return nil, nil
	}
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range reads {
			reads[i].h = p.HGetAll(ctx, reads[i].key)
			reads[i].ttl = p.PTTL(ctx, reads[i].key)
		}
		return nil
	})
	var out []*lockInfo
	for _, r := range reads {
		h, err := r.h.Result()
		if isWrongType(err) {
			continue // a string or set whose name looks like a lock key
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.key, err)
		}
		ttl, err := r.ttl.Result()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", r.key, err)
		}
		if len(h) == 0 || h["id"] == "" || ttl == -2 {
			continue // gone since the SCAN, or not a lock
		}
		l := &lockInfo{Key: r.key, Queue: r.queue, Fingerprint: r.fp, Type: h["ty"], Owner: unpackOwner(h["id"], r.fp), FollowUp: h["f"], Fields: h}
		l.Coalesced, _ = strconv.ParseInt(h["n"], 10, 64)
		l.Created, _ = strconv.ParseInt(h["c"], 10, 64)
		if ttl < 0 {
			l.TTLms, l.TTL = -1, "no expiry"
		} else {
			l.TTLms, l.TTL = ttl.Milliseconds(), fmtDuration(ttl)
		}
		out = append(out, l)
	}
	tasks := make([]*redis.SliceCmd, len(out))
	_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, l := range out {
			tasks[i] = p.HMGet(ctx, asynqTaskKey(l.Queue, l.Owner), "state", "msg")
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
			l.Type = msgType(msg)
		}
		l.TaskState = s
		l.State = lockState(l.Fields, s)
	}
	return out, nil
}

func isWrongType(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "WRONGTYPE")
}

// scanFilter selects locks.
type scanFilter struct {
	typ   string // task type, "" for all
	queue string // queue, "" for all
}

func (f scanFilter) match(l *lockInfo) bool {
	return (f.typ == "" || l.Type == f.typ) && (f.queue == "" || l.Queue == f.queue)
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

func matchPattern(prefix string, f scanFilter) string {
	q := "*"
	if f.queue != "" {
		q = globEscape(f.queue)
	}
	return globEscape(prefix) + ":{" + q + "}:l:*"
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
	keys, cur, err := m.Scan(ctx, p.cursor, matchPattern(s.prefix, s.filter), count).Result()
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
