package dedup

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"pgregory.net/rapid"
)

// idRoundTrip runs lib.lua's id_pack and id_unpack on the server.
var idRoundTrip = redis.NewScript(withLib(`
local p = id_pack(ARGV[1], ARGV[2])
return {p, id_unpack(p, ARGV[2])}
`))

// A lock stores its owner's ID packed; every ID reads back as itself, the
// scripts pack exactly as the Go side does, the wrapper's own IDs shrink to
// their 20 random digits, and a whole ID (a lock of the earlier layout)
// still reads back as that ID.
func TestLockIDPacking(t *testing.T) {
	rdb := newRDB(t)
	ctx := context.Background()
	rapid.Check(t, func(t *rapid.T) {
		fp := rapid.StringMatching(`[0-9a-f]{16}|[0-9a-f]{32}`).Draw(t, "fp")
		id := rapid.OneOf(
			rapid.Just(newLockedID(fp)),                            // the wrapper's own
			rapid.Just(newLockedID(fp[:len(fp)/2]+fp[:len(fp)/2])), // another key's
			rapid.StringMatching(`[0-9a-f]{20}`),                   // looks packed
			rapid.StringMatching(`=.{0,24}`),                       // looks escaped
			rapid.StringMatching(`dd-[0-9a-f]{16}-[0-9a-fA-F]{19,21}`),
			rapid.String(),
		).Draw(t, "id")
		if id == "" {
			return // asynq never has an empty task ID
		}
		packed := packLockID(id, fp)
		if got := unpackLockID(packed, fp); got != id {
			t.Fatalf("unpack(pack(%q)) = %q (packed %q)", id, got, packed)
		}
		if fpOf, ok := parseLockedID(id); ok && fpOf == fp && len(packed) != randomHexDigits {
			t.Fatalf("the wrapper's ID %q packs to %q, not its random digits", id, packed)
		}
		if fpOf, ok := parseLockedID(id); ok && unpackLockID(id, fp) != id {
			t.Fatalf("a whole ID %q (key %s) does not read back as itself", id, fpOf)
		}
		v, err := idRoundTrip.Run(ctx, rdb, nil, id, fp).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if v[0] != packed || v[1] != id {
			t.Fatalf("lib.lua packs %q as %q → %q; Go packs it as %q", id, v[0], v[1], packed)
		}
	})
}
