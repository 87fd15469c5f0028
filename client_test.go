package dedup

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

func userTask(user int, trace string) *asynq.Task {
	b, _ := json.Marshal(map[string]any{"user_id": user, "trace_id": trace})
	return asynq.NewTask("user:reindex", b)
}

// queueSize is the number of tasks of any state in q (0 if it doesn't exist).
func (h *harness) queueSize(q string) int {
	h.t.Helper()
	qi, err := h.insp.GetQueueInfo(q)
	if err != nil && strings.Contains(err.Error(), "NOT_FOUND") { // asynq returns no sentinel here
		return 0
	}
	if err != nil {
		h.t.Fatalf("GetQueueInfo: %v", err)
	}
	return qi.Size - qi.Completed // (a cooldown's task stays completed until its window ends)
}

func TestEnqueueContentionOneWinner(t *testing.T) {
	h := newHarness(t, Config{})
	const n = 100
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		winners []*asynq.TaskInfo
		dups    []*DuplicateTaskError
		others  []error
		start   = make(chan struct{})
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			info, err := h.client.EnqueueContext(context.Background(), userTask(42, fmt.Sprint("trace-", i)),
				asynq.Queue(h.queue), Fields("user_id"))
			mu.Lock()
			defer mu.Unlock()
			var dup *DuplicateTaskError
			switch {
			case err == nil:
				winners = append(winners, info)
			case errors.As(err, &dup):
				if !errors.Is(err, ErrDuplicateTask) || !errors.Is(err, asynq.ErrDuplicateTask) {
					others = append(others, fmt.Errorf("duplicate error does not match both sentinels: %w", err))
				}
				dups = append(dups, dup)
			default:
				others = append(others, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(others) > 0 {
		t.Fatalf("unexpected errors: %v", others)
	}
	if len(winners) != 1 || len(dups) != n-1 {
		t.Fatalf("accepted %d, duplicates %d; want 1 and %d", len(winners), len(dups), n-1)
	}
	win := winners[0]
	key := h.keyOf(userTask(42, ""), h.queue, Fields("user_id"))
	for _, d := range dups {
		if d.Holder != win.ID || d.Queue != h.queue || d.Type != "user:reindex" || d.Key != key {
			t.Fatalf("duplicate error %+v does not name the winner %s in %s (key %s)", d, win.ID, h.queue, key)
		}
	}
	if got := h.queueSize(h.queue); got != 1 {
		t.Fatalf("queue holds %d tasks, want 1", got)
	}
	if got := h.lockOwner(key); got != win.ID {
		t.Fatalf("lock owner %q, want %q", got, win.ID)
	}
}

func TestFieldsIgnoreOtherPayload(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	if _, err := h.client.Enqueue(userTask(1, "a"), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(userTask(1, "b"), asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("same user, other trace: err = %v, want duplicate", err)
	}
	if _, err := h.client.Enqueue(userTask(2, "a"), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("other user: %v", err)
	}
	// Without a rule or option the whole payload counts, like asynq.Unique.
	other := asynq.NewTask("other", []byte{0xff, 0x00, 0x01}) // not JSON: raw bytes are fine
	if _, err := h.client.Enqueue(other, asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(asynq.NewTask("other", []byte{0xff, 0x00, 0x02}), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("different raw payload: %v", err)
	}
	if _, err := h.client.Enqueue(other, asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("same raw payload: err = %v, want duplicate", err)
	}
}

func TestBadPayloadLocksAndEnqueuesNothing(t *testing.T) {
	h := newHarness(t, Config{})
	cases := []struct {
		name    string
		payload string
		field   string
		is      error
	}{
		{"not JSON", `user_id=42 secret-token`, "", ErrInvalidPayload},
		{"truncated", `{"user_id": 42, "x": "secret-token`, "", ErrInvalidPayload},
		{"missing field", `{"trace_id": "secret-token"}`, "user_id", ErrFieldMissing},
		{"path through a string", `{"user_id": "secret-token"}`, "user_id.id", ErrFieldMissing},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			field := "user_id"
			if c.field != "" {
				field = c.field
			}
			_, err := h.client.Enqueue(asynq.NewTask("user:reindex", []byte(c.payload)), asynq.Queue(h.queue), Fields(field))
			var pe *PayloadError
			if !errors.As(err, &pe) || !errors.Is(err, ErrInvalidPayload) || !errors.Is(err, c.is) {
				t.Fatalf("err = %v, want a *PayloadError matching %v", err, c.is)
			}
			if pe.Type != "user:reindex" || (c.field != "" && pe.Field != c.field) {
				t.Fatalf("error names type %q field %q", pe.Type, pe.Field)
			}
			if strings.Contains(err.Error(), "secret-token") {
				t.Fatalf("error quotes the payload: %v", err)
			}
		})
	}
	// Missing-as-null only when asked for.
	h2 := newHarness(t, Config{Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}, MissingAsNull: true}}})
	if _, err := h2.client.Enqueue(asynq.NewTask("user:reindex", []byte(`{}`)), asynq.Queue(h2.queue)); err != nil {
		t.Fatalf("missing as null: %v", err)
	}
	if _, err := h2.client.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":null}`)), asynq.Queue(h2.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("explicit null after missing: err = %v, want duplicate", err)
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left behind", n)
	}
	if n := h.queueSize(h.queue); n != 0 {
		t.Fatalf("%d tasks enqueued", n)
	}
}

func TestUniqueAndGroupRefused(t *testing.T) {
	h := newHarness(t, Config{})
	for _, opt := range []asynq.Option{asynq.Unique(time.Minute), asynq.Group("g")} {
		_, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue), opt)
		if !errors.Is(err, ErrInvalidOption) {
			t.Fatalf("%v: err = %v, want ErrInvalidOption", opt, err)
		}
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left behind", n)
	}
	if n := h.queueSize(h.queue); n != 0 {
		t.Fatalf("%d tasks enqueued", n)
	}
	// Opted out, asynq.Unique is asynq's business.
	if _, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue), asynq.Unique(time.Minute), Skip()); err != nil {
		t.Fatalf("Unique with Skip: %v", err)
	}
	if _, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue), asynq.Unique(time.Minute), Skip()); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("asynq.Unique with Skip: err = %v, want asynq's duplicate", err)
	}
}

func TestSkipOptOut(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"noisy": {Skip: true}}})
	for range 2 {
		info, err := h.client.Enqueue(userTask(7, ""), asynq.Queue(h.queue), Skip())
		if err != nil {
			t.Fatal(err)
		}
		if !(store.KindOf(info.ID) == store.IDOptOut) {
			t.Fatalf("opted-out task ID %q is not marked", info.ID)
		}
		if _, err := h.client.Enqueue(asynq.NewTask("noisy", nil), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks taken for opted-out tasks", n)
	}
	if n := h.queueSize(h.queue); n != 4 {
		t.Fatalf("queue holds %d tasks, want 4", n)
	}
}

func TestOptInMode(t *testing.T) {
	h := newHarness(t, Config{OptIn: true, Rules: map[string]Rule{"ruled": {}}})
	for range 2 {
		info, err := h.client.Enqueue(asynq.NewTask("free", []byte("x")), asynq.Queue(h.queue))
		if err != nil {
			t.Fatalf("type without rule in opt-in mode: %v", err)
		}
		// Nothing is deduplicated: the task ID is asynq's own.
		if (store.KindOf(info.ID) == store.IDOptOut) || strings.HasPrefix(info.ID, "d") && strings.Contains(info.ID[:3], "-") {
			t.Fatalf("task ID %q was rewritten for a type that is not deduplicated", info.ID)
		}
	}
	// An explicit Skip still marks its task, so that a guarding server leaves it alone.
	if info, err := h.client.Enqueue(asynq.NewTask("free", []byte("x")), asynq.Queue(h.queue), Skip()); err != nil || !(store.KindOf(info.ID) == store.IDOptOut) {
		t.Fatalf("Skip in opt-in mode: %v, %v: want a dx- task ID", info, err)
	}
	if _, err := h.client.Enqueue(asynq.NewTask("ruled", []byte("x")), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(asynq.NewTask("ruled", []byte("x")), asynq.Queue(h.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("ruled type: err = %v, want duplicate", err)
	}
	if _, err := h.client.Enqueue(asynq.NewTask("free", []byte(`{"k":1}`)), asynq.Queue(h.queue), Fields("k")); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(asynq.NewTask("free", []byte(`{"k":1}`)), asynq.Queue(h.queue), Fields("k")); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("per-call Fields in opt-in mode: err = %v, want duplicate", err)
	}
}

func TestExplicitKeys(t *testing.T) {
	h := newHarness(t, Config{})
	a := asynq.NewTask("report:send", []byte("payload one"))
	b := asynq.NewTask("report:send", []byte("payload two"))
	c := asynq.NewTask("report:other", []byte("payload one"))
	if _, err := h.client.Enqueue(a, asynq.Queue(h.queue), Key("tenant-7")); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(b, asynq.Queue(h.queue), Key("tenant-7")); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("same key, other payload: err = %v, want duplicate", err)
	}
	if _, err := h.client.Enqueue(c, asynq.Queue(h.queue), Key("tenant-7")); err != nil {
		t.Fatalf("same key, other type (namespaced): %v", err)
	}
	// Braces and separators in a key change neither slot nor namespace.
	if _, err := h.client.Enqueue(a, asynq.Queue(h.queue), SharedKey("{x}:y")); err != nil {
		t.Fatal(err)
	}
	if _, err := h.client.Enqueue(c, asynq.Queue(h.queue), SharedKey("{x}:y")); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("shared key across types: err = %v, want duplicate", err)
	}
	for _, k := range h.locks() {
		if !strings.HasPrefix(k, lockKeyHex(h.prefix, h.queue, "")) {
			t.Fatalf("lock key %q is not in the queue's slot", k)
		}
	}
	if _, err := h.client.Enqueue(a, asynq.Queue(h.queue), Key("")); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("empty key: err = %v, want ErrInvalidOption", err)
	}
	// A rule's KeyFunc serves non-JSON payloads.
	h2 := newHarness(t, Config{Rules: map[string]Rule{"bin": {KeyFunc: func(_ string, p []byte) (string, error) {
		if len(p) < 2 {
			return "", errors.New("payload too short")
		}
		return string(p[:2]), nil
	}}}})
	if _, err := h2.client.Enqueue(asynq.NewTask("bin", []byte{1, 2, 3}), asynq.Queue(h2.queue)); err != nil {
		t.Fatal(err)
	}
	if _, err := h2.client.Enqueue(asynq.NewTask("bin", []byte{1, 2, 9}), asynq.Queue(h2.queue)); !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("KeyFunc: err = %v, want duplicate", err)
	}
	if _, err := h2.client.Enqueue(asynq.NewTask("bin", []byte{1}), asynq.Queue(h2.queue)); !errors.Is(err, ErrInvalidPayload) {
		t.Fatalf("KeyFunc error: err = %v, want ErrInvalidPayload", err)
	}
}

func pttl(t *testing.T, rdb redis.UniversalClient, key string) time.Duration {
	t.Helper()
	d, err := rdb.PTTL(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestTTLPrecedence(t *testing.T) {
	h := newHarness(t, Config{TTL: 10 * time.Minute, Rules: map[string]Rule{"ruled": {TTL: 20 * time.Minute}}})
	check := func(task *asynq.Task, want time.Duration, opts ...asynq.Option) {
		t.Helper()
		opts = append(opts, asynq.Queue(h.queue))
		if _, err := h.client.Enqueue(task, opts...); err != nil {
			t.Fatal(err)
		}
		got := pttl(t, h.rdb, h.keyOf(task, h.queue, opts...))
		if got > want || got < want-time.Minute {
			t.Fatalf("%s: lock TTL %v, want about %v", task.Type(), got, want)
		}
	}
	check(asynq.NewTask("plain", nil), 10*time.Minute)
	check(asynq.NewTask("ruled", nil), 20*time.Minute)
	check(asynq.NewTask("ruled", []byte("2")), 30*time.Minute, TTL(30*time.Minute))
	check(asynq.NewTask("plain", []byte("in")), 70*time.Minute, asynq.ProcessIn(time.Hour))
	check(asynq.NewTask("plain", []byte("at")), 130*time.Minute, asynq.ProcessAt(time.Now().Add(2*time.Hour)))
	// A delay set in NewTask is only seen afterwards; the lock still covers it.
	check(asynq.NewTask("plain", []byte("nt"), asynq.ProcessIn(3*time.Hour)), 190*time.Minute)
	if _, err := h.client.Enqueue(asynq.NewTask("plain", []byte("neg")), asynq.Queue(h.queue), TTL(-time.Second)); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("negative TTL: err = %v", err)
	}
}

func TestCallerTaskIDHonoured(t *testing.T) {
	h := newHarness(t, Config{})
	info, err := h.client.Enqueue(userTask(5, ""), asynq.Queue(h.queue), asynq.TaskID("my-own-id"))
	if err != nil {
		t.Fatal(err)
	}
	if info.ID != "my-own-id" {
		t.Fatalf("task ID %q, want my-own-id", info.ID)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(userTask(5, ""), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != "my-own-id" {
		t.Fatalf("duplicate of a caller-ID task: err = %v", err)
	}
	if ti, err := h.insp.GetTaskInfo(h.queue, "my-own-id"); err != nil || ti.Headers[store.HeaderLock] == "" {
		t.Fatalf("the caller-chosen ID's task carries no lock header (%v): the middleware would take it for a task that arrived without a lock", err)
	}
}

// failingEnqueuer refuses every task without storing it.
type failingEnqueuer struct{ err error }

func (f failingEnqueuer) Enqueue(t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	return f.EnqueueContext(context.Background(), t, o...)
}
func (f failingEnqueuer) EnqueueContext(context.Context, *asynq.Task, ...asynq.Option) (*asynq.TaskInfo, error) {
	return nil, f.err
}

// landedButErrs stores the task, then reports an error, as when go-redis
// retried an enqueue that had landed and asynq answered ErrTaskIDConflict.
type landedButErrs struct{ c *asynq.Client }

func (l landedButErrs) Enqueue(t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	return l.EnqueueContext(context.Background(), t, o...)
}
func (l landedButErrs) EnqueueContext(ctx context.Context, t *asynq.Task, o ...asynq.Option) (*asynq.TaskInfo, error) {
	if _, err := l.c.EnqueueContext(ctx, t, o...); err != nil {
		return nil, err
	}
	return l.c.EnqueueContext(ctx, t, o...) // the "retry": conflicts with itself
}

func TestRollbackAfterRefusedEnqueue(t *testing.T) {
	h := newHarness(t, Config{})
	boom := errors.New("boom")
	fc := h.d.WrapClient(failingEnqueuer{boom})
	_, err := fc.Enqueue(userTask(1, ""), asynq.Queue(h.queue))
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left after a refused enqueue", n)
	}
	if _, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after rollback: %v", err)
	}
	// A real refusal by asynq: the caller's ID belongs to another task.
	if _, err := h.asynq.Enqueue(asynq.NewTask("unrelated", nil), asynq.Queue(h.queue), asynq.TaskID("taken")); err != nil {
		t.Fatal(err)
	}
	_, err = h.client.Enqueue(userTask(2, ""), asynq.Queue(h.queue), asynq.TaskID("taken"))
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		t.Fatalf("err = %v, want ErrTaskIDConflict", err)
	}
	if owner := h.lockOwner(h.keyOf(userTask(2, ""), h.queue)); owner != "" {
		t.Fatalf("lock left with owner %q", owner)
	}
	// (The taken ID is refused before any lock is taken: no rollback for it.)
	if s := h.d.Stats(); s.Rollbacks != 1 {
		t.Fatalf("Rollbacks = %d, want 1", s.Rollbacks)
	}
}

func TestAmbiguousEnqueueKeepsLock(t *testing.T) {
	h := newHarness(t, Config{})
	lc := h.d.WrapClient(landedButErrs{h.asynq})
	info, err := lc.Enqueue(userTask(3, ""), asynq.Queue(h.queue))
	if err != nil {
		t.Fatalf("landed enqueue reported as %v", err)
	}
	if owner := h.lockOwner(h.keyOf(userTask(3, ""), h.queue)); owner != info.ID {
		t.Fatalf("lock owner %q, want %q", owner, info.ID)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(userTask(3, ""), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("err = %v, want duplicate of %s", err, info.ID)
	}
}

func TestQueueSetInNewTask(t *testing.T) {
	h := newHarness(t, Config{})
	other := h.queue + "-other"
	task := asynq.NewTask("user:reindex", []byte(`{"user_id":9}`), asynq.Queue(other))
	info, err := h.client.Enqueue(task)
	if err != nil {
		t.Fatal(err)
	}
	if info.Queue != other {
		t.Fatalf("landed in %q", info.Queue)
	}
	if owner := h.lockOwner(h.keyOf(task, other)); owner != info.ID {
		t.Fatalf("lock in the task's queue owned by %q, want %q", owner, info.ID)
	}
	if owner := h.lockOwner(h.keyOf(task, "default")); owner != "" {
		t.Fatalf("lock left in the default queue, owner %q", owner)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Enqueue(task); !errors.As(err, &dup) || dup.Holder != info.ID || dup.Queue != other {
		t.Fatalf("err = %v, want duplicate of %s in %s", err, info.ID, other)
	}
	// A duplicate that lands in a queue other than the one guessed is taken back out.
	h2 := newHarnessOn(t, h.rdb, Config{Prefix: h.prefix})
	_, err = h2.client.Enqueue(task)
	if !errors.As(err, &dup) || dup.Holder != info.ID {
		t.Fatalf("fresh client, duplicate in NewTask's queue: err = %v", err)
	}
	if n := h.queueSize(other); n != 1 {
		t.Fatalf("queue %s holds %d tasks, want 1", other, n)
	}
}

func TestNewErrors(t *testing.T) {
	if _, err := New(context.Background(), nil, Config{}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("nil client: %v", err)
	}
	rdb := newRDB(t)
	if _, err := New(context.Background(), rdb, Config{Prefix: "a{b"}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("brace in prefix: %v", err)
	}
	if _, err := New(context.Background(), rdb, Config{Rules: map[string]Rule{"t": {Fields: []string{"a..b"}}}}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("bad field path: %v", err)
	}
	for _, name := range []string{"", " "} {
		if _, err := New(context.Background(), rdb, Config{Rules: map[string]Rule{name: {}}}); !errors.Is(err, ErrInvalidOption) {
			t.Fatalf("rule named %q (a prefix of every type): %v", name, err)
		}
	}
	if _, err := New(context.Background(), rdb, Config{Rules: map[string]Rule{"t": {OnBusy: Busy(9)}}}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("unknown OnBusy: %v", err)
	}
	addr := "127.0.0.1:1"       // nothing listens on port 1 (a free port could be taken meanwhile by another package's redis-server)
	if redistest.Addr() != "" { // miniredis serves its connections with goroutines of its own
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent()) // failed attempts leave nothing running
	}
	dead := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer dead.Close()
	_, err := New(context.Background(), dead, Config{connectAttempts: 3, connectBackoff: backoff{Min: time.Millisecond, Max: 4 * time.Millisecond}, Logger: quietLogger()})
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "3 attempts") {
		t.Fatalf("unreachable: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := New(ctx, dead, Config{Logger: quietLogger()}); !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
}

func TestRedisDownFailClosedAndOpen(t *testing.T) {
	t.Parallel()
	needRealRedis(t)
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%v", open), func(t *testing.T) {
			h := newHarness(t, Config{})
			lockRedis, d := proxiedLockStore(t, h, Config{FailOpen: open})
			c := d.WrapClient(h.asynq) // locks through the proxy, tasks direct
			if _, err := c.Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
			lockRedis.close()
			_, err := c.Enqueue(userTask(2, ""), asynq.Queue(h.queue))
			if open {
				if err != nil {
					t.Fatalf("fail-open enqueue: %v", err)
				}
				if s := d.Stats(); s.FailOpen != 1 || s.RedisErrors != 1 {
					t.Fatalf("stats %+v", s)
				}
				if n := h.queueSize(h.queue); n != 2 {
					t.Fatalf("queue holds %d, want 2", n)
				}
				return
			}
			var ne interface{ Timeout() bool }
			if !errors.Is(err, ErrUnavailable) || !(errors.As(err, &ne) || strings.Contains(err.Error(), "connection refused")) {
				t.Fatalf("fail-closed: err = %v, want ErrUnavailable wrapping the Redis error", err)
			}
			if n := h.queueSize(h.queue); n != 1 {
				t.Fatalf("queue holds %d, want 1 (nothing enqueued while the lock store is down)", n)
			}
		})
	}
}

// Per-call key options follow a Rule's precedence whatever their order: an
// explicit key beats fields; Key and SharedKey together are refused.
func TestCallKeyBeatsCallFieldsWhateverTheOrder(t *testing.T) {
	h := newHarness(t, Config{})
	byKey := h.keyOf(userTask(1, ""), h.queue, Key("tenant-7"))
	for name, opts := range map[string][]asynq.Option{
		"Key, Fields": {Key("tenant-7"), Fields("user_id")},
		"Fields, Key": {Fields("user_id"), Key("tenant-7")},
	} {
		if got := h.keyOf(userTask(1, ""), h.queue, opts...); got != byKey {
			t.Errorf("%s: lock key %s, want the explicit key's %s", name, got, byKey)
		}
	}
	first := h.enqueue(userTask(1, ""), Fields("user_id"), Key("tenant-7"))
	if dup := h.duplicateOf(userTask(2, ""), Key("tenant-7"), Fields("user_id")); dup.Holder != first.ID {
		t.Fatalf("another user under the same explicit key: duplicate of %s, want %s", dup.Holder, first.ID)
	}
	for _, opts := range [][]asynq.Option{{Key("a"), SharedKey("a")}, {SharedKey("a"), Key("a")}, {Key("a"), Key("b")}} {
		if _, err := h.client.Enqueue(userTask(3, ""), append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%v: err = %v, want ErrInvalidOption", opts, err)
		}
	}
	if l := h.locks(); len(l) != 1 {
		t.Fatalf("locks %v, want the first task's only", l)
	}
}

// Rules match task types as asynq's ServeMux matches patterns: exactly,
// else by the longest name the type begins with.
func TestRulesMatchTypePrefixesLikeServeMux(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"email:":         {Fields: []string{"to"}},
		"email:welcome":  {Skip: true},
		"email:digest:w": {Key: "weekly"},
	}})
	mail := func(typ, to, trace string) *asynq.Task {
		return asynq.NewTask(typ, []byte(`{"to":"`+to+`","trace":"`+trace+`"}`))
	}
	first := h.enqueue(mail("email:reset", "a@x", "1"))
	if dup := h.duplicateOf(mail("email:reset", "a@x", "2")); dup.Holder != first.ID {
		t.Fatalf("email:reset keyed by the \"email:\" rule's field: duplicate of %s, want %s", dup.Holder, first.ID)
	}
	h.enqueue(mail("email:welcome", "a@x", "1"))
	h.enqueue(mail("email:welcome", "a@x", "1")) // the exact rule wins: Skip
	weekly := h.enqueue(mail("email:digest:weekly", "a@x", "1"))
	if dup := h.duplicateOf(mail("email:digest:weekly", "b@x", "2")); dup.Holder != weekly.ID {
		t.Fatalf("the longest prefix wins (Key): duplicate of %s, want %s", dup.Holder, weekly.ID)
	}
	h.enqueue(mail("emailer", "a@x", "1"))
	h.enqueue(mail("emailer", "a@x", "2")) // no rule: the whole payload, which differs
}

// A Client stands where an *asynq.Client stood: Close and Ping included.
func TestClientIsDropInForAsynqClient(t *testing.T) {
	var _ interface {
		Enqueuer
		Close() error
		Ping() error
	} = (*Client)(nil)
	needRealRedis(t)
	h := newHarness(t, Config{})
	ac := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr()})
	c := h.d.WrapClient(ac)
	if err := c.Ping(); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := ac.Ping(); err == nil {
		t.Fatal("the wrapped asynq client still answers after Close")
	}
	if err := h.d.NewClient().Close(); err != nil {
		t.Fatalf("Close of NewClient's client: %v", err)
	}
	// The Dedup's Redis client stays open: NewClient's asynq client shares it.
	if _, err := h.d.NewClient().Enqueue(userTask(1, ""), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after closing another Client: %v", err)
	}
}

// NewFromRedisConnOpt builds the Dedup from asynq's own connection option,
// owns that client and closes it; bad options are refused.
func TestNewFromRedisConnOpt(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	if _, err := NewFromRedisConnOpt(ctx, nil, Config{}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("nil option: %v", err)
	}
	name := uniq(t)
	opt := asynq.RedisClientOpt{Addr: redistest.Addr()}
	d, err := NewFromRedisConnOpt(ctx, opt, Config{Prefix: "dd-" + name, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ac := asynq.NewClient(opt)
	defer ac.Close()
	c := d.WrapClient(ac)
	first, err := c.Enqueue(userTask(1, ""), asynq.Queue("q-"+name))
	if err != nil {
		t.Fatal(err)
	}
	var dup *DuplicateTaskError
	if _, err := c.Enqueue(userTask(1, ""), asynq.Queue("q-"+name)); !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("duplicate: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := d.rdb.Ping(ctx).Err(); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("the Dedup's own client after Close: %v, want closed", err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	// Port 1: nothing listens there (a port from freeAddr could be taken
	// meanwhile by a redis-server another test package starts).
	if _, err := NewFromRedisConnOpt(ctx, asynq.RedisClientOpt{Addr: "127.0.0.1:1"}, Config{connectAttempts: 1, Logger: quietLogger()}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("unreachable: %v", err)
	}
}

// The Go lock API: Lookup names the key's holder as an enqueue would find
// it; Release frees the key, owner-checked or forced, and never a task.
func TestLookupAndReleaseAKey(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	h.client = h.d.NewClient()
	ctx := context.Background()
	task := userTask(42, "a")
	if _, found, err := h.d.Lookup(ctx, task, asynq.Queue(h.queue)); err != nil || found {
		t.Fatalf("free key: found %v, %v", found, err)
	}
	first := h.enqueue(task)
	l, found, err := h.d.Lookup(ctx, userTask(42, "other trace"), asynq.Queue(h.queue))
	if err != nil || !found || l.Holder != first.ID || l.State != "waiting" || l.Queue != h.queue || l.Key != h.keyOf(task, h.queue) || l.TTL <= 0 {
		t.Fatalf("Lookup: %+v %v %v; want held by %s, waiting", l, found, err, first.ID)
	}
	if _, err := h.d.Release(ctx, task, "someone-else", asynq.Queue(h.queue)); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("release for another holder: %v, want ErrNotHolder", err)
	}
	if ok, err := h.d.Release(ctx, task, first.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("owner-checked release: %v %v", ok, err)
	}
	if h.taskState(first.ID) != asynq.TaskStatePending {
		t.Fatal("Release deleted the task")
	}
	second := h.enqueue(userTask(42, "b")) // the key is free again
	if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || ok {
		t.Fatalf("release of a free key: %v %v, want false", ok, err)
	}
	third := h.enqueue(userTask(42, "c"))
	if second.ID == third.ID {
		t.Fatal("no new task after the forced release")
	}
	if _, _, err := h.d.Lookup(ctx, asynq.NewTask("user:reindex", []byte(`{}`)), asynq.Queue(h.queue)); !errors.Is(err, ErrInvalidPayload) {
		t.Fatalf("payload without the key's field: %v", err)
	}
	if _, _, err := h.d.Lookup(ctx, task, Skip()); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("a task without deduplication: %v", err)
	}
}

// QueueOf names the queue Submit would use: the call's, else NewTask's,
// else "default".
func TestQueueOfIsTheQueueSubmitUses(t *testing.T) {
	h := newHarness(t, Config{})
	for _, tc := range []struct {
		task *asynq.Task
		opts []asynq.Option
		want string
	}{
		{asynq.NewTask("q:of", nil), nil, "default"},
		{asynq.NewTask("q:of", nil, asynq.Queue("from-task")), nil, "from-task"},
		{asynq.NewTask("q:of", nil, asynq.Queue("from-task")), []asynq.Option{asynq.Queue("from-call")}, "from-call"},
		{asynq.NewTask("q:of", nil), []asynq.Option{asynq.Queue(" ")}, "default"}, // refused by Submit
	} {
		if got := h.d.queueOf(tc.task, tc.opts...); got != tc.want {
			t.Errorf("QueueOf(%v) = %q, want %q", tc.opts, got, tc.want)
		}
	}
	info, err := h.d.NewClient().Enqueue(asynq.NewTask("q:of", []byte("x"), asynq.Queue(h.queue)))
	if err != nil || info.Queue != h.d.queueOf(asynq.NewTask("q:of", nil, asynq.Queue(h.queue))) {
		t.Fatalf("Enqueue to %v (%v), QueueOf says %q", info, err, h.queue)
	}
}

// asynq's client refuses asynq.TaskID("") ("task ID cannot be empty"), so
// the Client does too: ErrInvalidOption, nothing locked, nothing stored, on
// both paths, also when an earlier TaskID option is overridden by an empty
// one. (Once, the direct path stored such a task under a dd- ID and answered
// created, and the wrap path took the lock, met asynq's refusal and rolled
// back with another error.)
func TestEmptyCallerTaskIDIsRefusedAsAsynqRefusesIt(t *testing.T) {
	bothPaths(t, Config{}, func(t *testing.T, h *harness) {
		if _, err := h.asynq.Enqueue(userTask(9, ""), asynq.Queue(h.queue), asynq.TaskID("")); err == nil {
			t.Fatal("asynq's own client accepts TaskID(\"\")?")
		}
		for i, opts := range [][]asynq.Option{
			{asynq.TaskID("")},
			{asynq.TaskID("mine"), asynq.TaskID("")}, // the last one wins in asynq too, and is refused
		} {
			info, err := h.client.Enqueue(userTask(i+1, ""), append([]asynq.Option{asynq.Queue(h.queue)}, opts...)...)
			if !errors.Is(err, ErrInvalidOption) {
				id := ""
				if info != nil {
					id = info.ID
				}
				t.Errorf("case %d: TaskID(\"\"): err = %v (task %q), want ErrInvalidOption as asynq refuses it", i, err, id)
			}
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Errorf("%d tasks stored for calls asynq's client refuses", n)
		}
	})
}

// asynq.NewTask keeps a nil option, and asynq's client ignores it. The
// Client answers such a task as asynq's client does (enqueued), or with an
// error, but never panics. (Once, checkTask called Value() on every option
// of NewTask, and a nil one panicked.)
func TestNilOptionInNewTaskDoesNotPanic(t *testing.T) {
	bothPaths(t, Config{}, func(t *testing.T, h *harness) {
		var nilOpt asynq.Option
		if _, err := h.asynq.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":7}`), nilOpt), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("asynq's client: %v", err)
		}
		var (
			err      error
			panicked any
		)
		func() {
			defer func() { panicked = recover() }()
			_, err = h.client.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":8}`), nilOpt), asynq.Queue(h.queue))
		}()
		if panicked != nil {
			t.Fatalf("Enqueue of a task with a nil NewTask option panicked: %v", panicked)
		}
		if err != nil {
			t.Logf("refused: %v", err)
		}
	})
}

// Lookup reads the key an enqueue would take. For a task whose queue comes
// from asynq.NewTask, another process's enqueue is refused as a duplicate
// of the holder there; its Lookup must find that holder too, and its
// Release must not report the held key free.
func TestLookupHonoursTheQueueInNewTask(t *testing.T) {
	h := newHarness(t, Config{})
	ctx := context.Background()
	task := asynq.NewTask("user:reindex", userTask(9, "").Payload(), asynq.Queue(h.queue))
	first, err := h.client.Enqueue(task)
	if err != nil || first.Queue != h.queue {
		t.Fatalf("first: %+v %v", first, err)
	}
	other := newHarnessOn(t, newRDB(t), Config{Prefix: h.prefix}) // another process
	l, found, err := other.d.Lookup(ctx, task)
	if err != nil || !found || l.Holder != first.ID {
		// Show what an enqueue from that process does with the same task.
		_, eerr := other.client.Enqueue(task)
		t.Fatalf("Lookup: %+v found=%v err=%v; want held by %s (an enqueue of it from the same process: %v)", l, found, err, first.ID, eerr)
	}
}

// connOpt is an asynq.RedisConnOpt of the caller's own.
type connOpt struct{ c any }

func (o connOpt) MakeRedisClient() any { return o.c }

// A RedisConnOpt that makes a nil client is bad input: ErrInvalidOption,
// not a panic.
func TestNewFromRedisConnOptWithANilClientIsInvalid(t *testing.T) {
	for name, c := range map[string]any{"untyped nil": nil, "typed nil": (*redis.Client)(nil)} {
		t.Run(name, func(t *testing.T) {
			var err error
			func() {
				defer func() {
					if r := recover(); r != nil {
						err = fmt.Errorf("panic: %v", r)
					}
				}()
				_, err = NewFromRedisConnOpt(context.Background(), connOpt{c}, Config{connectAttempts: 1, Logger: quietLogger()})
			}()
			if !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("err = %v, want ErrInvalidOption", err)
			}
		})
	}
}

// lossProxy forwards a connection's commands to Redis. Armed, the first
// chunk that match selects is forwarded, its reply is dropped and the
// connection closed (the node died right after running the call); then the
// next `refuse` retries of that call (chunks match selects) are answered
// "-LOADING ..." (the node restarted and loads its data set); other calls
// pass.
type lossProxy struct {
	ln      net.Listener
	target  string
	armed   atomic.Bool
	loading atomic.Int64
	match   func([]byte) bool
	fired   chan struct{}
	once    sync.Once
	refuse  int64 // LOADING replies after the lost one
}

func newLossProxy(t *testing.T, target string, match func([]byte) bool) *lossProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lossProxy{ln: ln, target: target, match: match, fired: make(chan struct{}), refuse: 20}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *lossProxy) addr() string { return p.ln.Addr().String() }

// respCommands counts the complete RESP commands (arrays of bulk strings)
// in b.
func respCommands(b []byte) int {
	n := 0
	for len(b) > 0 {
		if b[0] != '*' {
			return n + 1
		}
		i := bytes.Index(b, []byte("\r\n"))
		if i < 0 {
			return n
		}
		args, _ := strconv.Atoi(string(b[1:i]))
		b = b[i+2:]
		for range args {
			j := bytes.Index(b, []byte("\r\n"))
			if j < 0 || b[0] != '$' {
				return n
			}
			l, _ := strconv.Atoi(string(b[1:j]))
			if len(b) < j+2+l+2 {
				return n
			}
			b = b[j+2+l+2:]
		}
		n++
	}
	return n
}

func (p *lossProxy) serve(c net.Conn) {
	defer c.Close()
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer s.Close()
	var drop atomic.Bool
	answered := make(chan struct{}, 1) // Redis answered the call whose reply is dropped
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 && drop.Load() {
				select {
				case answered <- struct{}{}:
				default:
				}
			}
			if n > 0 && !drop.Load() {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				_ = c.Close()
				return
			}
		}
	}()
	buf := make([]byte, 256<<10)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return
		}
		chunk := buf[:n]
		if left := p.loading.Load(); left > 0 && p.match(chunk) { // retries of the lost call only
			k := int64(respCommands(chunk))
			p.loading.Add(-k)
			for range k {
				if _, err := c.Write([]byte("-LOADING Redis is loading the dataset in memory\r\n")); err != nil {
					return
				}
			}
			continue
		}
		if p.armed.Load() && p.match(chunk) && p.armed.CompareAndSwap(true, false) {
			drop.Store(true)
			_, _ = s.Write(chunk)
			// Let Redis run it and answer (the answer is dropped).
			select {
			case <-answered:
			case <-time.After(2 * time.Second):
			}
			p.loading.Store(p.refuse) // go-redis's retries meet LOADING
			p.once.Do(func() { close(p.fired) })
			return // closes the client's connection: EOF, retried by go-redis
		}
		if _, err := s.Write(chunk); err != nil {
			return
		}
	}
}

// A NewClient enqueue whose script ran but whose reply was lost (the node
// died right after), and whose retries by go-redis then met LOADING (the
// node restarting), must not be reported as a plain failure ("stored
// nothing"): the task is stored. README: "none of the tasks reported failed
// was stored"; a refused call is "not stored" only if it was never run.
func TestLostReplyRetriedIntoLoadingIsOutcomeUnknown(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5r-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool {
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte(prefix+":{"))
	})
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true}) // go-redis defaults: MaxRetries 3
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	q := "a5r-" + uniq(t)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	id := "a5-" + uniq(t)
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"x"}`)), asynq.Queue(q), asynq.TaskID(id))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw the script (err %v)", err)
	}
	direct := newRDB(t)
	stored, xerr := direct.Exists(ctx, store.TaskKey(q, id)).Result()
	if xerr != nil {
		t.Fatal(xerr)
	}
	t.Logf("enqueue error: %v; stored: %v", err, stored == 1)
	if err != nil && !errors.Is(err, ErrOutcomeUnknown) && stored == 1 {
		t.Fatalf("enqueue reported failed (%v), not ErrOutcomeUnknown, but task %s is stored: "+
			"go-redis ran the script, lost the reply, retried and met LOADING; NotRun trusted the last error", err, id)
	}
}

// The same loss, but the node serves again at once: go-redis's retry of
// the NewClient script meets the task its first run stored, and the
// script answers "the ID exists". That task is the caller's own (same
// type, same payload, its lock): the answer must be created (or outcome
// unknown), not a refusal saying another task holds the ID.
func TestLostReplyRetriedMeetsItsOwnTaskNotAConflict(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5c-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool {
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte(prefix+":{"))
	})
	proxy.refuse = 0
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	q := "a5c-" + uniq(t)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	id := "a5-" + uniq(t)
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"x"}`)), asynq.Queue(q), asynq.TaskID(id))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw the script (err %v)", err)
	}
	ti, ierr := asynq.NewInspectorFromRedisClient(newRDB(t)).GetTaskInfo(q, id)
	if ierr != nil {
		t.Skipf("task not stored (%v), enqueue %v: no case", ierr, err)
	}
	if err != nil && !errors.Is(err, ErrOutcomeUnknown) {
		t.Fatalf("enqueue of %s answered %v, but the task stored under that ID is this very call's (%s %s, state %v)",
			id, err, ti.Type, ti.Payload, ti.State)
	}
}

// The same through WrapClient: asynq's enqueue script ran (the task is
// stored), the reply was lost and go-redis's retries met LOADING, so asynq
// answers "redis eval error: LOADING ...". The rollback must not give the
// lock back without asking: the stored task would run with no lock, and
// the next enqueue of its key would be admitted, a duplicate.
func TestLostReplyOfAsynqsEnqueueKeepsTheLock(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5w-" + uniq(t)
	q := "a5w-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool { // asynq's enqueue script (WrapClient's lock script names no pending list)
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte("asynq:{"+q+"}:pending"))
	})
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ac := asynq.NewClientFromRedisClient(rdb)
	client := d.WrapClient(ac)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	task := asynq.NewTask("a5:job", []byte(`{"k":"x"}`))
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, task, asynq.Queue(q))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw asynq's script (err %v)", err)
	}
	t.Logf("first enqueue: %v", err)
	insp := asynq.NewInspectorFromRedisClient(newRDB(t))
	pending, _ := insp.ListPendingTasks(q)
	n := 0
	for _, ti := range pending {
		if string(ti.Payload) == `{"k":"x"}` {
			n++
		}
	}
	if n == 0 {
		t.Skipf("asynq's script did not store the task (err %v): no case", err)
	}
	proxy.loading.Store(0) // the node serves again
	locks, _ := newRDB(t).Keys(ctx, store.NewKeys(prefix).LockPattern("")).Result()
	t.Logf("after the first enqueue: %d stored, locks %v (one is the warm-up task's)", n, locks)
	if len(locks) < 2 {
		t.Errorf("the stored task's lock was given back: its key is unguarded while the task waits")
	}
	// The task of the key is stored; its duplicate must be refused.
	info, err2 := client.EnqueueContext(ctx, task, asynq.Queue(q))
	t.Logf("second enqueue: %v", err2)
	pending, _ = insp.ListPendingTasks(q)
	n = 0
	for _, ti := range pending {
		if string(ti.Payload) == `{"k":"x"}` {
			n++
		}
	}
	if n > 1 {
		t.Fatalf("duplicate admitted: %d stored tasks of one key (second enqueue: %v, %v); the first enqueue's error %q was taken "+
			"for 'not run' and its lock given back though asynq had stored the task", n, info, err2, err)
	}
}

// A WrapClient lock counted under MaxPending whose asynq enqueue is refused
// (its caller-chosen ID is taken) gives its waiting-set slot back: the next
// key of the type is admitted.
func TestRollbackFreesTheWaitingSlot(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	rdb := newRDB(t)
	d, err := New(ctx, rdb, Config{Prefix: "a5m-" + uniq(t), Logger: quietLogger(),
		Rules: map[string]Rule{"a5:bounded": {MaxPending: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	q := "a5m-" + uniq(t)
	ac := asynq.NewClientFromRedisClient(rdb)
	taken := "a5-taken-" + uniq(t)
	if _, err := ac.EnqueueContext(ctx, asynq.NewTask("other", nil), asynq.Queue(q), asynq.TaskID(taken)); err != nil {
		t.Fatal(err)
	}
	client := d.WrapClient(ac)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:bounded", []byte(`{"k":1}`)), asynq.Queue(q), asynq.TaskID(taken))
	if err == nil {
		t.Fatal("enqueue under a taken ID succeeded")
	}
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:bounded", []byte(`{"k":2}`)), asynq.Queue(q)); err != nil {
		t.Fatalf("the refused enqueue kept its waiting slot: %v", err)
	}
}

// A caller-chosen ID of the library's own form is refused; one only shaped
// like it (the earlier layout's dd-<fingerprint>-<random>, copied from an
// old TaskInfo) is a caller's ID like any: its task runs under its key, and
// another, never enqueued, key stays free.
func TestCallerIDShapedLikeAnOldLibraryIDIsTheCallers(t *testing.T) {
	h := newHarness(t, counterRules(Rule{}))
	ctx := context.Background()
	if _, err := h.client.Enqueue(counterTask("b", 1, 1), asynq.Queue(h.queue), asynq.TaskID(store.NewPlainID())); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("caller-chosen ID of the library's own form: %v, want ErrInvalidOption", err)
	}
	keyA := h.keyOf(counterTask("a", 1, 1), h.queue)
	own := "dd-" + fpOfLock(keyA) + "-0123456789abcdef0123"
	info := h.enqueue(counterTask("b", 1, 1), asynq.TaskID(own))
	if info.ID != own {
		t.Fatalf("caller-chosen ID not honoured: %s", info.ID)
	}
	tr := newKeyTracker(counterKeyOf, 1)
	h.serve(tr.handler(nil), nil)
	t.Cleanup(tr.openAll) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	waitFor(t, tr.starts, "key b runs")
	if l, found, err := h.d.Lookup(ctx, counterTask("b", 1, 1), asynq.Queue(h.queue)); err != nil || !found || l.State != "running" {
		t.Errorf("key b's lock while its task runs: %+v found=%v err=%v, want running", l, found, err)
	}
	if _, err := h.client.Submit(ctx, counterTask("a", 1, 2), asynq.Queue(h.queue)); err != nil {
		t.Errorf("key a was never enqueued, but its first enqueue got: %v", err)
	}
}

// README: "*dedup.Client has Enqueue, EnqueueContext, Close and Ping, as
// *asynq.Client does"; Skip: "off … no lock at enqueue or at execution";
// OptIn: "only deduplicate types with a rule". Where deduplication is off,
// a task ID given to asynq.NewTask must keep asynq's meaning: the task is
// stored under it, and a second enqueue of that ID is refused with
// asynq.ErrTaskIDConflict, as asynq's own client does.
func TestNewTaskIDHonouredWhereDedupIsOff(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		opts []asynq.Option
	}{
		{"Skip", Config{}, []asynq.Option{Skip()}},
		{"OptIn, type without a rule", Config{OptIn: true}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, c.cfg)
			id := "order-" + uniq(t)
			task := asynq.NewTask("a6:plain", []byte(`{"n":1}`), asynq.TaskID(id), asynq.Queue(h.queue))
			// What asynq's own client does with it, in another queue.
			other := asynq.NewTask("a6:plain", []byte(`{"n":1}`), asynq.TaskID(id), asynq.Queue(h.queue+"-asynq"))
			if _, err := h.asynq.Enqueue(other); err != nil {
				t.Fatal(err)
			}
			if _, err := h.asynq.Enqueue(other); !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Fatalf("asynq's client, same ID again: %v", err)
			}
			info, err := h.client.Enqueue(task, c.opts...)
			if err != nil {
				t.Fatal(err)
			}
			if info.ID != id {
				t.Errorf("stored under ID %q, want NewTask's %q", info.ID, id)
			}
			if _, err := h.client.Enqueue(task, c.opts...); !errors.Is(err, asynq.ErrTaskIDConflict) {
				t.Errorf("same NewTask ID again: err = %v, want asynq.ErrTaskIDConflict (as *asynq.Client)", err)
			}
			if n := h.queueSize(h.queue); n != 1 {
				t.Errorf("%d tasks stored for one task ID", n)
			}
		})
	}
}

// README: "asynq refuses the enqueue → given back, owner-checked";
// "once no task with an ID exists the ID can be used again … as asynq's
// own client allows" (so while its record exists, it cannot); the matrix:
// after "SkipRetry → archived", a second enqueue of the key gets "new task".
// Re-enqueueing under the ID of an archived task (same payload) must be
// refused as asynq refuses it (both paths alike), and must leave the key
// free for the next enqueue.
func TestReEnqueueUnderAnArchivedTasksIDIsRefusedLikeAsynq(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		id := "job-" + uniq(t)
		key := h.keyOf(counterTask("k", 1, 1), h.queue)
		tr := newKeyTracker(counterKeyOf)
		h.serve(tr.handler(func(r keyRun) error {
			if r.seq == 1 {
				return fmt.Errorf("bad input: %w", asynq.SkipRetry)
			}
			return nil
		}), nil)
		h.enqueue(counterTask("k", 1, 1), asynq.TaskID(id))
		// (An archived task keeps its lock, orphaned: the key's next enqueue heals it.)
		eventually(t, "the task is archived and its key orphaned", func() bool {
			return h.taskState(id) == asynq.TaskStateArchived && h.lockState(key) == store.LockOrphaned
		})
		res, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue), asynq.TaskID(id))
		if !errors.Is(err, asynq.ErrTaskIDConflict) {
			t.Errorf("re-enqueue under the archived task's ID: %+v (state %v), %v; want asynq.ErrTaskIDConflict, as asynq's client answers",
				res, stateOf(res), err)
		}
		if st := h.lockState(key); st != "" && st != store.LockOrphaned {
			t.Errorf("the refused re-enqueue left a lock %s (held by %s)", st, h.lockOwner(key))
		}
		if _, err := h.client.Submit(ctx, counterTask("k", 1, 2), asynq.Queue(h.queue)); err != nil {
			t.Errorf("next enqueue of the key after its task was archived: %v, want a new task", err)
		}
	})
}

func stateOf(res Result) string {
	if res.Info == nil || res.Info.State == 0 {
		return "-"
	}
	return res.Info.State.String()
}

// README: "one Lua script takes the lock or returns the holder: never an
// empty holder". Many goroutines enqueue one new key at once, on both
// paths: exactly one task, and every other call names it.
func TestConcurrentFirstEnqueuesMakeOneTaskOnBothPaths(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		const n = 32
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			created []string
			holders = map[string]int{}
			other   []error
		)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				res, err := h.client.Submit(ctx, counterTask("k", 1, i), asynq.Queue(h.queue))
				mu.Lock()
				defer mu.Unlock()
				var dup *DuplicateTaskError
				switch {
				case err == nil:
					created = append(created, res.TaskID)
				case errors.As(err, &dup):
					holders[dup.Holder]++
				default:
					other = append(other, err)
				}
			})
		}
		close(start)
		wg.Wait()
		if len(other) > 0 {
			t.Errorf("unexpected errors: %v", other)
		}
		if len(created) != 1 {
			t.Fatalf("created %v, want exactly one task", created)
		}
		if len(holders) != 1 || holders[created[0]] != n-1 {
			t.Errorf("duplicates named %v, want %s %d times", holders, created[0], n-1)
		}
		if q := h.queueSize(h.queue); q != 1 {
			t.Errorf("%d tasks stored", q)
		}
	})
}

// IDs of the library's own forms (dd-, dx-, df-, dk- and 20 hex digits;
// da-<fingerprint>-…; a leading '~') are what the middleware reads a task's
// lock from, so a caller may not choose one: ErrInvalidOption before any
// lock is taken or task stored, whether given to the call or to
// asynq.NewTask, on both paths, with Skip() too. Any other ID is the
// caller's, even one that resembles an old form.
func TestOwnIDFormsAreRefusedBeforeAnyLock(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		task := counterTask("k", 1, 0)
		fp := fpOfKey(h.keyOf(task, h.queue))
		rnd := "0123456789abcdef0123"
		for _, id := range []string{"dd-" + rnd, "dx-" + rnd, "df-" + rnd, "dk-" + rnd, "da-" + fp + "-" + rnd, "~w1:x"} {
			for _, viaNewTask := range []bool{false, true} {
				for _, skip := range []bool{false, true} {
					tk, opts := task, []asynq.Option{asynq.Queue(h.queue)}
					if viaNewTask {
						tk = asynq.NewTask(task.Type(), task.Payload(), asynq.TaskID(id))
					} else {
						opts = append(opts, asynq.TaskID(id))
					}
					if skip {
						opts = append(opts, Skip())
					}
					if _, err := h.client.Submit(ctx, tk, opts...); !errors.Is(err, ErrInvalidOption) {
						t.Errorf("caller ID %q (NewTask %v, Skip %v): %v, want ErrInvalidOption", id, viaNewTask, skip, err)
					}
					if ls := h.locks(); len(ls) != 0 {
						t.Fatalf("caller ID %q (NewTask %v, Skip %v): locks taken: %v", id, viaNewTask, skip, ls)
					}
				}
			}
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Fatalf("%d tasks stored for refused calls", n)
		}
		own := "dd-" + fp + "-" + rnd
		res, err := h.client.Submit(ctx, task, asynq.Queue(h.queue), asynq.TaskID(own))
		if err != nil || res.TaskID != own {
			t.Fatalf("an ID of no form of the library's: %+v %v, want it honoured", res, err)
		}
		if dup := h.duplicateOf(counterTask("k", 1, 1)); dup.Holder != own {
			t.Fatalf("the key is held by %s, want %s", dup.Holder, own)
		}
	})
}

// Under OptIn a type with no rule keeps asynq's task ID, and "A server
// whose rules cover the type guards it as any task that arrives without a
// lock": one process enqueues two tasks of one user under OptIn without a
// rule; a server process has a rule for the type. Both run, once each,
// never at once; neither ID was rewritten.
func TestOptInUnruledTaskIsGuardedOnceByARuledServer(t *testing.T) {
	srv := newHarness(t, Config{Rules: map[string]Rule{"a11:g": {Fields: []string{"user_id"}}}})
	prod, err := New(context.Background(), srv.rdb, Config{Prefix: srv.prefix, OptIn: true, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = prod.Close() })
	var ids []string
	for i := range 2 {
		info, err := prod.NewClient().Enqueue(asynq.NewTask("a11:g", fmt.Appendf(nil, `{"user_id":7,"n":%d}`, i)), asynq.Queue(srv.queue))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(info.ID, "dx-") || strings.HasPrefix(info.ID, "dd-") {
			t.Errorf("ID %s rewritten", info.ID)
		}
		ids = append(ids, info.ID)
	}
	var cur, peak atomic.Int32
	var mu sync.Mutex
	runs := map[string]int{}
	first := make(chan struct{})
	var once sync.Once
	srv.serve(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		if c := cur.Add(1); c > peak.Load() {
			peak.Store(c)
		}
		defer cur.Add(-1)
		mu.Lock()
		runs[id]++
		mu.Unlock()
		once.Do(func() {
			close(first)
			eventually(t, "the other task met the busy key", func() bool { return srv.d.Stats().Busy >= 1 })
		})
		return nil
	}, nil)
	<-first
	eventually(t, "both ran", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(runs) == 2
	})
	eventually(t, "queue drained", func() bool { return srv.queueSize(srv.queue) == 0 })
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if runs[id] != 1 {
			t.Errorf("%s ran %d times", id, runs[id])
		}
	}
	if peak.Load() > 1 {
		t.Errorf("two tasks of one key ran at once")
	}
}

// optInOptions are the per-call options that ask for deduplication: under
// Config.OptIn each opts a call in. notOptInOptions are the two that do not:
// Skip (it asks for none) and Headers (a transport concern: dedupotel adds it
// to every call). Every option function of the package is in one of them
// (TestOptInEveryOptionIsAccountedFor), so docs and behaviour cannot drift.
var (
	optInOptions = map[string]asynq.Option{
		"Cooldown": Cooldown(time.Hour), "Debounce": Debounce(time.Second), "OnConflict": OnConflict(Replace),
		"TTL": TTL(time.Hour), "WaitForRoom": WaitForRoom(), "Fields": Fields("a"), "Key": Key("k"),
		"SharedKey": SharedKey("k"), "Period": Period(time.Hour, nil), "OnFailure": OnFailure(FailHold, time.Hour),
		"MergeWith": MergeWith(func(_, n []byte) ([]byte, error) { return n, nil }),
	}
	notOptInOptions = map[string]asynq.Option{"Skip": Skip(), "Headers": Headers(map[string]string{"x": "y"})}
)

// Under OptIn, a call that passes this package's options (other than Skip
// and Headers) asks for deduplication: it is never silently enqueued
// without it.
func TestOptInPerCallOptionsAreNeverSilentlyIgnored(t *testing.T) {
	for name, o := range optInOptions {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, Config{OptIn: true})
			task := asynq.NewTask("plain", []byte(`{"a":1}`))
			first, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue), o)
			if err != nil && !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("first: %v", err)
			}
			if err != nil {
				return // refused with a clear error: not silent
			}
			second, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue), o)
			if err == nil && second.Outcome == Created {
				t.Fatalf("two identical calls with %v both created tasks (%s, %s): the option was ignored", o, first.TaskID, second.TaskID)
			}
		})
	}
}

// Under OptIn, Skip and Headers leave a call of a type without a rule as
// asynq would enqueue it: two identical calls create two tasks.
func TestOptInSkipAndHeadersDoNotOptACallIn(t *testing.T) {
	h := newHarness(t, Config{OptIn: true})
	for name, o := range notOptInOptions {
		for range 2 {
			r, err := h.client.Submit(context.Background(), asynq.NewTask("plain", []byte(`{"a":1}`)), asynq.Queue(h.queue), o)
			if err != nil || r.Outcome != Created || r.Fingerprint != "" {
				t.Fatalf("%s under OptIn, a type without a rule: %+v, %v; want created, not deduplicated", name, r, err)
			}
		}
	}
}

// Every exported function of the package that returns an asynq.Option is
// in optInOptions or notOptInOptions, so what opts a call in is decided
// (and tested) for each.
func TestOptInEveryOptionIsAccountedFor(t *testing.T) {
	pkgs, err := parser.ParseDir(token.NewFileSet(), ".", func(fi fs.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range pkgs["dedup"].Files {
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !fn.Name.IsExported() || fn.Type.Results == nil || len(fn.Type.Results.List) != 1 {
				continue
			}
			if sel, ok := fn.Type.Results.List[0].Type.(*ast.SelectorExpr); !ok || sel.Sel.Name != "Option" {
				continue
			}
			_, in := optInOptions[fn.Name.Name]
			_, out := notOptInOptions[fn.Name.Name]
			if !in && !out {
				t.Errorf("option %s: decide whether it opts a call in under Config.OptIn, then add it to optInOptions or notOptInOptions", fn.Name.Name)
			}
		}
	}
}

// A type whose rule turns deduplication off (Rule.Skip) refuses a call
// that passes an option asking for it, rather than ignore the option
// silently; Skip and Headers, and no option, enqueue as asynq would.
func TestSkipRuleRefusesACallsDeduplicationOptions(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"skipped": {Skip: true}}})
	task := asynq.NewTask("skipped", []byte(`{"a":1}`))
	for name, o := range optInOptions {
		if _, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue), o); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s on a Skip type: %v, want ErrInvalidOption", name, err)
		}
	}
	for name, o := range map[string]asynq.Option{"Skip": notOptInOptions["Skip"], "Headers": notOptInOptions["Headers"], "none": asynq.MaxRetry(1)} {
		for range 2 {
			if r, err := h.client.Submit(context.Background(), task, asynq.Queue(h.queue), o); err != nil || r.Outcome != Created {
				t.Fatalf("%s on a Skip type: %+v, %v; want created, not deduplicated", name, r, err)
			}
		}
	}
}

// Skip with a caller-chosen ID is not locked at execution either.
func TestSkipRuleWithACallerIDRunsUnguarded(t *testing.T) {
	h := newHarness(t, Config{})
	release := make(chan struct{})
	defer close(release)
	rc := newRecorder(func(r run) error { <-release; return nil })
	h.serve(rc.handler(), nil)
	p := []byte(`{"a":1}`)
	h.enqueue(asynq.NewTask("t", p))
	waitFor(t, rc.runs, "first")
	info, err := h.client.Enqueue(asynq.NewTask("t", p), asynq.Queue(h.queue), Skip(), asynq.TaskID("mine-1"))
	if err != nil {
		t.Fatal(err)
	}
	if r := waitFor(t, rc.runs, "the opted-out task runs alongside"); r.id != info.ID {
		t.Fatalf("ran %s", r.id)
	}
}
