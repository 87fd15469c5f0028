package dedup

import (
	_ "embed"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// One Lua script per lock operation; each file's header documents its KEYS,
// ARGV and reply. They use integer arithmetic only and run unchanged on
// redis-server, Redis Cluster (all keys of a call share one hash slot) and
// miniredis.
var (
	//go:embed scripts/acquire.lua
	acquireSrc string
	//go:embed scripts/start.lua
	startSrc string
	//go:embed scripts/extend.lua
	extendSrc string
	//go:embed scripts/finish.lua
	finishSrc string
	//go:embed scripts/unlock.lua
	unlockSrc string

	acquireScript = redis.NewScript(acquireSrc)
	startScript   = redis.NewScript(startSrc)
	extendScript  = redis.NewScript(extendSrc)
	finishScript  = redis.NewScript(finishSrc)
	unlockScript  = redis.NewScript(unlockSrc)

	allScripts = []*redis.Script{acquireScript, startScript, extendScript, finishScript, unlockScript}
)

// Script reply statuses of acquire and start.
const (
	statusHeld  = 0 // held by another task
	statusTaken = 1 // taken
	statusSelf  = 2 // already held by the same task ID (acquire only)
)

// parsePair checks a {status, task ID} script reply.
func parsePair(v any) (int64, string, error) {
	arr, ok := v.([]any)
	if !ok || len(arr) != 2 {
		return 0, "", fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	st, ok1 := arr[0].(int64)
	id, ok2 := arr[1].(string)
	if !ok1 || !ok2 {
		return 0, "", fmt.Errorf("dedup: unexpected script reply types %T, %T", arr[0], arr[1])
	}
	return st, id, nil
}

// parseFlag checks a 0/1 script reply.
func parseFlag(v any) (bool, error) {
	n, ok := v.(int64)
	if !ok {
		return false, fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	return n == 1, nil
}
