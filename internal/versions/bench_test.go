package versions

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// What the path an asynq version gets costs, beside plain asynq in the same
// run (docs/versions.md): go test -run x -bench . ./internal/versions, with
// the linked version chosen as .ci/asynq-version.sh does. "asynq" is
// asynq's own client and a plain server; "NewClient" is the direct path on
// v0.26.0 and asynq's client before; "WrapClient" is asynq's client on
// every version. Every task is of a new key.

var enqueuers = []string{"asynq", "NewClient", "WrapClient"}

// benchEnv is a Dedup and the three enqueuers over one queue.
type benchEnv struct {
	q   string
	d   *dedup.Dedup
	enq map[string]dedup.Enqueuer
}

func newBenchEnv(b *testing.B) *benchEnv {
	redistest.NeedReal(b)
	uniq := redistest.Uniq(b)
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), PoolSize: 64})
	b.Cleanup(func() { _ = rdb.Close() })
	d, err := dedup.New(context.Background(), rdb, dedup.Config{Prefix: "vb-" + uniq, Logger: redistest.QuietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = d.Close() })
	plain := asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr(), PoolSize: 64})
	b.Cleanup(func() { _ = plain.Close() })
	return &benchEnv{q: uniq, d: d, enq: map[string]dedup.Enqueuer{
		"asynq": plain, "NewClient": d.NewClient(), "WrapClient": d.WrapClient(plain),
	}}
}

func BenchmarkEnqueueNewKey(b *testing.B) {
	for _, name := range enqueuers {
		b.Run(name, func(b *testing.B) {
			e := newBenchEnv(b)
			var n atomic.Int64
			b.ResetTimer()
			for b.Loop() {
				p := strconv.FormatInt(n.Add(1), 10)
				if _, err := e.enq[name].EnqueueContext(context.Background(), asynq.NewTask("bench", []byte(p)), asynq.Queue(e.q)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkDrain(b *testing.B) {
	for _, name := range enqueuers {
		b.Run(name, func(b *testing.B) {
			e := newBenchEnv(b)
			for i := range b.N {
				if _, err := e.enq[name].EnqueueContext(context.Background(), asynq.NewTask("bench", []byte(strconv.Itoa(i))), asynq.Queue(e.q)); err != nil {
					b.Fatal(err)
				}
			}
			var done atomic.Int64
			all := make(chan struct{})
			h := asynq.Handler(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
				if done.Add(1) == int64(b.N) {
					close(all)
				}
				return nil
			}))
			if name != "asynq" {
				h = e.d.Middleware()(h)
			}
			srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr(), PoolSize: 80}, asynq.Config{
				Concurrency: 64, Queues: map[string]int{e.q: 1}, LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second,
			})
			b.ResetTimer()
			if err := srv.Start(h); err != nil {
				b.Fatal(err)
			}
			<-all
			b.StopTimer()
			srv.Shutdown()
		})
	}
}
