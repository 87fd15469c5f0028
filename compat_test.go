package dedup

import (
	"context"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Shorthands the tests use for the Redis layout (internal/store).

func lockKeyHex(prefix, queue, fp string) string { return store.NewKeys(prefix).Lock(queue, fp) }
func indexKey(prefix, queue, id string) string   { return store.NewKeys(prefix).Index(queue, id) }
func asynqTaskKeyPrefix(queue string) string     { return store.TaskKey(queue, "") }
func asynqPrefix(queue string) string {
	return store.PendingKey(queue)[:len(store.PendingKey(queue))-len("pending")]
}
func parseLockedID(id string) (string, bool) { return store.ParseLockedID(id) }
func newLockedID(fp string) string           { return store.NewLockedID(fp) }
func newToken() string                       { return store.NewToken() }
func unpackLockID(s, fp string) string       { return store.UnpackOwner(s, fp) }
func packLockID(id, fp string) string        { return store.PackOwner(id, fp) }
func (d *Dedup) newRef(queue, fp, id, typ string, callerID bool) *store.Ref {
	return &store.Ref{Queue: queue, FP: fp, ID: id, Type: typ, Indexed: callerID}
}

// start, extend and finish call the middleware's scripts as it does.
func (d *Dedup) start(ctx context.Context, ref *store.Ref, token string, running Running) (store.Status, string, error) {
	res, err := d.store.Start(ctx, &store.Start{Ref: *ref, Token: token, Lease: d.cfg.Lease, Running: running.code()})
	if res.Status == store.StatusTaken {
		return res.Status, ref.ID, err
	}
	return res.Status, res.Holder, err
}

func (d *Dedup) extend(ctx context.Context, ref *store.Ref, token string, ttl time.Duration) (bool, error) {
	return d.store.Extend(ctx, &store.Extend{Ref: *ref, Token: token, TTL: ttl})
}

func (d *Dedup) finish(ctx context.Context, ref *store.Ref, token string, release bool, hold, followTTL time.Duration) (bool, string, error) {
	res, err := d.store.Finish(ctx, &store.Finish{Ref: *ref, Token: token, Release: release, Hold: hold, FollowTTL: followTTL})
	return res.Owned, res.Follow, err
}

func statsTypesKey(prefix string) string { return store.NewKeys(prefix).StatsTypes() }
func statsKey(prefix, typ string) string { return store.NewKeys(prefix).Stats(typ) }
