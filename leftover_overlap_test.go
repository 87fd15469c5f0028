package dedup

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The invariant TestLifecycleMatrix checks: "no key ever had two live tasks
// or two overlapping runs (except under RunningAllow)". asynq gives up an
// attempt whose Timeout passed and retries it while its handler, which
// ignores its context, still runs. failures.md: the key "is held for the
// retry asynq makes, never released under it" and the outlived note keeps it
// from healing under the leftover. The retry's start checks the key (it is
// run again): it must not run beside the leftover handler of its own key.
func TestRetryDoesNotRunBesideTheLeftoverHandlerOfItsGivenUpAttempt(t *testing.T) {
	t.Parallel() // mostly waiting: beside the other waiting tests
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		release := make(chan struct{})
		defer close(release)
		rc := newRecorder(func(r run) error {
			if r.retry == 0 {
				<-release // ignores its context: outlives its Timeout
			}
			return nil
		})
		h.serve(rc.handler(), nil) // (retry delay 50 ms)
		a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
		waitFor(t, rc.runs, "the first attempt runs")
		eventually(t, "asynq gives the attempt up and the retry is due or done", func() bool {
			if len(rc.runs) > 0 {
				return true
			}
			ti, err := h.insp.GetTaskInfo(h.queue, a.ID)
			return err == nil && ti.Retried > 0 && ti.State == asynq.TaskStateRetry && ti.NextProcessAt.Before(time.Now().Add(-time.Second))
		})
		if len(rc.runs) > 0 {
			r := <-rc.runs
			t.Fatalf("the retry of %s (retry %d) runs while the handler of its given-up attempt still runs", r.id, r.retry)
		}
	})
}

// README: a leftover handler of an old attempt "cannot renew or release:
// every lock call checks the task ID and the attempt"; (Lock lifecycle)
// "asynq gives the attempt up (… shutdown outlived) and the handler returns
// later, whatever it returns | follows the task's record: held while asynq
// will run the task again (retry, requeued by shutdown even on the last
// attempt)".
//
// Server 1 runs A's first attempt and shuts down; the handler outlives
// ShutdownTimeout and asynq puts A back, retry count still 0, its record
// marked (dedup-lost: outlived). Server 2 (a Dedup of its own) takes A and
// finds its key held by that handler: A does not run beside it, and asynq
// archives it (MaxRetry(0)). The leftover on server 1 then returns nil;
// an operator runs A again: it runs on server 2 holding its own lock, which
// nothing the leftover did released, and a duplicate of A's key is refused
// while A runs.
func TestLeftoverOfAShutdownRequeueLeavesTheRunningAttemptsLock(t *testing.T) {
	t.Parallel()
	h := newDirectHarness(t, Rule{})
	ctx := context.Background()
	started1, leftoverGo, leftoverDone := make(chan string, 4), make(chan struct{}), make(chan struct{})
	var once sync.Once
	_, stop1 := serveRaw(t, h.rdb, h.queue, h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started1 <- id
		<-leftoverGo // ignores its context: outlives ShutdownTimeout
		once.Do(func() { close(leftoverDone) })
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1; c.ShutdownTimeout = 300 * time.Millisecond })
	t.Cleanup(func() {
		select {
		case <-leftoverGo:
		default:
			close(leftoverGo)
		}
	})
	a := h.enqueue(counterTask("k", 1, 1), asynq.MaxRetry(0))
	requirePlainID(t, a.ID)
	key := h.keyOf(counterTask("k", 1, 1), h.queue)
	waitFor(t, started1, "A on server 1")
	stop1() // returns once ShutdownTimeout passed: A is put back
	eventually(t, "A put back in the queue", func() bool { return h.taskState(a.ID) == asynq.TaskStatePending })

	// Server 2 (another process: a Dedup of its own, same prefix).
	d2, err := New(ctx, h.rdb, Config{Prefix: h.prefix, Rules: counterRules(Rule{}).Rules, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Close() })
	started2, hold2 := make(chan string, 4), make(chan struct{})
	serveRaw(t, h.rdb, h.queue, d2.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started2 <- id
		<-hold2
		return nil
	})), func(c *asynq.Config) { c.Concurrency = 1 })
	t.Cleanup(func() { close(hold2) }) // (after the server: it runs first, so the shutdown waits for no blocked handler)
	eventually(t, "server 2 answers A busy behind its own handler, and asynq archives it", func() bool {
		return d2.Stats().Busy >= 1 && h.taskState(a.ID) == asynq.TaskStateArchived
	})
	if len(started2) > 0 {
		t.Fatalf("server 2 ran A beside its own handler on server 1")
	}

	close(leftoverGo) // the leftover on server 1 returns nil, long after asynq gave it up
	<-leftoverDone
	eventually(t, "the leftover's lock settled", func() bool {
		st := h.d.Stats()
		return st.Released+st.Held+st.LockLost+st.RedisErrors > 0
	})
	if err := h.insp.RunTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	if id := waitFor(t, started2, "A run again on server 2"); id != a.ID {
		t.Fatalf("server 2 ran %s, want %s", id, a.ID)
	}
	if h.taskState(a.ID) != asynq.TaskStateActive {
		t.Fatalf("A is %v, want still active on server 2", h.taskState(a.ID))
	}
	if owner := h.lockOwner(key); owner != a.ID {
		t.Errorf("A runs on server 2 but its lock is %q: the leftover attempt on server 1 (stats %+v) released it", owner, h.d.Stats())
	}
	info, err := h.client.Enqueue(counterTask("k", 1, 2), asynq.Queue(h.queue))
	var dup *DuplicateTaskError
	if !errors.As(err, &dup) {
		t.Errorf("enqueue of A's key while A runs on server 2: %v (task %v), want a duplicate of %s", err, info, a.ID)
	}
}

// The key's mode record notes that a handler asynq gave up still runs, so
// that the key does not heal under it. An operator releases that key while
// the handler runs, and then the handler ends: its note must end with it.
// Left behind, it named the task's next run (the same ID, taking the free
// key) as still running, and kept that key from healing after the task was
// archived, for as long as the note lasted; a fold into a new holder carried
// it over to that holder too.
func TestGivenUpHandlersNoteEndsWithItAfterItsKeyWasReleased(t *testing.T) {
	t.Parallel()
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx := context.Background()
		release := make(chan struct{})
		var once sync.Once
		finish := func() { once.Do(func() { close(release) }) }
		defer finish()
		rc := newRecorder(func(run) error { <-release; return nil }) // ignores its context
		h.serve(rc.handler(), nil)
		task := counterTask("k", 1, 1)
		a := h.enqueue(task, asynq.Timeout(time.Second), asynq.MaxRetry(0))
		waitFor(t, rc.runs, "the attempt runs")
		mode := store.ModeOf(h.keyOf(task, h.queue))
		note := func() error { return h.rdb.HGet(ctx, mode, store.FieldOutlived).Err() }
		eventually(t, "asynq gives the attempt up, and the key notes its handler", func() bool { return note() == nil })
		if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
			t.Fatalf("forced release of %s's key: %v, %v", a.ID, ok, err)
		}
		finish()
		eventually(t, "the note goes as the handler ends", func() bool { return errors.Is(note(), redis.Nil) })
	})
}
