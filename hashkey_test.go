package dedup

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
)

func TestKeyedHash(t *testing.T) {
	h := newHarness(t, Config{HashKey: []byte("secret-1"), Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	info := h.enqueue(userTask(1, "a"))
	fpHex := fpOfLock(taskLock(t, h.rdb, h.queue, info.ID))
	if len(fpHex) != 32 {
		t.Fatalf("task %q is not locked under a 128-bit fingerprint (%q)", info.ID, fpHex)
	}
	key := h.keyOf(userTask(1, "b"), h.queue)
	if !strings.HasSuffix(key, fpHex) || h.lockOwner(key) != info.ID {
		t.Fatalf("lock %s not owned by %s", key, info.ID)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(userTask(1, "b"), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("err = %v, want duplicate", err)
	}
	// Another secret gives other keys: the key space depends on the secret.
	other := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix, HashKey: []byte("secret-2"), Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	if k := other.keyOf(userTask(1, "a"), h.queue); k == key {
		t.Fatal("two secrets, one key")
	}
	// The middleware finds the lock from the longer ID, and releases it.
	done := make(chan struct{})
	h.serve(func(context.Context, *asynq.Task) error { close(done); return nil }, nil)
	waitFor(t, done, "run")
	eventually(t, "released", func() bool { return h.lockOwner(key) == "" })
}
