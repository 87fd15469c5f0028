package dedup

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// A producer and a server should share one Config.Prefix. When they do
// not, the server's middleware would not find the locks the producer took
// (it looks under its own prefix), and would lock and release keys of its
// own beside them. So every Client registers its Dedup's prefix for each
// queue it locks tasks of (store.PrefixesKey: the acquire script adds it
// at the Store's first call on the queue, before the lock exists), and the
// middleware, when it finds no lock under its own prefix for a task the
// wrapper locked at enqueue (or no index for a caller-chosen ID), looks
// under the queue's other prefixes: a lock there of the task's key (its
// own, or one it waits behind) is the one it follows, through a Store of
// that prefix, and the mismatch is logged (once per prefix). Where a queue's tasks are locked
// under one prefix this costs nothing past a cached read of its registry.

// otherPrefixesEvery bounds how often a queue's registry is read again.
const otherPrefixesEvery = 30 * time.Second

// foreignPrefixes caches the queues' registries and holds a Store per
// other prefix.
type foreignPrefixes struct {
	mu     sync.Mutex
	others map[string]prefixList // queue → its other prefixes
	stores map[string]*store.Store
	warned map[string]bool
}

type prefixList struct {
	list []string
	read time.Time
}

// otherPrefixes returns the prefixes registered for queue but the
// Dedup's, read at most every otherPrefixesEvery.
func (d *Dedup) otherPrefixes(ctx context.Context, queue string) []string {
	p := &d.foreign
	p.mu.Lock()
	defer p.mu.Unlock()
	if l, ok := p.others[queue]; ok && time.Since(l.read) < otherPrefixesEvery {
		return l.list
	}
	list, err := d.store.OtherPrefixes(ctx, queue)
	if err != nil {
		return p.others[queue].list // tried again at the next task
	}
	if p.others == nil {
		p.others = map[string]prefixList{}
	}
	p.others[queue] = prefixList{list: list, read: time.Now()}
	return list
}

// foreignStore returns the Store of the prefix under which the key of r
// has its lock (or, for a caller-chosen ID, its index), when that is not
// the Dedup's own; nil when there is none. For a caller-chosen ID it sets
// r.FP from that index; optOut reports an index there that marks the ID
// enqueued without deduplication (the task runs unlocked).
func (d *Dedup) foreignStore(ctx context.Context, r *store.Ref) (st *store.Store, optOut bool) {
	others := d.otherPrefixes(ctx, r.Queue)
	if len(others) == 0 {
		return nil, false
	}
	prefix, fp, optOut, err := d.store.ForeignLock(ctx, r, others)
	if err != nil || prefix == "" {
		return nil, false
	}
	if optOut {
		return nil, true
	}
	r.FP = fp
	return d.storeFor(prefix, r), false
}

// storeFor returns the Store of another prefix, made once, and warns once
// per prefix that the server's differs from its producers'.
func (d *Dedup) storeFor(prefix string, r *store.Ref) *store.Store {
	p := &d.foreign
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.warned[prefix] {
		if p.warned == nil {
			p.warned = map[string]bool{}
		}
		p.warned[prefix] = true
		d.log.Error("dedup: this server's Config.Prefix differs from the producer's; following the producer's locks, but give both the same Prefix",
			slog.String("server_prefix", d.cfg.Prefix), slog.String("producer_prefix", prefix), slog.String("type", r.Type), slog.String("task_id", r.ID))
	}
	if st, ok := p.stores[prefix]; ok {
		return st
	}
	if p.stores == nil {
		p.stores = map[string]*store.Store{}
	}
	cfg := d.storeConfig()
	cfg.Prefix = prefix
	st := store.New(d.rdb, cfg)
	p.stores[prefix] = st
	return st
}

// closeForeign stops the other prefixes' Stores.
func (d *Dedup) closeForeign() {
	p := &d.foreign
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, st := range p.stores {
		st.Close()
	}
}
