package store

import (
	"hash/maphash"
	"sync"
)

// hintCache remembers, per lock, the holder and follow-up the last script
// reply named, so that the next call on the key can pass the keys of their
// asynq records (roles H, J, G) at once instead of learning them from a
// statusNeed reply, one round trip later. A wrong or missing hint costs
// that round trip, nothing else: the scripts check every hint against the
// lock. Memory is bounded: each shard keeps at most hintsPerShard locks
// and forgets an arbitrary one to make room.
type hintCache struct {
	seed   maphash.Seed
	once   sync.Once
	shards [hintShards]hintShard
}

const (
	hintShards    = 16
	hintsPerShard = 1024
)

type hintShard struct {
	mu sync.Mutex
	m  map[string]hint
}

// hint is what a lock held at the last reply: its owner as stored, its
// follow-up ("" for none), and when the owner took it (unix seconds, 0 if
// unknown).
type hint struct {
	holder, follow string
	since          int64
}

func (c *hintCache) shard(lockKey string) *hintShard {
	c.once.Do(func() { c.seed = maphash.MakeSeed() })
	return &c.shards[maphash.String(c.seed, lockKey)%hintShards]
}

func (c *hintCache) get(lockKey string) (hint, bool) {
	sh := c.shard(lockKey)
	sh.mu.Lock()
	h, ok := sh.m[lockKey]
	sh.mu.Unlock()
	return h, ok
}

func (c *hintCache) put(lockKey string, h hint) {
	sh := c.shard(lockKey)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.m == nil {
		sh.m = make(map[string]hint, hintsPerShard)
	}
	if _, ok := sh.m[lockKey]; !ok && len(sh.m) >= hintsPerShard {
		for k := range sh.m { // an arbitrary entry makes room
			delete(sh.m, k)
			break
		}
	}
	sh.m[lockKey] = h
}

func (c *hintCache) forget(lockKey string) {
	sh := c.shard(lockKey)
	sh.mu.Lock()
	delete(sh.m, lockKey)
	sh.mu.Unlock()
}
