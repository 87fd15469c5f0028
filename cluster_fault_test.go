package dedup

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// masterOf returns the address of the master serving queue's slot.
func masterOf(t *testing.T, c *redis.ClusterClient, queue string) string {
	t.Helper()
	node, err := c.MasterForKey(context.Background(), "{"+queue+"}")
	if err != nil {
		t.Fatal(err)
	}
	return node.Options().Addr
}

// A master killed with SIGKILL is its own problem: enqueues to its queue
// fail with ErrUnavailable (then fast, ErrCircuitOpen, once its breaker
// opens), while enqueues to the other masters' queues, sent concurrently
// and batched, all succeed, before and after that breaker opened.
func TestClusterDeadMasterStaysItsOwnProblem(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3)
	queues := queuesOnEveryMaster(t, c, "shard")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), LockTimeout: 300 * time.Millisecond, BreakerThreshold: 3, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	seq := 0
	enqueue := func(q string) error {
		seq++
		_, err := client.EnqueueContext(ctx, asynq.NewTask("shard:job", fmt.Appendf(nil, `{"n":%d}`, seq)), asynq.Queue(q))
		return err
	}
	for _, q := range queues {
		if err := enqueue(q); err != nil {
			t.Fatalf("before the kill, queue %s: %v", q, err)
		}
	}
	dead := queues[0]
	for _, p := range procs {
		if p.Addr == masterOf(t, c, dead) {
			p.Kill()
		}
	}

	// 32 producers, each enqueueing to all three queues in turn.
	var (
		mu   sync.Mutex
		errs = map[string][]error{}
		wg   sync.WaitGroup
		n    = 0
	)
	for p := range 32 {
		wg.Go(func() {
			for i := range 9 {
				q := queues[(p+i)%len(queues)]
				mu.Lock()
				n++
				task := asynq.NewTask("shard:job", fmt.Appendf(nil, `{"p":%d,"i":%d}`, p, i))
				mu.Unlock()
				_, err := client.EnqueueContext(ctx, task, asynq.Queue(q))
				if err != nil {
					mu.Lock()
					errs[q] = append(errs[q], err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	for _, q := range queues[1:] {
		if len(errs[q]) > 0 {
			t.Errorf("queue %s on a healthy master: %d errors, first %v", q, len(errs[q]), errs[q][0])
		}
	}
	if len(errs[dead]) == 0 {
		t.Fatalf("queue %s on the dead master: no errors", dead)
	}
	for _, err := range errs[dead] {
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("queue %s on the dead master: %v, want ErrUnavailable", dead, err)
		}
	}
	if st := d.BreakerState(); st != BreakerOpen {
		t.Fatalf("breaker state %v after the dead master's failures, want open (its node's)", st)
	}
	// With the dead master's breaker open, the others go on.
	for _, q := range queues[1:] {
		if err := enqueue(q); err != nil {
			t.Errorf("queue %s after the dead master's breaker opened: %v", q, err)
		}
	}
	if err := enqueue(dead); !errors.Is(err, ErrCircuitOpen) || !errors.Is(err, ErrUnavailable) {
		t.Errorf("queue %s once its breaker is open: %v, want ErrCircuitOpen within ErrUnavailable", dead, err)
	}
	t.Logf("%d enqueues; %d failed, all on the dead master's queue", n, len(errs[dead]))
}
