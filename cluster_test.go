package dedup

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The cluster suite runs when DEDUP_TEST_CLUSTER names the seeds of a Redis
// Cluster on loopback (.ci/cluster.sh starts one with three masters).
func clusterClient(t *testing.T) *redis.ClusterClient {
	t.Helper()
	env := os.Getenv("DEDUP_TEST_CLUSTER")
	if env == "" {
		if os.Getenv("DEDUP_REQUIRE_CLUSTER") != "" {
			t.Fatal("DEDUP_REQUIRE_CLUSTER is set but DEDUP_TEST_CLUSTER is empty")
		}
		t.Skip("no Redis Cluster: set DEDUP_TEST_CLUSTER (eval \"$(.ci/cluster.sh start)\"); CI runs it")
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(env, ","), PoolSize: 32, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	if os.Getenv("DEDUP_REQUIRE_CLUSTER") != "" {
		requireReplicas(t, c)
	}
	return c
}

// requireReplicas fails the test unless every master of c has a replica
// (CI's cluster has one each: .ci/cluster.sh).
func requireReplicas(t *testing.T, c *redis.ClusterClient) {
	t.Helper()
	shards, err := c.ClusterShards(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range shards {
		if len(s.Slots) > 0 && len(s.Nodes) < 2 {
			t.Fatalf("DEDUP_REQUIRE_CLUSTER: a master serving slots %v has no replica; start the cluster with .ci/cluster.sh", s.Slots)
		}
	}
}

// queuesOnEveryMaster returns one queue name per master: their hash tags
// "{queue}" fall in slots served by different masters.
func queuesOnEveryMaster(t *testing.T, c *redis.ClusterClient, base string) []string {
	t.Helper()
	ctx := context.Background()
	slots, err := c.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	owner := func(slot int64) string {
		for _, r := range slots {
			if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
				return r.Nodes[0].Addr
			}
		}
		return ""
	}
	seen := map[string]string{}
	for i := 0; len(seen) < 3 && i < 1000; i++ {
		q := fmt.Sprintf("%s-%d", base, i)
		slot, err := c.ClusterKeySlot(ctx, "{"+q+"}").Result()
		if err != nil {
			t.Fatal(err)
		}
		if m := owner(slot); m != "" && seen[m] == "" {
			seen[m] = q
		}
	}
	if len(seen) < 3 {
		t.Fatalf("found queues on %d masters, want 3", len(seen))
	}
	var out []string
	for _, q := range seen {
		out = append(out, q)
	}
	return out
}

func TestClusterEndToEnd(t *testing.T) {
	t.Parallel()
	c := clusterClient(t)
	base := newHarnessOn(t, c, Config{heartbeat: (600 * time.Millisecond) / 3, Rules: map[string]Rule{
		"counter":      {Fields: []string{"key"}, OnConflict: Replace, OnRunning: RunningDefer},
		"user:reindex": {Fields: []string{"user_id"}},
	}})
	queues := queuesOnEveryMaster(t, c, base.queue)
	release := make(chan struct{})
	var running atomic.Int32
	runs := make(chan run, 100)
	srvQueues := map[string]int{}
	for _, q := range queues {
		srvQueues[q] = 1
	}
	srv := asynq.NewServerFromRedisClient(c, asynq.Config{
		Concurrency: 8, Queues: srvQueues, LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
	})
	if err := srv.Start(base.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		running.Add(1)
		defer running.Add(-1)
		runs <- run{id: id, task: task}
		if task.Type() == "counter" && decodeCounter(task).Seq == 0 {
			<-release // long enough for several heartbeats
		}
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()

	for _, q := range queues {
		h := *base
		h.queue = q
		// Duplicates rejected with the holder's ID, in every master's slot.
		first := h.enqueue(userTask(1, "a"), asynq.ProcessIn(time.Hour))
		var dup *DuplicateTaskError
		if _, err := h.client.Enqueue(userTask(1, "b"), asynq.Queue(q)); !errors.As(err, &dup) || dup.Holder != first.ID {
			t.Fatalf("queue %s: err = %v, want duplicate of %s", q, err, first.ID)
		}
		// Replace folds into the waiting (scheduled) task.
		w := h.enqueue(counterTask("w", 1, 1), asynq.ProcessIn(time.Hour))
		res, err := h.client.Submit(context.Background(), counterTask("w", 1, 2), asynq.Queue(q))
		if err != nil || res.Outcome != Replaced || res.TaskID != w.ID {
			t.Fatalf("queue %s: replace %+v %v", q, res, err)
		}
		// A running key: heartbeats keep it, an enqueue defers a follow-up.
		holder := h.enqueue(counterTask("hot", 1, 0))
		if r := waitFor(t, runs, "holder"); r.id != holder.ID {
			t.Fatalf("ran %s", r.id)
		}
		h.heldThrough(1500*time.Millisecond, h.keyOf(counterTask("hot", 1, 0), q)) // several TTLs: only heartbeats keep the lock
		res, err = h.client.Submit(context.Background(), counterTask("hot", 1, 1), asynq.Queue(q))
		if err != nil || res.Outcome != Deferred {
			t.Fatalf("queue %s: while running: %+v %v", q, res, err)
		}
		release <- struct{}{}
		if r := waitFor(t, runs, "follow-up"); r.id != res.TaskID {
			t.Fatalf("ran %s, want follow-up %s", r.id, res.TaskID)
		}
		// Released after success: the key is free again.
		eventually(t, "released in "+q, func() bool { return h.lockOwner(h.keyOf(counterTask("hot", 1, 0), q)) == "" })
		if _, err := h.client.Enqueue(counterTask("hot", 1, 5), asynq.Queue(q), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatalf("queue %s: enqueue after release: %v", q, err)
		}
	}
	if s := base.d.Stats(); s.LockLost != 0 || s.RedisErrors != 0 {
		t.Fatalf("stats %+v", s)
	}
	for _, q := range queues {
		_ = base.insp.DeleteQueue(q, true)
	}
}
