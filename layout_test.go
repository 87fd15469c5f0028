package dedup

import (
	"bytes"
	"context"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The lock scripts read asynq's own task record ("asynq:{<queue>}:t:<id>",
// field "state") to heal orphaned locks. That layout is asynq's internal
// business: this test pins it, and fails loudly when an asynq upgrade
// changes it.
func TestAsynqLayoutPinned(t *testing.T) {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		t.Fatal("no build info")
	}
	for _, m := range bi.Deps {
		if m.Path == "github.com/hibiken/asynq" && m.Version != "v0.26.0" {
			t.Fatalf("asynq %s: the lock scripts rely on v0.26.0's key layout; re-check asynqTaskKeyPrefix and the task states, then update this test", m.Version)
		}
	}
	h := newHarness(t, Config{})
	ctx := context.Background()
	state := func(id string) string {
		return h.rdb.HGet(ctx, asynqTaskKeyPrefix(h.queue)+id, "state").Val()
	}
	pending, err := h.asynq.Enqueue(asynq.NewTask("layout", nil), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if got := state(pending.ID); got != "pending" {
		t.Fatalf("asynq task record: state %q at %s, want pending", got, asynqTaskKeyPrefix(h.queue)+pending.ID)
	}
	if err := h.insp.ArchiveTask(h.queue, pending.ID); err != nil {
		t.Fatal(err)
	}
	if got := state(pending.ID); got != "archived" {
		t.Fatalf("archived task: state %q", got)
	}
	done := make(chan struct{})
	h.serve(func(context.Context, *asynq.Task) error { close(done); return nil }, nil)
	completed, err := h.asynq.Enqueue(asynq.NewTask("layout", []byte("c")), asynq.Queue(h.queue), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, done, "run")
	eventually(t, "completed state", func() bool { return state(completed.ID) == "completed" })
}

// ageLock makes a lock look older than the heal grace without waiting.
func (h *harness) ageLock(key string) {
	h.t.Helper()
	ctx := context.Background()
	v, err := h.rdb.Get(ctx, key).Result()
	if err != nil {
		h.t.Fatal(err)
	}
	if p := store.ParseValue(v); p.Kind == store.HoldWrap {
		v = store.WrapValue(p.Holder, time.Unix(0, 0)) // taken long ago
	}
	if err := h.rdb.SetArgs(ctx, key, v, redis.SetArgs{KeepTTL: true}).Err(); err != nil {
		h.t.Fatal(err)
	}
}

func TestOrphanedLockHeals(t *testing.T) {
	h := newHarness(t, Config{})
	task := userTask(1, "")
	key := h.keyOf(task, h.queue)
	first := h.enqueue(task)
	// Young locks are never healed: asynq may not have stored the task yet.
	if err := h.insp.DeleteTask(h.queue, first.ID); err != nil {
		t.Fatal(err)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) {
		t.Fatalf("young orphan: err = %v, want duplicate", err)
	}
	h.ageLock(key)
	second := h.enqueue(task)
	if owner := h.lockOwner(key); owner != second.ID {
		t.Fatalf("owner %q after healing, want %q", owner, second.ID)
	}
	// An archived owner frees the key too.
	if err := h.insp.ArchiveTask(h.queue, second.ID); err != nil {
		t.Fatal(err)
	}
	h.ageLock(key)
	third := h.enqueue(task)
	// A live owner is never healed, however old its lock.
	h.ageLock(key)
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != third.ID {
		t.Fatalf("live owner: err = %v, want duplicate of %s", err, third.ID)
	}
}

// New keeps NewClient's direct path only for the asynq version whose layout
// it writes: the linked one is it (go.mod pins it), others are not.
func TestKnownAsynqLayout(t *testing.T) {
	// A test binary may carry no module list; a built program does (go
	// version -m shows it), and there it must name the known version.
	if v, ok := linkedAsynq(); ok && !knownLayout(v) {
		t.Fatalf("linked asynq %q is not the known layout %s", v, store.AsynqVersion)
	}
	for _, v := range []string{"v0.26.1", "v0.25.0", "v1.0.0", ""} {
		if knownLayout(v) {
			t.Errorf("%q taken for the known layout", v)
		}
	}
	h := newHarness(t, Config{})
	if c := h.d.NewClient(); !c.direct {
		t.Fatal("the direct path is off with the known asynq")
	}
}

// Field selection's public face has its own file (fields.go): the Fields
// option, the path and canonical-value rules, PayloadError.
func TestFieldSelectionHasItsOwnFile(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "fields.go", nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	declared := map[string]bool{}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				declared[d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				if ts, ok := s.(*ast.TypeSpec); ok {
					declared[ts.Name.Name] = true
				}
			}
		}
	}
	for _, name := range []string{"Fields", "PayloadError", "compileFields"} {
		if !declared[name] {
			t.Errorf("%s is not declared in fields.go", name)
		}
	}
}

// The protobuf rewrite round-trips through asynq's decoder: headers, a
// payload needing a three-byte length, an empty payload.
func TestPayloadRewriteRoundTripsThroughAsynqsDecoder(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"counter": {Key: "x", OnConflict: Replace}}})
	big := []byte(`{"key":"k","pad":"` + strings.Repeat("z", 20000) + `"}`)
	info, err := h.client.Enqueue(asynq.NewTaskWithHeaders("counter", []byte(`{}`), map[string]string{"h1": "v1", "h2": strings.Repeat("w", 300)}),
		asynq.Queue(h.queue), asynq.MaxRetry(7), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range [][]byte{big, {}, []byte("x"), big[:200]} {
		res, err := h.client.Submit(context.Background(), asynq.NewTask("counter", p), asynq.Queue(h.queue))
		if err != nil || res.Outcome != Replaced {
			t.Fatalf("%+v %v", res, err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		delete(ti.Headers, store.HeaderLock) // (the library's own)
		if !bytes.Equal(ti.Payload, p) || ti.MaxRetry != 7 || ti.Timeout != time.Minute || ti.Retention != time.Hour || ti.ID != info.ID || len(ti.Headers) != 2 {
			t.Fatalf("round trip of %d bytes: got %d bytes, %+v", len(p), len(ti.Payload), ti)
		}
	}
}
