package dedup

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// A fingerprint is the 64-bit xxhash of a prefix-free encoding of
//
//	version, namespace (the task type, or a shared-key marker), kind, material
//
// where kind says whether the material is the raw payload, the canonical
// encoding of the selected JSON fields, or an explicit key. Because every
// part is self-delimiting, different inputs never produce the same byte
// stream: type "a:b" with key "c" and type "a" with key "b:c" hash different
// streams, and only a true 64-bit hash collision can give them one lock.
// With n keys live in one queue at once the chance that any two collide is
// about n²/2⁶⁵ (3e-8 for a million live keys).
const fingerprintVersion = 1

const (
	kindRaw    = 'r'
	kindFields = 'f'
	kindKey    = 'k'
)

// fingerprint hashes one task under a resolved rule. It reads the payload
// once and allocates nothing for scalar fields.
func fingerprint(typ string, payload []byte, r *resolved) (uint64, error) {
	var d xxhash.Digest
	d.Reset()
	var buf [256]byte
	b := append(buf[:0], fingerprintVersion)
	keyed := r.keyFunc != nil || r.hasKey
	if r.shared && keyed { // Shared applies to Key/KeyFunc keys only
		b = append(b, 'S')
	} else {
		b = append(b, 'T')
		b = appendStringBytes(b, typ)
	}
	switch {
	case keyed:
		key := r.key
		if r.keyFunc != nil {
			k, err := r.keyFunc(typ, payload)
			if err != nil {
				return 0, &PayloadError{Type: typ, Err: err}
			}
			key = k
		}
		if key == "" {
			return 0, &PayloadError{Type: typ, Err: fmt.Errorf("empty dedup key")}
		}
		b = append(b, kindKey)
		_, _ = d.Write(b)
		_, _ = d.WriteString(key)
	case r.fields != nil:
		b = append(b, kindFields)
		var spans [maxFields]span
		if err := selectFields(payload, r.fields, &spans); err != nil {
			return 0, &PayloadError{Type: typ, Err: err}
		}
		for i, p := range r.fields.paths {
			b = appendStringBytes(b, p)
			sp := spans[i]
			if sp.end == 0 {
				if !r.missingAsNull {
					return 0, &PayloadError{Type: typ, Field: p, Err: ErrFieldMissing}
				}
				b = append(b, tagNull)
				continue
			}
			var err error
			if b, err = appendCanonical(b, payload[sp.start:sp.end]); err != nil {
				return 0, &PayloadError{Type: typ, Field: p, Err: err}
			}
		}
		_, _ = d.Write(b)
	default:
		b = append(b, kindRaw)
		_, _ = d.Write(b)
		_, _ = d.Write(payload)
	}
	return d.Sum64(), nil
}

// Lock keys live in their queue's cluster hash slot, next to asynq's own
// keys ("asynq:{queue}:..."), so one script can read a lock and asynq's task
// record together, on one node or on Redis Cluster:
//
//	<prefix>:{<queue>}:l:<16 hex digits of the fingerprint>   the lock (a hash)
//	<prefix>:{<queue>}:i:<task ID>                          lock of a caller-chosen task ID
//	<prefix>:{<queue>}:w:<task type>                        waiting keys (MaxPending), a sorted set
//	<prefix>:stats:types, <prefix>:stats:type:<type>        flushed counters (no hash tag)
//
// Lock fields: id (owner task), ty (type), c (created, unix seconds), tok
// (running attempt's token), rp (running policy), b (counted in w:), v
// (payload version), n (coalesced enqueues), f (owed follow-up task).
//
// The prefix may not contain braces, so the hash tag is always "{<queue>}"
// exactly as asynq forms it.

func lockKey(prefix, queue string, fp uint64) string {
	var h [16]byte
	hexUint64(h[:], fp)
	return prefix + ":{" + queue + "}:l:" + string(h[:])
}

func lockKeyHex(prefix, queue, fpHex string) string {
	return prefix + ":{" + queue + "}:l:" + fpHex
}

func indexKey(prefix, queue, taskID string) string {
	return prefix + ":{" + queue + "}:i:" + taskID
}

func indexKeyPrefix(prefix, queue string) string {
	return prefix + ":{" + queue + "}:i:"
}

// asynqTaskKeyPrefix is where asynq v0.26.0 keeps a task's hash:
// "asynq:{<queue>}:t:<id>" (internal/base.TaskKey). Guarded by a test.
func asynqTaskKeyPrefix(queue string) string {
	return "asynq:{" + queue + "}:t:"
}

func hexUint64(dst []byte, v uint64) {
	const digits = "0123456789abcdef"
	for i := 15; i >= 0; i-- {
		dst[i] = digits[v&0xf]
		v >>= 4
	}
}

// Task IDs chosen by the wrapper carry the fingerprint, so the middleware can
// find a task's lock from its ID alone, however it is configured:
//
//	dd-<16 hex fingerprint>-<20 hex random>   locked by the wrapper
//	dx-<20 hex random>                        opted out at enqueue
const (
	lockedIDPrefix  = "dd-"
	optOutIDPrefix  = "dx-"
	lockedIDLen     = 3 + 16 + 1 + 20
	randomHexDigits = 20
)

func newLockedID(fp uint64) string {
	var b [lockedIDLen]byte
	copy(b[:], lockedIDPrefix)
	hexUint64(b[3:19], fp)
	b[19] = '-'
	randomHex(b[20:])
	return string(b[:])
}

func newOptOutID() string {
	var b [3 + randomHexDigits]byte
	copy(b[:], optOutIDPrefix)
	randomHex(b[3:])
	return string(b[:])
}

func randomHex(dst []byte) {
	var r [randomHexDigits / 2]byte
	_, _ = rand.Read(r[:]) // crypto/rand.Read never fails (Go ≥ 1.24)
	hex.Encode(dst, r[:len(dst)/2])
}

// parseLockedID returns the fingerprint hex of a wrapper-chosen ID.
func parseLockedID(id string) (fpHex string, ok bool) {
	if len(id) != lockedIDLen || !strings.HasPrefix(id, lockedIDPrefix) || id[19] != '-' {
		return "", false
	}
	for i := 3; i < lockedIDLen; i++ {
		if i != 19 && unhex(id[i]) < 0 {
			return "", false
		}
	}
	return id[3:19], true
}
