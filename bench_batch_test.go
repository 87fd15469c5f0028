//go:build unix

package dedup

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// BenchmarkEnqueueBatch enqueues 1,000 tasks of new keys through NewClient
// in one EnqueueBatch call, against 1,000 Submits one after another (an op:
// the 1,000 tasks; ns/task and cpu-µs/task per task). Redis's CPU is
// cmd/dedupbench's job (-cases batch): this process runs the scripts in their
// key-checking build (TestMain), which costs Redis, not the client.
func BenchmarkEnqueueBatch(b *testing.B) {
	ctx := context.Background()
	rdb := newRDB(b)
	c := benchClient(b, rdb, "bench-")
	const size = 1000
	for _, batched := range []bool{true, false} {
		name := map[bool]string{true: "batch", false: "sequential"}[batched]
		b.Run(name, func(b *testing.B) {
			q := "q-" + uniq(b)
			opts := []asynq.Option{asynq.Queue(q), Fields("user_id")}
			if _, err := c.Submit(ctx, asynq.NewTask("bench:batch", benchPayload(0, 0)), opts...); err != nil {
				b.Fatal(err) // registers the queue: untimed
			}
			b.Cleanup(func() { _ = asynq.NewInspectorFromRedisClient(rdb).DeleteQueue(q, true) })
			b.ReportAllocs()
			n := int64(0)
			tasks := make([]*asynq.Task, size)
			var cpu time.Duration // of the timed calls only
			for b.Loop() {
				b.StopTimer()
				for i := range tasks {
					n++
					tasks[i] = asynq.NewTask("bench:batch", benchPayload(n, n))
				}
				b.StartTimer()
				cpu0 := processCPU()
				enqueueTasks(b, c, batched, tasks, opts)
				cpu += processCPU() - cpu0
			}
			tasksDone := float64(b.N * size)
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/tasksDone, "ns/task")
			b.ReportMetric(float64(cpu.Nanoseconds())/1e3/tasksDone, "cpu-µs/task")
		})
	}
}

// enqueueTasks enqueues tasks in one EnqueueBatch, or Submits one by one,
// failing b unless each is created.
func enqueueTasks(b *testing.B, c *Client, batched bool, tasks []*asynq.Task, opts []asynq.Option) {
	ctx := context.Background()
	if batched {
		for _, r := range c.EnqueueBatch(ctx, tasks, opts...) {
			if r.Err != nil || r.Outcome != Created {
				b.Fatalf("%+v", r)
			}
		}
		return
	}
	for _, task := range tasks {
		if r, err := c.Submit(ctx, task, opts...); err != nil || r.Outcome != Created {
			b.Fatalf("%+v, %v", r, err)
		}
	}
}
