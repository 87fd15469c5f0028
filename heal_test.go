package dedup

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// A lock whose owner task no longer exists in asynq, or is done, must not
// block the key: each way a task can vanish is healed at the next enqueue.
func TestOrphanedLockHealsEveryWay(t *testing.T) {
	cases := []struct {
		name   string
		vanish func(h *harness, id string)
	}{
		{"deleted through the Inspector", func(h *harness, id string) {
			if err := h.insp.DeleteTask(h.queue, id); err != nil {
				h.t.Fatal(err)
			}
		}},
		{"queue deleted", func(h *harness, id string) {
			if err := h.insp.DeleteQueue(h.queue, true); err != nil {
				h.t.Fatal(err)
			}
		}},
		{"archived by hand", func(h *harness, id string) {
			if err := h.insp.ArchiveTask(h.queue, id); err != nil {
				h.t.Fatal(err)
			}
		}},
		{"completed, lock left behind", func(h *harness, id string) {
			// As if the release was lost: asynq completed the task, the lock stayed.
			ctx := context.Background()
			if err := h.rdb.HSet(ctx, asynqTaskKeyPrefix(h.queue)+id, "state", "completed").Err(); err != nil {
				h.t.Fatal(err)
			}
		}},
		{"lost (record gone)", func(h *harness, id string) {
			if err := h.rdb.Del(context.Background(), asynqTaskKeyPrefix(h.queue)+id).Err(); err != nil {
				h.t.Fatal(err)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, Config{})
			task := userTask(1, "")
			key := h.keyOf(task, h.queue)
			first := h.enqueue(task)
			c.vanish(h, first.ID)
			h.ageLock(key)
			second, err := h.client.Enqueue(task, asynq.Queue(h.queue))
			if err != nil {
				t.Fatalf("enqueue after the owner vanished: %v", err)
			}
			if owner := h.lockOwner(key); owner != second.ID {
				t.Fatalf("lock owner %q, want the new task %q", owner, second.ID)
			}
		})
	}
}

func TestRequirePassPassesThrough(t *testing.T) {
	needRealRedis(t)
	p, err := spawnRedis("", "--requirepass", "s3cret")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	noauth := redis.NewClient(&redis.Options{Addr: p.Addr, MaxRetries: -1})
	defer noauth.Close()
	_, err = New(context.Background(), noauth, Config{connectAttempts: 1, Logger: quietLogger()})
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("without the password: err = %v, want ErrUnavailable wrapping NOAUTH", err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: p.Addr, Password: "s3cret"})
	defer rdb.Close()
	h := newHarnessOn(t, rdb, Config{})
	info := h.enqueue(userTask(1, ""))
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("with the password: err = %v", err)
	}
}

func TestWarnsWhenLocksCanBeEvicted(t *testing.T) {
	needRealRedis(t)
	p, err := spawnRedis("", "--maxmemory-policy", "allkeys-lru")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	rdb := redis.NewClient(&redis.Options{Addr: p.Addr})
	defer rdb.Close()
	var buf bytes.Buffer
	d, err := New(context.Background(), rdb, Config{Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if !strings.Contains(buf.String(), "maxmemory-policy=allkeys-lru") {
		t.Fatalf("no eviction warning; log: %s", buf.String())
	}
	buf.Reset()
	d2, err := New(context.Background(), newRDB(t), Config{Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if redistest.Addr() != "" && strings.Contains(buf.String(), "maxmemory") {
		t.Fatalf("warned under noeviction: %s", buf.String())
	}
}

// Logs and errors name types, fields and task IDs, never payload contents.
func TestNoPayloadInLogsOrErrors(t *testing.T) {
	var buf redistest.LogBuffer
	logger := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h := newHarness(t, Config{Logger: logger, Rules: map[string]Rule{"secret": {Fields: []string{"user_id"}}}})
	const secret = "hunter2-card-4111"
	payload := []byte(`{"password":"` + secret + `"}`) // user_id missing
	_, err := h.client.Enqueue(asynq.NewTask("secret", payload), asynq.Queue(h.queue))
	if !errors.Is(err, ErrFieldMissing) || strings.Contains(err.Error(), secret) {
		t.Fatalf("err = %v", err)
	}
	// The same payload reaching the server past the wrapper: logged as unguarded.
	done := make(chan struct{})
	h.serve(func(context.Context, *asynq.Task) error { close(done); return nil }, nil)
	if _, err := h.asynq.Enqueue(asynq.NewTask("secret", payload), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, done, "run")
	eventually(t, "unguarded logged", func() bool { return h.d.Stats().Unguarded == 1 }) // counted after logging
	if strings.Contains(buf.String(), secret) {
		t.Fatalf("payload in the log: %s", buf.String())
	}
	if !strings.Contains(buf.String(), "unguarded") {
		t.Fatalf("expected an unguarded warning, log: %s", buf.String())
	}
}

// A lock written with its task (the direct path, field v) whose
// caller-chosen owner X was deleted by hand is "held by X" for a new call
// with TaskID(X), which then enqueues X through the asynq client: a second
// round trip, during which the lock names X, has v, and X is not stored.
// Another producer's enqueue of the same key in that window must not take
// the verified lock whose owner is gone: one of the two is a duplicate, and
// the key has one task. The decorator's hook only makes the window
// deterministic; with NewClient alone it is the time between the two round
// trips.
func TestCallerIDReEnqueueGapAdmitsNoSecondTaskOfTheKey(t *testing.T) {
	h := newHarness(t, Config{}) // HealGrace: 1 min
	nc := h.d.NewClient()
	id := "welcome-" + h.queue
	first, err := nc.Enqueue(userTask(1, ""), asynq.Queue(h.queue), asynq.TaskID(id))
	if err != nil || first.ID != id {
		t.Fatalf("first enqueue: %v %v", first, err)
	}
	if err := h.insp.DeleteTask(h.queue, id); err != nil {
		t.Fatal(err)
	}
	var other Result
	var otherErr error
	wc := h.d.WrapClient(hookEnqueuer{next: h.asynq, before: func(ctx context.Context, _ *asynq.TaskInfo) {
		// Another producer, while X is on its way to asynq.
		other, otherErr = nc.Submit(ctx, userTask(1, ""), asynq.Queue(h.queue))
	}})
	again, err := wc.Enqueue(userTask(1, ""), asynq.Queue(h.queue), asynq.TaskID(id))
	t.Logf("re-enqueue of %s: %v, err %v; the other producer: %+v, err %v", id, again != nil, err, other.Outcome, otherErr)
	if err == nil && otherErr == nil {
		t.Errorf("two tasks of one key accepted: %s and %s", again.ID, other.TaskID)
	}
	if n := h.queueSize(h.queue); n != 1 {
		t.Errorf("%d live tasks of one key, want 1", n)
	}
}
