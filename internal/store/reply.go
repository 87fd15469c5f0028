package store

import (
	"fmt"
	"strconv"
	"time"
)

// Status is the first element of a script's reply (see each script's header).
type Status int64

// Script reply statuses.
const (
	StatusBroken   Status = -1 // asynq's record is not what the scripts expect
	StatusHeld     Status = 0  // held by another task
	StatusTaken    Status = 1  // taken (or, for finish, settled)
	StatusSelf     Status = 2  // already held by the same task (acquire)
	StatusReplaced Status = 3  // payload of the waiting holder replaced (acquire)
	StatusMerge    Status = 4  // merge needed: payload and version returned (acquire)
	StatusDeferred Status = 5  // follow-up created for the running holder (acquire)
	StatusReserved Status = 6  // holder not stored in asynq yet (acquire)
	StatusConflict Status = 7  // direct enqueue: the task ID already exists in asynq (acquire)
	StatusOver     Status = 8  // too many keys waiting (acquire)
	StatusAllowed  Status = 9  // running policy "allow": run without the lock (start)
	statusFree     Status = 10 // the key is free: take it, with the task (take, acquire)
	statusNeed     Status = 11 // the script lacks keys: call again with them
	statusWait     Status = 12 // a late settle met the lock still its task's: call again later (settle)
	// StatusElsewhere: the starting task has no asynq record in this Redis:
	// its server stores tasks elsewhere (start).
	StatusElsewhere Status = 13
	// StatusCooling: the key's last task succeeded and the key cools down
	// (Cooldown, Period), or it failed for good and the key is held
	// (OnFailure): held by that task, whatever the policy (take, acquire, start).
	StatusCooling Status = 14
)

// reply is a checked {status, string...} script reply.
type reply struct {
	status Status
	strs   []string
}

// str returns element i after the status, "" if there is none.
func (r reply) str(i int) string {
	if i < len(r.strs) {
		return r.strs[i]
	}
	return ""
}

// parseReply checks a {status, string|integer...} script reply.
func parseReply(v any) (reply, error) {
	arr, ok := v.([]any)
	if !ok || len(arr) < 1 {
		return reply{}, fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	st, ok := arr[0].(int64)
	if !ok {
		return reply{}, fmt.Errorf("dedup: unexpected script status %T", arr[0])
	}
	r := reply{status: Status(st), strs: make([]string, 0, len(arr)-1)}
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

// parseMillis reads a PTTL from a reply as a duration (-1 for a key with
// no expiry, 0 for none).
func parseMillis(s string) time.Duration {
	n, _ := strconv.ParseInt(s, 10, 64)
	switch {
	case n == -1:
		return -1 // PTTL's "no expiry": held until released
	case n < 0:
		return 0
	}
	return time.Duration(n) * time.Millisecond
}

// parseFlag checks a 0/1 script reply.
func parseFlag(v any) (bool, error) {
	n, ok := v.(int64)
	if !ok {
		return false, fmt.Errorf("dedup: unexpected script reply %T", v)
	}
	return n == 1, nil
}
