//go:build unix

package dedup

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// BenchmarkSubmitClient is the library's own CPU for one Submit from one
// goroutine, with take.lua's answers made in process by a hook, so that
// no socket, syscall or Redis is in the measure (BenchmarkSubmit's times
// are mostly those, and too noisy to compare the library's share): a new
// key is taken, a key held by a task it has met is refused. Keys are met
// untimed through Redis first.
func BenchmarkSubmitClient(b *testing.B) {
	ctx := context.Background()
	rdb := newRDB(b).(*redis.Client)
	canned := &cannedTake{take: store.ScriptHash("take")}
	rdb.AddHook(canned)
	c := benchClient(b, rdb, "benchc-")
	const keys = 1000
	for _, tc := range []struct {
		name string
		user func(n int64) int64
	}{
		{"accepted", func(n int64) int64 { return n }},
		{"rejected", func(n int64) int64 { return n % keys }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			q := "q-" + uniq(b)
			submit := func(u, i int64) error {
				_, err := c.Submit(ctx, asynq.NewTask("bench:client", benchPayload(u, i)), asynq.Queue(q), Fields("user_id"))
				if _, dup := err.(*DuplicateTaskError); dup {
					return nil
				}
				return err
			}
			for u := range int64(keys) {
				if err := submit(u, 0); err != nil {
					b.Fatal(err)
				}
			}
			canned.on.Store(true)
			defer canned.on.Store(false)
			b.ReportAllocs()
			cpu0 := processCPU()
			b.ResetTimer()
			for i := range int64(b.N) {
				if err := submit(tc.user(keys+i), keys+i); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((processCPU()-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu-µs/op")
		})
	}
}

// cannedTake answers take.lua, once on, as Redis would for a free key
// ({1}) or for one held by the holder the call names ({0, holder}),
// without sending it.
type cannedTake struct {
	take string
	on   atomic.Bool
}

func (h *cannedTake) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cannedTake) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *cannedTake) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if !h.on.Load() || cmd.Name() != "evalsha" || len(a) < 3 || a[1] != h.take {
			return next(ctx, cmd)
		}
		nkeys, _ := a[2].(int)
		holder := fmt.Sprint(a[3+nkeys+8]) // ARGV[9]: the holder the call expects
		if holder == "" {
			cmd.(*redis.Cmd).SetVal([]any{int64(1)})
		} else {
			cmd.(*redis.Cmd).SetVal([]any{int64(0), holder})
		}
		return nil
	}
}
