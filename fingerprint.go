package dedup

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"strings"

	"github.com/asynq-dedup/dedup/internal/jsonkey"

	"github.com/cespare/xxhash/v2"
)

// A fingerprint is the 64-bit xxhash (or, with Config.HashKey, a keyed
// 128-bit HMAC-SHA-256) of a prefix-free encoding of
//
//	version, namespace (the task type, or a shared-key marker), kind, material
//
// where kind says whether the material is the raw payload, the canonical
// encoding of the selected JSON fields, or an explicit key. Because every
// part is self-delimiting, different inputs never produce the same byte
// stream: type "a:b" with key "c" and type "a" with key "b:c" hash different
// streams, and only a true 64-bit hash collision can give them one lock.
// With n keys live in one queue at once the chance that any two collide is
// about n²/2⁶⁵ (3e-8 for a million live keys). xxhash is not built to resist
// an adversary who picks payloads to collide with someone else's key; the
// keyed hash is, as long as the key stays secret.
const fingerprintVersion = 1

const (
	kindRaw    = 'r'
	kindFields = 'f'
	kindKey    = 'k'
)

// fingerprint hashes one task under a resolved rule with 64-bit xxhash. It
// reads the payload once and allocates nothing for scalar fields.
func fingerprint(typ string, payload []byte, r *resolved) (uint64, error) {
	var buf [256]byte
	head, tail, tailKey, err := fingerprintStream(&buf, typ, payload, r)
	if err != nil {
		return 0, err
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.Write(head)
	_, _ = d.Write(tail)
	_, _ = d.WriteString(tailKey)
	return d.Sum64(), nil
}

// keyedFingerprint is the strong variant (Config.HashKey): the first 128
// bits of HMAC-SHA-256 under a secret key, over the same byte stream.
func keyedFingerprint(secret []byte, typ string, payload []byte, r *resolved) ([16]byte, error) {
	var buf [256]byte
	var out [16]byte
	head, tail, tailKey, err := fingerprintStream(&buf, typ, payload, r)
	if err != nil {
		return out, err
	}
	m := hmac.New(sha256.New, secret)
	m.Write(head)
	m.Write(tail)
	_, _ = io.WriteString(m, tailKey)
	copy(out[:], m.Sum(nil))
	return out, nil
}

// fingerprintStream builds the byte stream a fingerprint hashes: head (in
// buf when it fits), followed by tail (the raw payload) or tailKey (an
// explicit key).
func fingerprintStream(buf *[256]byte, typ string, payload []byte, r *resolved) (head, tail []byte, tailKey string, err error) {
	b := append(buf[:0], fingerprintVersion)
	keyed := r.keyFunc != nil || r.hasKey
	if r.shared && keyed { // Shared applies to Key/KeyFunc keys only
		b = append(b, 'S')
	} else {
		b = append(b, 'T')
		b = jsonkey.AppendString(b, typ)
	}
	switch {
	case keyed:
		key := r.key
		if r.keyFunc != nil {
			k, err := r.keyFunc(typ, payload)
			if err != nil {
				return nil, nil, "", &PayloadError{Type: typ, Err: err}
			}
			key = k
		}
		if key == "" {
			return nil, nil, "", &PayloadError{Type: typ, Err: fmt.Errorf("empty dedup key")}
		}
		return append(b, kindKey), nil, key, nil
	case r.fields != nil:
		b = append(b, kindFields)
		var spans [jsonkey.MaxFields]jsonkey.Span
		if err := jsonkey.Select(payload, r.fields, &spans); err != nil {
			return nil, nil, "", &PayloadError{Type: typ, Err: err}
		}
		for i, p := range r.fields.Paths() {
			b = jsonkey.AppendString(b, p)
			sp := spans[i]
			if sp.End == 0 {
				if !r.missingAsNull {
					return nil, nil, "", &PayloadError{Type: typ, Field: p, Err: ErrFieldMissing}
				}
				b = append(b, jsonkey.TagNull)
				continue
			}
			var err error
			if b, err = jsonkey.AppendCanonical(b, payload[sp.Start:sp.End]); err != nil {
				return nil, nil, "", &PayloadError{Type: typ, Field: p, Err: err}
			}
		}
		return b, nil, "", nil
	default:
		return append(b, kindRaw), payload, "", nil
	}
}

// fingerprintHex is the fingerprint a Dedup uses, as lock-key hex: 16 digits
// of xxhash, or 32 of the keyed hash when Config.HashKey is set.
func (d *Dedup) fingerprintHex(typ string, payload []byte, r *resolved) (string, error) {
	if len(d.cfg.HashKey) > 0 {
		fp, err := keyedFingerprint(d.cfg.HashKey, typ, payload, r)
		if err != nil {
			return "", err
		}
		return hex.EncodeToString(fp[:]), nil
	}
	fp, err := fingerprint(typ, payload, r)
	if err != nil {
		return "", err
	}
	var h [16]byte
	hexUint64(h[:], fp)
	return string(h[:]), nil
}

// Lock keys live in their queue's cluster hash slot, next to asynq's own
// keys ("asynq:{queue}:..."), so one script can read a lock and asynq's task
// record together, on one node or on Redis Cluster:
//
//	<prefix>:{<queue>}:l:<16 hex digits of the fingerprint>   the lock (a hash)
//	<prefix>:{<queue>}:i:<task ID>                          lock of a caller-chosen task ID
//	<prefix>:{<queue>}:w:<task type>                        waiting keys (MaxPending), a sorted set
//	<prefix>:{<queue>}:f:<fingerprint>                      follow-up owed to the key (RunningDefer)
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
//	dd-<16 or 32 hex fingerprint>-<20 hex random>   locked by the wrapper
//	dx-<20 hex random>                              opted out at enqueue
const (
	lockedIDPrefix  = "dd-"
	optOutIDPrefix  = "dx-"
	randomHexDigits = 20
)

func newLockedID(fpHex string) string {
	b := make([]byte, 0, 3+len(fpHex)+1+randomHexDigits)
	b = append(b, lockedIDPrefix...)
	b = append(b, fpHex...)
	b = append(b, '-')
	var r [randomHexDigits]byte
	randomHex(r[:])
	return string(append(b, r[:]...))
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
	n := len(id) - len(lockedIDPrefix) - 1 - randomHexDigits
	if (n != 16 && n != 32) || !strings.HasPrefix(id, lockedIDPrefix) || id[3+n] != '-' {
		return "", false
	}
	for i := 3; i < len(id); i++ {
		if i != 3+n && !isHexDigit(id[i]) {
			return "", false
		}
	}
	return id[3 : 3+n], true
}

// Lock records store their owner's task ID compactly (a lock is mostly its
// owner's ID): an ID the wrapper chose for the lock's key as its 20 random
// hex digits, any other ID as itself, or as "=" + ID where that would be
// ambiguous (20 hex digits, or a leading '='). The scripts' id_pack and
// id_unpack (scripts/lib.lua) do the same; locks written before this layout,
// with the whole ID, still read back as that ID.

// packLockID returns id as the lock of key fpHex stores it.
func packLockID(id, fpHex string) string {
	if rest, ok := strings.CutPrefix(id, lockedIDPrefix); ok {
		if r, ok := strings.CutPrefix(rest, fpHex); ok && len(r) == 1+randomHexDigits && r[0] == '-' && isLowerHex(r[1:]) {
			return r[1:]
		}
	}
	if strings.HasPrefix(id, "=") || (len(id) == randomHexDigits && isLowerHex(id)) {
		return "=" + id
	}
	return id
}

// unpackLockID returns the task ID a lock of key fpHex stores as s.
func unpackLockID(s, fpHex string) string {
	if rest, ok := strings.CutPrefix(s, "="); ok {
		return rest
	}
	if len(s) == randomHexDigits && isLowerHex(s) {
		return lockedIDPrefix + fpHex + "-" + s
	}
	return s
}

// isHexDigit reports whether c is a hexadecimal digit, in either case.
func isHexDigit(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
