package store

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Per node. On Redis Cluster every master has a breaker and a batcher of
// its own: a master that fails opens only its own breaker and stalls only
// its own pipelines, while calls for the other masters' slots go on (a
// pipeline mixing masters waits for the slowest). On a single node,
// Sentinel or a Ring there is one of each.

// shard is one node's breaker and batcher.
type shard struct {
	br    *breaker
	batch *batcher // nil without batching
}

// shards finds the shard of a call from its first key.
type shards struct {
	cluster *redis.ClusterClient // nil: one node, one shard
	one     *shard               // the only shard; on a cluster, calls whose node is not known
	make    func() *shard

	mu     sync.Mutex                        // serialises adding a shard
	byAddr atomic.Pointer[map[string]*shard] // copy-on-write: read on every call

	reloaded atomic.Int64 // unix nanoseconds of the last cluster state reload asked for
}

func newShards(rdb redis.UniversalClient, make func() *shard) *shards {
	sh := &shards{one: make(), make: make}
	sh.cluster, _ = rdb.(*redis.ClusterClient)
	empty := map[string]*shard{}
	sh.byAddr.Store(&empty)
	return sh
}

// forKey returns the shard of the master serving key's slot ("" or an
// unknown node: the shared one).
func (sh *shards) forKey(ctx context.Context, key string) *shard {
	if sh.cluster == nil || key == "" {
		return sh.one
	}
	node, err := sh.cluster.MasterForKey(ctx, key)
	if err != nil {
		return sh.one
	}
	addr := node.Options().Addr
	if s, ok := (*sh.byAddr.Load())[addr]; ok {
		return s
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	m := *sh.byAddr.Load()
	if s, ok := m[addr]; ok {
		return s
	}
	s := sh.make()
	next := make(map[string]*shard, len(m)+1)
	for a, v := range m {
		next[a] = v
	}
	next[addr] = s
	sh.byAddr.Store(&next)
	return s
}

// live returns the shards of the nodes that serve slots now (by the client's
// current view of the cluster), and the shared one: a master that died and
// was replaced keeps its shard, whose breaker no call will probe again.
func (sh *shards) live(ctx context.Context) []*shard {
	if sh.cluster == nil {
		return []*shard{sh.one}
	}
	var (
		mu    sync.Mutex
		addrs = map[string]bool{}
	)
	err := sh.cluster.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		addrs[c.Options().Addr] = true
		mu.Unlock()
		return nil
	})
	if err != nil {
		return sh.all()
	}
	out := []*shard{sh.one}
	for a, s := range *sh.byAddr.Load() {
		if addrs[a] {
			out = append(out, s)
		}
	}
	return out
}

// all returns every shard made so far.
func (sh *shards) all() []*shard {
	out := []*shard{sh.one}
	for _, s := range *sh.byAddr.Load() {
		out = append(out, s)
	}
	return out
}

// reloadEvery bounds how often a failing call asks go-redis to reload the
// cluster's topology.
const reloadEvery = time.Second

// faulted asks go-redis, at most once per reloadEvery, to reload the
// cluster's slot map after a call failed on the network, or was refused by
// its node's open breaker (guard): a master that died is replaced by its
// promoted replica as soon as the cluster has promoted it, not at
// go-redis's next periodic refresh (go-redis reloads on MOVED, not on a
// failed dial).
func (sh *shards) faulted() {
	if sh.cluster == nil {
		return
	}
	now := time.Now().UnixNano()
	last := sh.reloaded.Load()
	if now-last < int64(reloadEvery) || !sh.reloaded.CompareAndSwap(last, now) {
		return
	}
	sh.cluster.ReloadState(context.Background()) // lazy: the next call that needs the state reloads it
}
