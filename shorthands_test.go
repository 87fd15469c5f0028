package dedup

import (
	"context"
	"testing"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// Shorthands the tests use for the Redis layout (internal/store).

func lockKeyHex(prefix, queue, fp string) string { return store.NewKeys(prefix).Lock(queue, fp) }
func modeKeyOf(lock string) string               { return store.ModeOf(lock) }
func asynqTaskKeyPrefix(queue string) string     { return store.TaskKey(queue, "") }
func asynqPrefix(queue string) string {
	return store.PendingKey(queue)[:len(store.PendingKey(queue))-len("pending")]
}
func statsTypesKey(prefix string) string { return store.NewKeys(prefix).StatsTypes() }
func statsKey(prefix, typ string) string { return store.NewKeys(prefix).Stats(typ) }

// holderIn returns the task a lock's value names ("" for none).
func holderIn(value string) string { return store.ParseValue(value).Holder }

// taskLock returns the lock key the stored task id of queue names, failing
// the test when it names none.
func taskLock(t testing.TB, rdb redis.Cmdable, queue, id string) string {
	t.Helper()
	lock, _, err := store.TaskLockOf(context.Background(), rdb, queue, id)
	if err != nil || lock == "" {
		t.Fatalf("task %s in %s names no lock (err %v)", id, queue, err)
	}
	return lock
}

// fpOfLock returns a lock key's fingerprint.
func fpOfLock(lock string) string {
	_, _, fp, _ := store.ParseLockKey(lock)
	return fp
}
