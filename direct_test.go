package dedup

import (
	"context"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"google.golang.org/protobuf/encoding/protowire"
)

// decodeFields splits a protobuf message into field number → raw values, with
// map entries (headers) sorted, so two encodings can be compared by content.
func decodeFields(t *testing.T, b []byte) map[protowire.Number][]string {
	t.Helper()
	out := map[protowire.Number][]string{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			t.Fatalf("bad field %d: %v", num, protowire.ParseError(m))
		}
		out[num] = append(out[num], string(b[:m]))
		b = b[m:]
	}
	for _, v := range out {
		sort.Strings(v)
	}
	return out
}

// The direct path stores what asynq v0.26.0's own client stores: the same
// message fields, the same hash fields, the same queue structures.
func TestDirectEnqueueMatchesAsynq(t *testing.T) {
	h := newHarness(t, Config{})
	if h.client.direct {
		t.Fatal("WrapClient cannot know asynq's Redis: it must not store tasks itself")
	}
	h.client = h.d.NewClient()
	ctx := context.Background()
	// The first enqueue to a queue registers it in asynq:queues, once per
	// process, as asynq's client does; do that before counting.
	if err := h.d.store.PublishQueue(ctx, h.queue); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Hour).Truncate(time.Second)
	combos := [][]asynq.Option{
		{},
		{asynq.MaxRetry(3), asynq.Timeout(90 * time.Second), asynq.Retention(time.Hour)},
		{asynq.Deadline(deadline)},
		{asynq.Deadline(deadline), asynq.Timeout(time.Minute), asynq.MaxRetry(0)},
		{asynq.ProcessIn(time.Hour)},
		{asynq.ProcessAt(time.Now().Add(3 * time.Hour))},
		// Zero values and sub-second durations, stored as asynq's client stores them.
		{asynq.Deadline(time.Unix(0, 0))},
		{asynq.Deadline(time.Unix(0, 5e8))},
		{asynq.Deadline(time.Time{}), asynq.Timeout(0)},
		{asynq.Timeout(1500 * time.Millisecond), asynq.Retention(2500 * time.Millisecond)},
		{asynq.Timeout(500 * time.Millisecond), asynq.Retention(time.Millisecond)},
		{asynq.Deadline(deadline.Add(700 * time.Millisecond)), asynq.MaxRetry(-1)},
	}
	for i, opts := range combos {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			task := asynq.NewTaskWithHeaders("direct:check", []byte(fmt.Sprintf(`{"n":%d}`, i)), map[string]string{"a": "1", "b": "2"})
			theirsOpts := append([]asynq.Option{asynq.Queue(h.queue), asynq.TaskID(fmt.Sprintf("theirs-%d", i))}, opts...)
			theirs, err := h.asynq.Enqueue(task, theirsOpts...)
			if err != nil {
				t.Fatal(err)
			}
			cmds := countCommands(h)
			oursOpts := append([]asynq.Option{asynq.Queue(h.queue), asynq.TaskID(fmt.Sprintf("ours-%d", i))}, opts...)
			ours, err := h.client.Enqueue(task, oursOpts...)
			if err != nil {
				t.Fatal(err)
			}
			if n := cmds(); n != 1 {
				t.Fatalf("%d commands for an accepted enqueue, want 1", n)
			}
			get := func(id string) map[string]string {
				return h.rdb.HGetAll(ctx, asynqTaskKeyPrefix(h.queue)+id).Val()
			}
			th, oh := get(theirs.ID), get(ours.ID)
			tf, of := decodeFields(t, []byte(th["msg"])), decodeFields(t, []byte(oh["msg"]))
			delete(tf, 3) // the IDs differ by design
			delete(of, 3)
			// By design too: the lock is the task's unique key (as
			// asynq.Unique's), and a caller-chosen ID carries the lock's
			// name in a header (the middleware cannot read it from the ID).
			lock := h.keyOf(task, h.queue)
			var u []byte
			if len(of[10]) == 1 {
				u, _ = protowire.ConsumeBytes([]byte(of[10][0]))
			}
			if string(u) != lock || oh["unique_key"] != lock {
				t.Fatalf("unique key %q, record %q; want the lock %q", u, oh["unique_key"], lock)
			}
			delete(of, 10)
			delete(oh, "unique_key")
			of[15] = slices.DeleteFunc(of[15], func(e string) bool { return strings.Contains(e, "\n\x05dedup\x12") })
			if !reflect.DeepEqual(tf, of) {
				t.Fatalf("message fields differ:\nasynq %v\nours  %v", tf, of)
			}
			if th["state"] != oh["state"] || (th["pending_since"] == "") != (oh["pending_since"] == "") || len(th) != len(oh) {
				t.Fatalf("task hashes differ:\nasynq %v\nours  %v", th, oh)
			}
			ti, err := h.insp.GetTaskInfo(h.queue, ours.ID)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := h.insp.GetTaskInfo(h.queue, theirs.ID)
			ti.ID, want.ID = "", ""
			delete(ti.Headers, store.HeaderLock)
			ti.NextProcessAt, want.NextProcessAt = time.Time{}, time.Time{}
			if !reflect.DeepEqual(ti, want) {
				t.Fatalf("Inspector sees\nasynq %+v\nours  %+v", want, ti)
			}
			o, th2 := *ours, *theirs
			o.ID, th2.ID = "", ""
			o.Headers = maps.Clone(o.Headers)
			delete(o.Headers, store.HeaderLock)
			o.NextProcessAt, th2.NextProcessAt = time.Time{}, time.Time{}
			if !reflect.DeepEqual(o, th2) {
				t.Fatalf("returned TaskInfo\nasynq %+v\nours  %+v", theirs, ours)
			}
		})
	}
	// Options asynq.NewTask holds are invisible: such tasks take asynq's path.
	if _, err := h.client.Enqueue(asynq.NewTask("direct:opts", []byte("warm-up"), asynq.MaxRetry(2)), asynq.Queue(h.queue)); err != nil {
		t.Fatal(err) // asynq's client registers the queue on its first enqueue
	}
	task := asynq.NewTask("direct:opts", []byte("x"), asynq.MaxRetry(2))
	cmds := countCommands(h)
	info, err := h.client.Enqueue(task, asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	if n := cmds(); n != 2 || info.MaxRetry != 2 {
		t.Fatalf("NewTask options: %d commands, MaxRetry %d; want asynq's path (2) and 2", n, info.MaxRetry)
	}
	// A duplicate through the direct path is still one round trip and names the holder.
	cmds = countCommands(h)
	if _, err := h.client.Enqueue(task, asynq.Queue(h.queue)); err == nil || cmds() != 1 {
		t.Fatal("duplicate should be rejected in one command")
	}
}

// countCommands counts the commands the harness's client sends from now on.
func countCommands(h *harness) func() int {
	h.t.Helper()
	hk := cmdCounter(h.rdb)
	start := hk.n.Load()
	return func() int { return int(hk.n.Load() - start) }
}

// Tasks the lock script stored run like any other, and release their locks.
func TestDirectEnqueuedTasksRun(t *testing.T) {
	h := newHarness(t, Config{})
	h.client = h.d.NewClient()
	rc := newRecorder(nil)
	h.serve(rc.handler(), nil)
	now := h.enqueue(userTask(1, ""), asynq.Retention(time.Hour))
	later := h.enqueue(userTask(2, ""), asynq.ProcessIn(300*time.Millisecond))
	got := map[string]bool{}
	for range 2 {
		got[waitFor(t, rc.runs, "runs").id] = true
	}
	if !got[now.ID] || !got[later.ID] {
		t.Fatalf("ran %v, want %s and %s", got, now.ID, later.ID)
	}
	eventually(t, "locks released", func() bool { return len(h.locks()) == 0 })
	eventually(t, "completed", func() bool { return h.taskState(now.ID) == asynq.TaskStateCompleted })
}

// The direct path decides "scheduled or pending" once, as asynq's client
// does: the TaskInfo it returns has the state the task was stored in, even
// for a ProcessIn shorter than the round trip (100 µs to 2 ms). (Once, such a
// task was stored scheduled but returned as pending, the decision being made
// again after the round trip.)
func TestDirectEnqueueWithATinyProcessInReturnsTheStoredState(t *testing.T) {
	h := newHarness(t, Config{})
	c := h.d.NewClient()
	bad := 0
	for i := range 40 {
		d := time.Duration(100+i*50) * time.Microsecond
		info, err := c.Enqueue(userTask(i, ""), asynq.Queue(h.queue), asynq.ProcessIn(d))
		if err != nil {
			t.Fatal(err)
		}
		ti, err := h.insp.GetTaskInfo(h.queue, info.ID)
		if err != nil {
			t.Fatal(err)
		}
		// A scheduled task may become pending by itself only through asynq's
		// forwarder; no server runs here.
		if ti.State != info.State {
			bad++
			if bad <= 3 {
				t.Errorf("ProcessIn(%v): returned state %v, stored state %v", d, info.State, ti.State)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of 40 direct enqueues returned a state other than the one stored", bad)
	}
}
