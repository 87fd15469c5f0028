package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
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
	procs, c := redistest.OwnCluster(t, 3, false)
	queues := queuesOnEveryMaster(t, c, "shard")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), BreakerThreshold: 3, Logger: quietLogger()})
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

// A master killed with SIGKILL is replaced by its replica (node timeout
// 2 s): enqueues to its queue fail with ErrUnavailable until the promotion
// and succeed again soon after it (each failure asks go-redis to reload
// the slot map; the breaker probes every BreakerBackoff); the other
// queues never fail; a task and its lock written (and replicated) before
// the kill survive it: its duplicate is still refused.
func TestClusterKilledMasterRecoversAfterPromotion(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	queues := queuesOnEveryMaster(t, c, "promo")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), LockTimeout: 300 * time.Millisecond, Logger: quietLogger(),
		BreakerBackoff: Backoff{Min: 100 * time.Millisecond, Max: 500 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	dead := queues[0]
	before := asynq.NewTask("promo:job", []byte(`{"k":"before"}`))
	first, err := client.EnqueueContext(ctx, before, asynq.Queue(dead))
	if err != nil {
		t.Fatal(err)
	}
	var master, replica *redistest.Proc
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, dead) {
			master, replica = p, procs[3+i]
		}
	}
	mc := redis.NewClient(&redis.Options{Addr: master.Addr})
	if n, err := mc.Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica: %d %v", n, err)
	}
	_ = mc.Close()
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	t.Cleanup(func() { _ = rc.Close() })

	master.Kill()
	killed := time.Now()
	var promoted, recovered time.Time
	failures := 0
	for i := 0; recovered.IsZero(); i++ {
		if time.Since(killed) > 60*time.Second {
			t.Fatalf("no recovery 60 s after the kill (promoted: %v, %d failures)", !promoted.IsZero(), failures)
		}
		if promoted.IsZero() && strings.Contains(rc.Info(ctx, "replication").Val(), "role:master") {
			promoted = time.Now()
		}
		for _, q := range queues[1:] {
			if _, err := client.EnqueueContext(ctx, asynq.NewTask("promo:job", fmt.Appendf(nil, `{"q":%q,"i":%d}`, q, i)), asynq.Queue(q)); err != nil {
				t.Fatalf("queue %s on a live master, %v after the kill: %v", q, time.Since(killed), err)
			}
		}
		_, err := client.EnqueueContext(ctx, asynq.NewTask("promo:job", fmt.Appendf(nil, `{"i":%d}`, i)), asynq.Queue(dead))
		switch {
		case err == nil:
			recovered = time.Now()
		case !errors.Is(err, ErrUnavailable):
			t.Fatalf("queue %s on the killed master: %v, want ErrUnavailable", dead, err)
		default:
			failures++
			time.Sleep(50 * time.Millisecond) // the time under test: polling the recovery
		}
	}
	if promoted.IsZero() {
		t.Fatal("recovered before the replica was seen promoted")
	}
	t.Logf("promoted %v after the kill; enqueues recovered %v after the promotion (%d failures meanwhile)",
		promoted.Sub(killed).Round(time.Millisecond), recovered.Sub(promoted).Round(time.Millisecond), failures)
	if lag := recovered.Sub(promoted); lag > 5*time.Second {
		t.Errorf("recovered %v after the promotion; want within 5 s (a slot map reload and a breaker probe)", lag)
	}
	var dup *DuplicateTaskError
	if _, err := client.EnqueueContext(ctx, before, asynq.Queue(dead)); !errors.As(err, &dup) || dup.TaskID != first.ID {
		t.Fatalf("duplicate of the task written before the kill: %v, want a DuplicateTaskError naming %s", err, first.ID)
	}
}
