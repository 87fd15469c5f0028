package dedup

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"time"

	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/cespare/xxhash/v2"
)

// A fingerprint is the 64-bit xxhash (or, with Config.HashKey, a keyed
// 128-bit HMAC-SHA-256) of a prefix-free encoding of
//
//	version, namespace (the task type, or a shared-key marker), [window,] kind, material
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

// errEmptyKey is the cause in a *PayloadError of a key option or KeyFunc
// that gave an empty key.
var errEmptyKey = errors.New("empty dedup key")

// keyForm says how r chooses a key, as a lock records it (store's
// KeyForm): which kind of key, and the field names, never the material.
// It follows fingerprintStream's precedence.
func keyForm(r *resolved) string {
	if r.form != "" {
		return r.form
	}
	shared := r.shared && (r.keyFunc != nil || r.hasKey)
	switch {
	case r.keyFunc != nil && shared:
		return store.KeyFormSharedFunc
	case r.keyFunc != nil:
		return store.KeyFormFunc
	case r.hasKey && shared:
		return store.KeyFormShared
	case r.hasKey:
		return store.KeyFormKey
	case r.fields != nil:
		return store.KeyFormFields(r.fields.Paths())
	}
	return store.KeyFormPayload
}

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
	if r.period > 0 {
		// The window: 'W' and its start, before the kind (no kind is 'W').
		w := r.window
		if w.IsZero() {
			w, _ = periodWindow(time.Now(), r.period, r.loc)
		}
		b = append(b, 'W')
		b = binary.BigEndian.AppendUint64(b, uint64(w.UnixMilli()))
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
			return nil, nil, "", &PayloadError{Type: typ, Err: errEmptyKey}
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

func hexUint64(dst []byte, v uint64) {
	const digits = "0123456789abcdef"
	for i := 15; i >= 0; i-- {
		dst[i] = digits[v&0xf]
		v >>= 4
	}
}
