package dedup

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// storedHeaders returns the headers asynq stored for task id.
func (h *harness) storedHeaders(id string) map[string]string {
	h.t.Helper()
	ti, err := h.insp.GetTaskInfo(h.queue, id)
	if err != nil {
		h.t.Fatalf("GetTaskInfo %s: %v", id, err)
	}
	return ti.Headers
}

// TestHeadersOnCreatedTasks: dedup.Headers adds to a created task's own
// headers (the option winning a clash) on every path that creates one:
// NewClient's direct path, WrapClient's Enqueuer (a task with NewTask
// options, which are kept), and a call that is not deduplicated.
func TestHeadersOnCreatedTasks(t *testing.T) {
	h := newHarness(t, Config{})
	ctx := context.Background()
	add := Headers(map[string]string{"traceparent": "00-tp", "a": "mine"})
	own := map[string]string{"a": "task's", "b": "task's"}
	want := map[string]string{"traceparent": "00-tp", "a": "mine", "b": "task's"}

	clients := map[string]*Client{"direct": h.d.NewClient(), "wrapped": h.client}
	for name, c := range clients {
		task := asynq.NewTaskWithHeaders("hdr:"+name, []byte(`{"n":1}`), own, asynq.MaxRetry(7))
		res, err := c.Submit(ctx, task, asynq.Queue(h.queue), add)
		if err != nil || res.Outcome != Created {
			t.Fatalf("%s: Submit = %+v, %v", name, res, err)
		}
		got := h.storedHeaders(res.TaskID)
		delete(got, store.HeaderLock) // (the library's own: what the middleware does with the task)
		if !maps.Equal(got, want) {
			t.Errorf("%s: stored headers %v, want %v", name, got, want)
		}
		if ti, _ := h.insp.GetTaskInfo(h.queue, res.TaskID); ti == nil || ti.MaxRetry != 7 {
			t.Errorf("%s: the task's NewTask option MaxRetry(7) was lost: %+v", name, ti)
		}
		if !maps.Equal(task.Headers(), own) {
			t.Errorf("%s: the caller's task was changed: %v", name, task.Headers())
		}
	}
	// The direct path itself (no NewTask options), which stores asynq's record in the lock script.
	res, err := clients["direct"].Submit(ctx, asynq.NewTask("hdr:bare", []byte(`{}`)), asynq.Queue(h.queue), add)
	if err != nil || res.Outcome != Created {
		t.Fatalf("direct bare: %+v, %v", res, err)
	}
	if got := h.storedHeaders(res.TaskID); got["traceparent"] != "00-tp" || got["a"] != "mine" {
		t.Errorf("direct bare: stored headers %v", got)
	}
	res, err = h.client.Submit(ctx, asynq.NewTask("hdr:skip", nil), asynq.Queue(h.queue), Skip(), add)
	if err != nil || res.Fingerprint != "" {
		t.Fatalf("skip: %+v, %v", res, err)
	}
	if got := h.storedHeaders(res.TaskID); got["traceparent"] != "00-tp" {
		t.Errorf("skip: stored headers %v", got)
	}
}

// TestHeadersNotAppliedOnFold: a call folded into a waiting task leaves
// that task's headers alone and names the option in Result.NotApplied.
func TestHeadersNotAppliedOnFold(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{"hdr:fold": {Fields: []string{"k"}, OnConflict: Replace}}})
	ctx := context.Background()
	first, err := h.client.Submit(ctx, asynq.NewTask("hdr:fold", []byte(`{"k":1,"v":1}`)), asynq.Queue(h.queue), asynq.ProcessIn(time.Hour),
		Headers(map[string]string{"traceparent": "first"}))
	if err != nil || first.Outcome != Created {
		t.Fatalf("first: %+v, %v", first, err)
	}
	second, err := h.client.Submit(ctx, asynq.NewTask("hdr:fold", []byte(`{"k":1,"v":2}`)), asynq.Queue(h.queue),
		Headers(map[string]string{"traceparent": "second"}))
	if err != nil || second.Outcome != Replaced || second.TaskID != first.TaskID {
		t.Fatalf("second: %+v, %v", second, err)
	}
	if !slices.Contains(second.NotApplied, "dedup.Headers(…)") {
		t.Errorf("NotApplied = %q, want it to name dedup.Headers(…)", second.NotApplied)
	}
	if got := h.storedHeaders(first.TaskID); got["traceparent"] != "first" {
		t.Errorf("the waiting task's headers changed: %v", got)
	}
	if first.Fingerprint == "" || second.Fingerprint != first.Fingerprint {
		t.Errorf("fingerprints %q, %q: want one, the same", first.Fingerprint, second.Fingerprint)
	}
}

// TestHeadersFingerprintAndKeyHash: Result.Fingerprint is the end of the
// lock key (KeyHash of DuplicateTaskError.Key), never the key's text;
// Headers does not opt a call in under Config.OptIn.
func TestHeadersFingerprintAndKeyHash(t *testing.T) {
	h := newHarness(t, Config{OptIn: true})
	ctx := context.Background()
	task := asynq.NewTask("hdr:key", []byte(`{}`))
	res, err := h.client.Submit(ctx, task, asynq.Queue(h.queue), Key("user-secret-42"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = h.client.Submit(ctx, task, asynq.Queue(h.queue), Key("user-secret-42"))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) {
		t.Fatalf("second call: %v, want a duplicate", err)
	}
	if res.Fingerprint == "" || KeyHash(dup.Key) != res.Fingerprint || KeyHash(h.keyOf(task, h.queue, Key("user-secret-42"))) != res.Fingerprint {
		t.Errorf("Fingerprint %q, KeyHash(dup.Key %q) = %q", res.Fingerprint, dup.Key, KeyHash(dup.Key))
	}
	for _, bad := range []string{"", "x", "dedup:{q}:l:notHex", dup.Key + "0"} {
		if got := KeyHash(bad); got != "" {
			t.Errorf("KeyHash(%q) = %q, want empty", bad, got)
		}
	}
	for range 2 { // not deduplicated: Headers is no dedup option
		r, err := h.client.Submit(ctx, asynq.NewTask("hdr:optin", []byte(`{}`)), asynq.Queue(h.queue), Headers(map[string]string{"x": "y"}))
		if err != nil || r.Outcome != Created || r.Fingerprint != "" {
			t.Fatalf("OptIn without a rule: %+v, %v", r, err)
		}
	}
}

// options.go: "Per-call options take effect ... given to the call or to the
// task's asynq.NewTask"; headers.go: Headers is how a wrapper adds a trace
// context. dedup.Headers given to asynq.NewTask as the task's only option of
// this package works in Submit (the task stored with the headers), Enqueue,
// EnqueueBatch, with Skip, Lookup and QueueOf, and panics in none. (Once,
// they all dereferenced a nil rule: the headers were added without the rule
// copy being made.)
func TestHeadersAsNewTasksOnlyOptionWorkEverywhere(t *testing.T) {
	bothPaths(t, batchJobRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		try := func(what string, f func() error) {
			t.Helper()
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("%s panicked: %v", what, p)
				}
			}()
			if err := f(); err != nil {
				t.Errorf("%s: %v", what, err)
			}
		}
		hdr := map[string]string{"trace": "t-1"}
		try("Submit", func() error {
			r, err := h.client.Submit(ctx, batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue))
			if err == nil {
				if ti, gerr := h.insp.GetTaskInfo(h.queue, r.TaskID); gerr != nil || ti.Headers["trace"] != "t-1" {
					return fmt.Errorf("stored %+v, %v; want NewTask's headers", ti, gerr)
				}
			}
			return err
		})
		try("Enqueue", func() error {
			_, err := h.client.Enqueue(batchJob("e", 1, Headers(hdr)), asynq.Queue(h.queue))
			return err
		})
		try("EnqueueBatch", func() error {
			out := h.client.EnqueueBatch(ctx, []*asynq.Task{batchJob("b", 1), batchJob("b2", 1, Headers(hdr))}, asynq.Queue(h.queue))
			return errors.Join(out[0].Err, out[1].Err)
		})
		try("Skip", func() error {
			_, err := h.client.Submit(ctx, batchJob("k", 1, Headers(hdr)), asynq.Queue(h.queue), Skip())
			return err
		})
		try("Lookup", func() error {
			_, _, err := h.d.Lookup(ctx, batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue))
			return err
		})
		try("QueueOf", func() error {
			if q := h.d.queueOf(batchJob("s", 1, Headers(hdr)), asynq.Queue(h.queue)); q != h.queue {
				return fmt.Errorf("QueueOf: %s, want %s", q, h.queue)
			}
			return nil
		})
	})
}

// KeyHash is the fingerprint a lock key ends with (what dedupotel puts on
// a duplicate's span).
func KeyHash(lockKey string) string {
	_, _, fp, _ := store.ParseLockKey(lockKey)
	return fp
}
