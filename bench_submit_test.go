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
// The -c1 cases make the same calls from one goroutine: what a lone
// producer's call costs, batching and contention aside.
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
		b.Run(tc.name, func(b *testing.B) { benchSubmitCase(b, tc.typ, tc.user, tc.call, false) })
		b.Run(tc.name+"-c1", func(b *testing.B) { benchSubmitCase(b, tc.typ, tc.user, tc.call, true) })
	}
}

// benchSubmitCase times call on fresh tasks of type typ about user(n), the
// n-th call's user, from 32 goroutines or (serial) one.
func benchSubmitCase(b *testing.B, typ string, user func(int64) int64, call func(*asynq.Task, string) error, serial bool) {
	const keys = 1000
	q := "q-" + uniq(b)
	for u := range int64(keys) { // the keys the duplicate cases meet, taken untimed
		if err := call(asynq.NewTask(typ, benchPayload(u, 0)), q); err != nil {
			b.Fatal(err)
		}
	}
	var n atomic.Int64
	one := func() bool {
		i := keys + n.Add(1)
		if err := call(asynq.NewTask(typ, benchPayload(user(i), i)), q); err != nil {
			b.Error(err)
			return false
		}
		return true
	}
	b.ReportAllocs()
	cpu0 := processCPU()
	b.ResetTimer()
	if serial {
		for range b.N {
			if !one() {
				return
			}
		}
	} else {
		b.SetParallelism(16) // 32 goroutines on 2 cores
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if !one() {
					return
				}
			}
		})
	}
	b.ReportMetric(float64((processCPU()-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu-µs/op")
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
