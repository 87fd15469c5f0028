package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// README (dedupctl): "release deletes the lock only if its owner is still
// the one it showed … note: holder … is still pending in asynq: releasing
// deletes no task; it still runs, checking the key first (it takes it if
// free, else gives way)". The owner here was enqueued under a caller-chosen
// ID with a per-call dedup.Key; after the release another task of the key
// is enqueued. When the released owner starts, it must take its own key
// again (and wait, since it is held), not run beside the key's other task.
func TestAdversary6ReleasedCallerIDOwnerTakesItsOwnKeyAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	opts := []asynq.Option{asynq.Queue(f.qa), dedup.Key("tenant-7")}
	ownerID := "a6-" + randHex(4)
	if _, err := f.client.EnqueueContext(ctx, asynq.NewTask("report:build", []byte(`{"seq":1}`)), append(opts, asynq.TaskID(ownerID))...); err != nil {
		t.Fatal(err)
	}
	keys := f.lockKeys()
	if len(keys) != 1 {
		t.Fatalf("locks %v, want one", keys)
	}
	r := f.run(nil, "release", "--yes", keys[0])
	if r.code != 0 || !strings.Contains(r.stdout, "it still runs, checking the key first (it takes it if free, else gives way)") {
		t.Fatalf("release: %v", r)
	}
	second, err := f.client.EnqueueContext(ctx, asynq.NewTask("report:build", []byte(`{"seq":2}`)), opts...)
	if err != nil {
		t.Fatalf("new task of the released key: %v", err)
	}

	var (
		mu      sync.Mutex
		running []string
		overlap []string
	)
	started := make(chan string, 10)
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{
		Concurrency: 4, Queues: map[string]int{f.qa: 1}, LogLevel: asynq.FatalLevel,
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		IsFailure:      dedup.IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	})
	err = srv.Start(f.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		if len(running) > 0 {
			overlap = append(overlap, fmt.Sprintf("%s started while %v ran", id, running))
		}
		running = append(running, id)
		mu.Unlock()
		started <- id
		select {
		case <-release:
		case <-ctx.Done():
		}
		mu.Lock()
		for i, x := range running {
			if x == id {
				running = append(running[:i:i], running[i+1:]...)
				break
			}
		}
		mu.Unlock()
		return nil
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		close(release) // (before the shutdown, which waits for the handlers)
		srv.Shutdown()
	})
	var first string
	select {
	case first = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("nothing ran")
	}
	select {
	case id := <-started:
		mu.Lock()
		defer mu.Unlock()
		t.Errorf("key tenant-7: %s started while %s ran (released owner %s, new task %s); overlaps %v", id, first, ownerID, second.ID, overlap)
	case <-time.After(3 * time.Second):
	}
}
