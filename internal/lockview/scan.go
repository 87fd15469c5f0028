package lockview

import (
	"context"
	"fmt"
	"strconv"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// Position is where a listing stopped: a master (index in the sorted list)
// and its SCAN cursor.
type Position struct {
	Node   int
	Cursor uint64
}

// Scanner walks the lock keys of every master, one SCAN page at a time.
type Scanner struct {
	src     Source
	masters []*redis.Client
	prefix  string
	filter  Filter
	count   int64 // SCAN COUNT
}

// NewScanner lists the masters of src and returns a scanner of the locks
// of prefix that pass f, count keys per SCAN page.
func NewScanner(ctx context.Context, src Source, prefix string, f Filter, count int64) (*Scanner, error) {
	ms, err := src.Masters(ctx)
	if err != nil {
		return nil, err
	}
	return &Scanner{src: src, masters: ms, prefix: prefix, filter: f, count: count}, nil
}

// EncodeCursor writes a position for --cursor: the SCAN cursor on one
// server, "<master address>/<cursor>" on a cluster.
func (s *Scanner) EncodeCursor(p Position) string {
	if s.src.Cluster == nil {
		return itoa(p.Cursor)
	}
	return s.masters[p.Node].Options().Addr + "/" + itoa(p.Cursor)
}

// DecodeCursor reads what EncodeCursor wrote; "" is the start.
func (s *Scanner) DecodeCursor(c string) (Position, error) {
	if c == "" {
		return Position{}, nil
	}
	addr, num := splitCursor(c)
	cur, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return Position{}, Usagef("bad --cursor %q: want the value a previous list printed", c)
	}
	if s.src.Cluster == nil {
		if addr != "" {
			return Position{}, Usagef("bad --cursor %q: it names a cluster master, but --cluster is not set", c)
		}
		return Position{Cursor: cur}, nil
	}
	if addr == "" {
		return Position{}, Usagef("bad --cursor %q: with --cluster it is <master address>/<cursor>", c)
	}
	for i, m := range s.masters {
		if m.Options().Addr == addr {
			return Position{Node: i, Cursor: cur}, nil
		}
	}
	return Position{}, fmt.Errorf("--cursor %q names master %s, which is not a master now (resharded or failed over?): list again without --cursor", c, addr)
}

// Page reads one SCAN page at p with COUNT count: the matching locks and the
// position after the page (done when every master has been scanned).
func (s *Scanner) Page(ctx context.Context, p Position, count int64) (locks []*Info, next Position, done bool, err error) {
	m := s.masters[p.Node]
	keys, cur, err := m.Scan(ctx, p.Cursor, store.NewKeys(s.prefix).LockPattern(s.filter.Queue), count).Result()
	if err != nil {
		return nil, p, false, fmt.Errorf("SCAN on %s: %w", m.Options().Addr, err)
	}
	// Read through the cluster client when there is one: it follows a slot
	// that moved since the SCAN.
	all, err := ReadLocks(ctx, s.src.RDB, s.prefix, keys)
	if err != nil {
		return nil, p, false, err
	}
	for _, l := range all {
		if s.filter.Match(l) {
			if s.src.Cluster != nil {
				l.Node = m.Options().Addr
			}
			locks = append(locks, l)
		}
	}
	next = Position{Node: p.Node, Cursor: cur}
	if cur == 0 {
		next = Position{Node: p.Node + 1}
		if next.Node == len(s.masters) {
			return locks, next, true, nil
		}
	}
	return locks, next, false, nil
}

// Each calls fn for every matching lock on every master.
func (s *Scanner) Each(ctx context.Context, fn func(*Info)) error {
	var p Position
	for {
		locks, next, done, err := s.Page(ctx, p, s.count)
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

// Collect reads whole SCAN pages from start until limit locks (0: no
// limit). A page that would overflow the limit is left for the next call
// (its cursor is returned), so that resuming never skips a lock; when the
// first page alone overflows it is read again with a smaller COUNT. The
// limit can only be passed by a single hash bucket holding more matching
// keys than it.
func (s *Scanner) Collect(ctx context.Context, start Position, limit int) (locks []*Info, next Position, done bool, err error) {
	p := start
	for {
		count := s.count
		if limit > 0 {
			count = min(count, int64(limit-len(locks)))
		}
		for {
			page, after, fin, err := s.Page(ctx, p, count)
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

// EachKeys calls fn with each SCAN page of the keys matching pattern on
// every master (not only locks: Doctor scans mode records with it).
func (s *Scanner) EachKeys(ctx context.Context, pattern string, fn func(keys []string) error) error {
	for _, m := range s.masters {
		var cur uint64
		for {
			keys, next, err := m.Scan(ctx, cur, pattern, s.count).Result()
			if err != nil {
				return fmt.Errorf("SCAN on %s: %w", m.Options().Addr, err)
			}
			if len(keys) > 0 {
				if err := fn(keys); err != nil {
					return err
				}
			}
			if cur = next; cur == 0 {
				break
			}
		}
	}
	return nil
}
