//go:build unix

package dedup

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// BenchmarkSubmit measures what an enqueue costs the producer's process:
// allocations and CPU (user+sys of the test process, so Redis is not in
// it) per call, for plain asynq Enqueue and for Submit accepted, rejected
// and replaced, from 32 goroutines. Throughput against plain asynq, and
// Redis's CPU, are cmd/dedupbench's job: this process runs the scripts in
// their key-checking build (TestMain), which costs Redis, not the client.
func BenchmarkSubmit(b *testing.B) {
	ctx := context.Background()
	rdb := newRDB(b)
	d, err := New(ctx, rdb, Config{Prefix: "bench-" + uniq(b), Logger: quietLogger(),
		Rules: map[string]Rule{"bench:replace": {Fields: []string{"user_id"}, OnConflict: Replace}}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	c, plain := d.NewClient(), asynq.NewClientFromRedisClient(rdb)
	const keys = 1000
	cases := []struct {
		name string
		typ  string
		user func(n int64) int64 // the user_id of the n-th call (its payload differs from every other call's)
		call func(task *asynq.Task, q string) error
	}{
		{"plain", "bench:plain", func(n int64) int64 { return n }, func(task *asynq.Task, q string) error {
			_, err := plain.EnqueueContext(ctx, task, asynq.Queue(q))
			return err
		}},
		{"accepted", "bench:reject", func(n int64) int64 { return n }, func(task *asynq.Task, q string) error {
			_, err := c.Submit(ctx, task, asynq.Queue(q), Fields("user_id"))
			return err
		}},
		{"rejected", "bench:reject", func(n int64) int64 { return n % keys }, func(task *asynq.Task, q string) error {
			_, err := c.Submit(ctx, task, asynq.Queue(q), Fields("user_id"))
			if _, dup := err.(*DuplicateTaskError); dup {
				return nil
			}
			return err
		}},
		{"replaced", "bench:replace", func(n int64) int64 { return n % keys }, func(task *asynq.Task, q string) error {
			_, err := c.Submit(ctx, task, asynq.Queue(q))
			return err
		}},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			q := "q-" + uniq(b)
			for u := range int64(keys) { // the keys the duplicate cases meet, taken untimed
				if err := tc.call(asynq.NewTask(tc.typ, benchPayload(u, 0)), q); err != nil {
					b.Fatal(err)
				}
			}
			var n atomic.Int64
			b.ReportAllocs()
			b.SetParallelism(16) // 32 goroutines on 2 cores
			cpu0 := processCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := keys + n.Add(1)
					task := asynq.NewTask(tc.typ, benchPayload(tc.user(i), i))
					if err := tc.call(task, q); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64((processCPU()-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu-µs/op")
		})
	}
}

// benchPayload is a 200-byte JSON payload about user u, with a trace ID.
func benchPayload(u, trace int64) []byte {
	s := fmt.Sprintf(`{"user_id":%d,"trace_id":"%016x","pad":"`, u, trace)
	return []byte(s + strings.Repeat("x", 200-len(s)-2) + `"}`)
}

// processCPU is the CPU time (user and system) this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
