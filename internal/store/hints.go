package store

import (
	"hash/maphash"
	"sync"
)

// hintCache remembers, per lock, the holder and follow-up the last script
// reply named, so that the next call on the key can pass the keys of their
// asynq records (roles H, G) at once instead of learning them from a
// statusNeed reply, one round trip later, and can leave out the task it
// would store with a free key: a key last seen held is likely held still.
// A wrong or missing hint costs a round trip, nothing else: the scripts
// check every hint against the lock. Memory is bounded: each shard keeps at
// most hintsPerShard locks and forgets an arbitrary one to make room.
type hintCache struct {
	seed   maphash.Seed
	once   sync.Once
	shards [hintShards]hintShard
}

const (
	hintShards    = 64
	hintsPerShard = 256
)

// hintShard is one part of the cache. Most puts repeat what it holds (the
// same holder, replaced into again and again), so they only read-lock it.
type hintShard struct {
	mu sync.RWMutex
	m  map[string]hint
}

// hint is what a lock held at the last reply: its holder and its follow-up
// ("" for none), whole task IDs.
type hint struct {
	holder, follow string
	checked        int64 // when a reply last found the holder's record live (unix ns; 0: never)
	cached         bool  // read from the cache (not from a reply of this call)
}

func (c *hintCache) shard(lockKey string) *hintShard {
	c.once.Do(func() { c.seed = maphash.MakeSeed() })
	return &c.shards[maphash.String(c.seed, lockKey)%hintShards]
}

func (c *hintCache) get(lockKey string) (hint, bool) { return c.shard(lockKey).get(lockKey) }

func (sh *hintShard) get(lockKey string) (hint, bool) {
	sh.mu.RLock()
	h, ok := sh.m[lockKey]
	sh.mu.RUnlock()
	h.cached = ok
	return h, ok
}

func (c *hintCache) put(lockKey string, h hint) { c.shard(lockKey).put(lockKey, h, false) }

// put remembers h for lockKey. missed: the caller just found no entry for
// it (get), so the read-locked look for an equal one is skipped.
func (sh *hintShard) put(lockKey string, h hint, missed bool) {
	if !missed {
		sh.mu.RLock()
		old, ok := sh.m[lockKey]
		sh.mu.RUnlock()
		if ok && old.holder == h.holder && old.follow == h.follow && old.checked == h.checked {
			return
		}
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.m == nil {
		sh.m = make(map[string]hint, hintsPerShard+1)
	}
	sh.m[lockKey] = h
	if len(sh.m) > hintsPerShard { // (so the map is hashed once for a new key)
		for k := range sh.m { // an arbitrary other entry makes room
			if k != lockKey {
				delete(sh.m, k)
				break
			}
		}
	}
}

func (c *hintCache) forget(lockKey string) {
	sh := c.shard(lockKey)
	sh.mu.Lock()
	delete(sh.m, lockKey)
	sh.mu.Unlock()
}

// Forget drops what the process remembers of the lock at lockKey (after an
// operator released it), so the next call on the key learns afresh.
func (s *Store) Forget(lockKey string) { s.hints.forget(lockKey) }
