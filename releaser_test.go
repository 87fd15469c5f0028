package dedup

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// README (Dedup.Release): a holder whose lock an operator released still
// runs, and takes the key again when it starts if the key is free; if a task
// of its type took the key since, it gives way. A waiting task NewClient
// stored with its lock does the same.
func TestReleasedNewClientHolderTakesOrGivesWay(t *testing.T) {
	t.Run("key free: it takes the key", func(t *testing.T) {
		h, a := releasedNewClientHolder(t)
		ctx, opts := context.Background(), []asynq.Option{asynq.Queue(h.queue)}
		tr := newKeyTracker(counterKeyOf, 1)
		h.serve(tr.handler(nil), nil)
		t.Cleanup(tr.openAll)
		waitFor(t, tr.starts, "the released task runs")
		if l, found, err := h.d.Lookup(ctx, counterTask("k", 1, 1), opts...); err != nil || !found || l.Holder != a.ID || l.State != "running" {
			t.Fatalf("Lookup while the released task runs: %+v, %v, %v; want running, held by %s", l, found, err, a.ID)
		}
		var dup *DuplicateTaskError
		if _, err := h.client.Enqueue(counterTask("k", 1, 2), opts...); !errors.As(err, &dup) || dup.TaskID != a.ID {
			t.Fatalf("duplicate while the released task runs: %v; want one naming %s", err, a.ID)
		}
	})
	t.Run("key taken since: it gives way", func(t *testing.T) {
		h, a := releasedNewClientHolder(t)
		b := h.enqueue(counterTask("k", 1, 2))
		tr := newKeyTracker(counterKeyOf, 1, 2)
		h.serve(tr.handler(nil), func(c *asynq.Config) { c.Concurrency = 4; retryInAnHour(c) })
		t.Cleanup(tr.openAll)
		first := waitFor(t, tr.starts, "the key's first run")
		tr.noSecondStart(t, first, 3*time.Second, "tasks "+a.ID+" and "+b.ID+" of one key")
	})
}

// releasedNewClientHolder enqueues a task through NewClient and has an
// operator release its lock (Release without a holder) while it waits.
func releasedNewClientHolder(t *testing.T) (*harness, *asynq.TaskInfo) {
	t.Helper()
	h := newHarness(t, counterRules(Rule{}))
	h.client = h.d.NewClient()
	a := h.enqueue(counterTask("k", 1, 1))
	if ok, err := h.d.Release(context.Background(), counterTask("k", 1, 1), "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("forced release: %v %v", ok, err)
	}
	return h, a
}
