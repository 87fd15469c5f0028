package store

import (
	_ "embed"
	"os"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// One Lua script per operation; each file's header documents its KEYS,
// ARGV and reply. They use integer arithmetic only and run unchanged on
// redis-server, Redis Cluster (all keys of a call share the queue's hash
// slot, and all are in KEYS) and miniredis.
var (
	//go:embed lua/prelude.lua
	preludeSrc string
	//go:embed lua/checked.lua
	checkedSrc string
	//go:embed lua/pb.lua
	pbSrc string
	//go:embed lua/lib.lua
	libSrc string
	//go:embed lua/take.lua
	takeSrc string
	//go:embed lua/acquire.lua
	acquireSrc string
	//go:embed lua/fold.lua
	foldSrc string
	//go:embed lua/merge.lua
	mergeSrc string
	//go:embed lua/start.lua
	startSrc string
	//go:embed lua/settle.lua
	settleSrc string
	//go:embed lua/extend.lua
	extendSrc string
	//go:embed lua/release.lua
	releaseSrc string
	//go:embed lua/again.lua
	againSrc string
	//go:embed lua/prune.lua
	pruneSrc string
	//go:embed lua/withdraw.lua
	withdrawSrc string
	//go:embed lua/release_all.lua
	releaseAllSrc string
)

// CheckKeysEnv, when set in the environment of a process that creates a
// Store, makes its scripts fail on any key they were not given in KEYS
// (the tests set it; see lua/checked.lua). It costs a table lookup per
// Redis call, so production leaves it unset.
const CheckKeysEnv = "DEDUP_CHECK_SCRIPT_KEYS"

// scriptSet holds the scripts, in one of two builds.
type scriptSet struct {
	take, acquire, fold, merge, start, settle, extend, release, again, prune, withdraw, releaseAll *redis.Script
}

func (s *scriptSet) all() []*redis.Script {
	return []*redis.Script{s.take, s.acquire, s.fold, s.merge, s.start, s.settle, s.extend, s.release, s.again, s.prune, s.withdraw, s.releaseAll}
}

var (
	plainScripts   = sync.OnceValue(func() *scriptSet { return buildScripts(false) })
	checkedScripts = sync.OnceValue(func() *scriptSet { return buildScripts(true) })
)

// scripts returns the build the environment asks for.
func scripts() *scriptSet {
	if os.Getenv(CheckKeysEnv) != "" {
		return checkedScripts()
	}
	return plainScripts()
}

func buildScripts(checked bool) *scriptSet {
	b := func(src string) *redis.Script { return redis.NewScript(source(src, checked)) }
	return &scriptSet{
		take: b(takeSrc), acquire: b(acquireSrc), fold: b(foldSrc), merge: b(mergeSrc), start: b(startSrc), settle: b(settleSrc),
		extend: b(extendSrc), release: b(releaseSrc), again: b(againSrc), prune: b(pruneSrc), withdraw: b(withdrawSrc), releaseAll: b(releaseAllSrc),
	}
}

// Markers of where a script wants pb.lua's and lib.lua's helpers (after
// its fast paths, which then do not pay for defining them); a script
// without a marker gets none. lib.lua needs pb.lua: a script with only the
// lib marker gets both there.
const (
	pbMarker  = "-- @pb"
	libMarker = "-- @lib"
)

// source assembles a script: the prelude (with the key check, for
// checked), then the script with the helpers at its markers.
func source(body string, checked bool) string {
	head := preludeSrc
	if checked {
		head += checkedSrc
	}
	lib := libSrc
	if i := strings.Index(body, pbMarker); i >= 0 {
		body = body[:i] + pbSrc + body[i:]
	} else {
		lib = pbSrc + libSrc
	}
	if i := strings.Index(body, libMarker); i >= 0 {
		body = body[:i] + lib + body[i:]
	}
	return head + body
}

// LibScript returns a script of body with the prelude and lib.lua's
// helpers, for tests of the helpers.
func LibScript(body string) *redis.Script { return redis.NewScript(source(libMarker+"\n"+body, true)) }

// ScriptHash is the SHA1 by which Redis knows the script of an operation
// ("take", "acquire", "fold", "merge", "start", "settle", "extend", "release",
// "again", "release_all"), in the build a Store created now uses; for tests that count
// commands.
func ScriptHash(op string) string {
	sc := scripts()
	m := map[string]*redis.Script{"take": sc.take, "acquire": sc.acquire, "fold": sc.fold, "merge": sc.merge, "start": sc.start,
		"settle": sc.settle, "extend": sc.extend, "release": sc.release, "again": sc.again, "release_all": sc.releaseAll}
	if s, ok := m[op]; ok {
		return s.Hash()
	}
	return ""
}
