package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// tripLog records the round trips clients make, by node: each pipeline
// with its commands' names, and each command sent alone (connection
// set-up, CLIENT and HELLO, left out).
type tripLog struct {
	mu    sync.Mutex
	trips []trip
}

type trip struct {
	addr string
	cmds []string
}

// take returns the round trips made since the last take, and forgets them.
func (l *tripLog) take() []trip {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.trips
	l.trips = nil
	return out
}

func (l *tripLog) note(addr string, cmds []redis.Cmder) {
	var names []string
	for _, c := range cmds {
		if n := c.Name(); n != "client" && n != "hello" {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return
	}
	l.mu.Lock()
	l.trips = append(l.trips, trip{addr, names})
	l.mu.Unlock()
}

// tripHook is a go-redis hook that records a node's round trips in a
// tripLog.
type tripHook struct {
	log  *tripLog
	addr string
}

func (h tripHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h tripHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.log.note(h.addr, []redis.Cmder{cmd})
		return next(ctx, cmd)
	}
}
func (h tripHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.log.note(h.addr, cmds)
		return next(ctx, cmds)
	}
}

// This package's options given to asynq.NewTask apply to that task, in
// Submit, under the call's (which override them), and
// keep NewClient's direct path.
func TestNewTaskDedupOptionsApplyToTheTask(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	ctx := context.Background()
	log := &tripLog{}
	h.rdb.AddHook(tripHook{log: log})
	user := func(id int, trace string, opts ...asynq.Option) *asynq.Task {
		return asynq.NewTask("user:reindex", fmt.Appendf(nil, `{"user_id":%d,"trace_id":%q}`, id, trace), opts...)
	}
	h.enqueue(user(0, "")) // registers the queue
	log.take()
	first, err := h.client.Submit(ctx, user(1, "a", Fields("user_id"), Headers(map[string]string{"h": "1"})), asynq.Queue(h.queue))
	if err != nil || first.Outcome != Created {
		t.Fatalf("first: %+v, %v", first, err)
	}
	if trips := log.take(); len(trips) != 1 || len(trips[0].cmds) != 1 {
		t.Fatalf("round trips %v: want the direct path's one call", trips)
	}
	if ti, err := h.insp.GetTaskInfo(h.queue, first.TaskID); err != nil || ti.Headers["h"] != "1" {
		t.Fatalf("stored task %+v, %v; want NewTask's dedup.Headers", ti, err)
	}
	var dup *DuplicateTaskError
	if _, err := h.client.Submit(ctx, user(1, "b", Fields("user_id")), asynq.Queue(h.queue)); !errors.As(err, &dup) || dup.TaskID != first.TaskID {
		t.Fatalf("same user, NewTask's Fields: %v, want a duplicate of %s", err, first.TaskID)
	}
	if _, err := h.client.Submit(ctx, user(1, "c", Fields("user_id")), asynq.Queue(h.queue), Key("k")); err != nil {
		t.Fatalf("the call's Key over NewTask's Fields: %v, want a key of its own", err)
	}
	if r, err := h.client.Submit(ctx, user(1, "d", Key("k"), OnConflict(Replace)), asynq.Queue(h.queue), Key("k2"), OnConflict(Reject)); err != nil || r.Outcome != Created || r.Conflict != Reject {
		t.Fatalf("the call's Key and OnConflict over NewTask's: %+v, %v; want created under k2, rejecting", r, err)
	}
	if _, err := h.client.Submit(ctx, user(2, "e", Key("k2")), asynq.Queue(h.queue)); !errors.As(err, &dup) {
		t.Fatalf("NewTask's Key k2: %v, want a duplicate", err)
	}
	if r, err := h.client.Submit(ctx, user(1, "a", Skip()), asynq.Queue(h.queue)); err != nil || r.Fingerprint != "" {
		t.Fatalf("NewTask's Skip: %+v, %v; want enqueued without deduplication", r, err)
	}
	_, err = h.client.Submit(ctx, user(3, "", TTL(-1)), asynq.Queue(h.queue))
	if !errors.Is(err, ErrInvalidOption) || !strings.Contains(err.Error(), "NewTask") {
		t.Fatalf("NewTask's invalid option: %v, want ErrInvalidOption naming NewTask", err)
	}
}
