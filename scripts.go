package dedup

import (
	_ "embed"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// One Lua script per lock operation; each file's header documents its KEYS,
// ARGV and reply. They use integer arithmetic only and run unchanged on
// redis-server, Redis Cluster (all keys of a call share one hash slot) and
// miniredis.
var (
	//go:embed scripts/lib.lua
	libSrc string
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
	//go:embed scripts/coalesce.lua
	coalesceSrc string

	// Scripts that touch asynq's records or the clock get lib.lua's helpers.
	acquireScript  = redis.NewScript(withLib(acquireSrc))
	startScript    = redis.NewScript(withLib(startSrc))
	extendScript   = redis.NewScript(withLib(extendSrc))
	finishScript   = redis.NewScript(withLib(finishSrc))
	coalesceScript = redis.NewScript(withLib(coalesceSrc))
	unlockScript   = redis.NewScript(unlockSrc)

	allScripts = []*redis.Script{acquireScript, startScript, extendScript, finishScript, coalesceScript, unlockScript}
)

// libMarker marks where a script wants lib.lua's helpers; without it they go
// first. Defining them costs every call, so a script can run its fast path
// before the marker.
const libMarker = "-- @lib"

func withLib(src string) string {
	if i := strings.Index(src, libMarker); i >= 0 {
		return src[:i] + libSrc + src[i:]
	}
	return libSrc + src
}

// Script reply statuses (see each script's header).
const (
	statusBroken   = -1 // asynq's record is not what the scripts expect
	statusHeld     = 0  // held by another task
	statusTaken    = 1  // taken
	statusSelf     = 2  // already held by the same task ID (acquire only)
	statusReplaced = 3  // payload of the waiting holder replaced
	statusMerge    = 4  // merge needed: payload and version returned
	statusDeferred = 5  // follow-up created for the running holder
	statusReserved = 6  // holder not stored in asynq yet (acquire only)
	statusConflict = 7  // direct enqueue: the task ID already exists in asynq
	statusOver     = 8  // too many keys waiting
	statusAllowed  = 9  // running policy "allow": run without the lock (start only)
	statusHeldRaw  = 10 // statusHeld, the holder as the lock stores it (acquire only)
)

// reply is a checked {status, string...} script reply.
type reply struct {
	status int64
	strs   []string
}

func (r reply) str(i int) string {
	if i < len(r.strs) {
		return r.strs[i]
	}
	return ""
}

// parseReply checks a {status, string, ...} script reply.
func parseReply(v any) (reply, error) {
	arr, ok := v.([]any)
	if !ok || len(arr) < 1 {
		return reply{}, fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	st, ok := arr[0].(int64)
	if !ok {
		return reply{}, fmt.Errorf("dedup: unexpected script status %T", arr[0])
	}
	r := reply{status: st, strs: make([]string, 0, len(arr)-1)}
	for _, e := range arr[1:] {
		switch x := e.(type) {
		case string:
			r.strs = append(r.strs, x)
		case int64:
			r.strs = append(r.strs, strconv.FormatInt(x, 10))
		default:
			return reply{}, fmt.Errorf("dedup: unexpected script reply element %T", e)
		}
	}
	return r, nil
}

// parsePair checks a {status, task ID} script reply.
func parsePair(v any) (int64, string, error) {
	r, err := parseReply(v)
	if err != nil {
		return 0, "", err
	}
	return r.status, r.str(0), nil
}

// parseFlag checks a 0/1 script reply.
func parseFlag(v any) (bool, error) {
	n, ok := v.(int64)
	if !ok {
		return false, fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	return n == 1, nil
}
