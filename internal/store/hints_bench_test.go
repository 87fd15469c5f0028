package store

import (
	"strconv"
	"testing"
)

// BenchmarkHintsNewKey is an accepted enqueue's use of the cache on a key
// it has not met: a miss, then the holder remembered, in a full cache.
func BenchmarkHintsNewKey(b *testing.B) {
	var c hintCache
	key := func(i int) string {
		return "bench-0123456789:{q-bench-0123}:u:" + strconv.FormatUint(uint64(i)*0x9e3779b97f4a7c15, 16)
	}
	for i := range hintShards * hintsPerShard * 2 {
		c.put(key(i), hint{holder: "dd-0123456789abcdef0123"})
	}
	keys := make([]string, 1<<16)
	for i := range keys {
		keys[i] = key(1<<20 + i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		k := keys[i%len(keys)]
		sh := c.shard(k)
		if _, found := sh.get(k); !found {
			sh.put(k, hint{holder: "dd-0123456789abcdef0123"}, true)
		}
	}
}
