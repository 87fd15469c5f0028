package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Releasing an orphaned lock counted in its type's waiting set (MaxPending)
// must drop its entry there, as the release help promises ("and its entry
// in the type's waiting set"). The holder is missing, so the type read from
// its asynq record is "", and the release script is given the waiting set
// of type "".
func TestReleaseOrphanFreesWaitingSlot(t *testing.T) {
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{"email:welcome": {MaxPending: 1}}})
	ctx := context.Background()
	info := f.enqueue(f.qa, "email:welcome", 1)
	wait := store.NewKeys(f.prefix).Wait(f.qa, "email:welcome")
	if n := f.rdb.ZCard(ctx, wait).Val(); n != 1 {
		t.Fatalf("precondition: waiting set %d", n)
	}
	if err := f.insp.DeleteTask(f.qa, info.ID); err != nil {
		t.Fatal(err)
	}
	key := f.lockOf(info)
	f.ok("release", "--yes", key)
	if n := f.rdb.ZCard(ctx, wait).Val(); n != 0 {
		t.Errorf("after releasing the orphaned lock the waiting set still counts %d key(s)", n)
	}
	if _, err := f.client.Enqueue(asynq.NewTask("email:welcome", []byte(`{"user_id":2}`)), asynq.Queue(f.qa), dedup.Fields("user_id")); err != nil {
		t.Errorf("a new key is refused after the operator released the only waiting lock: %v", err)
	}
}

// The holder changes while the operator is asked: the release must leave
// the new holder's lock alone.
func TestReleaseOwnerChangesDuringPrompt(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info := f.enqueue(f.qa, "email:welcome", 1)
	key := f.lockOf(info)
	var next *asynq.TaskInfo
	in := &actingReader{act: func() {
		// The holder is deleted and its lock released; new work takes the key.
		_ = f.insp.DeleteTask(f.qa, info.ID)
		f.rdb.Del(context.Background(), key)
		next = f.enqueue(f.qa, "email:welcome", 1)
	}, data: "y\n"}
	r := f.run(in, "release", key)
	if r.code == 0 || !strings.Contains(r.stderr, "changed holder") {
		t.Errorf("release while the holder changed: %v", r)
	}
	if holder := f.rdb.Get(context.Background(), key).Val(); holder == "" || next == nil || !strings.HasSuffix(holder, ":"+next.ID) {
		t.Errorf("the new holder's lock was released (the lock is %q)", holder)
	}
}

type actingReader struct {
	act  func()
	data string
	done bool
}

func (r *actingReader) Read(p []byte) (int, error) {
	if !r.done {
		r.done = true
		r.act()
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	if n == 0 {
		return 0, errEOF
	}
	return n, nil
}

var errEOF = io.EOF

// Queue names with glob and brace characters: list --queue matches exactly
// that queue, show/release parse the key back to it.
func TestOddQueueNames(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	suffix := randHex(3)
	queues := []string{"a*b-" + suffix, "a?b-" + suffix, "x}y-" + suffix, "q[1]-" + suffix, `back\slash-` + suffix, "l}:u:0123456789abcdef-" + suffix, "m}:l:0123456789abcdef-" + suffix}
	infos := map[string]*asynq.TaskInfo{}
	for _, q := range queues {
		infos[q] = f.enqueue(q, "odd", 1)
	}
	for _, q := range queues {
		o := decode[listOutput](t, f.ok("--json", "list", "--queue", q))
		if o.Count != 1 || o.Locks[0].Queue != q || o.Locks[0].Holder != infos[q].ID {
			t.Errorf("list --queue %q: %+v", q, o)
		}
		key := f.lockOf(infos[q])
		s := decode[showOutput](t, f.ok("--json", "show", key))
		if s.Queue != q || s.Holder != infos[q].ID {
			t.Errorf("show %q: queue %q holder %q", key, s.Queue, s.Holder)
		}
		s2 := decode[showOutput](t, f.ok("--json", "show", "--task", infos[q].ID))
		if s2.Key != key {
			t.Errorf("show --task %s (no --queue): key %q, want %q", infos[q].ID, s2.Key, key)
		}
	}
}

// The same work locked in two queues by two tasks: show --task picks the
// lock the task owns; release --task releases only that one.
func TestSameKeyTwoQueues(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	a := f.enqueue(f.qa, "email:welcome", 1)
	b := f.enqueue(f.qb, "email:welcome", 1)
	o := decode[showOutput](t, f.ok("--json", "show", "--task", b.ID))
	if o.Queue != f.qb || o.Holder != b.ID {
		t.Errorf("show --task %s: queue %q holder %q", b.ID, o.Queue, o.Holder)
	}
	f.ok("release", "--yes", "--task", a.ID)
	if f.exists(f.lockOf(a)) || !f.exists(f.lockOf(b)) {
		t.Errorf("release --task %s released the wrong lock", a.ID)
	}
}

// README (dedupctl): "release deletes the lock only if its holder is still
// the one it showed … note: holder … is still pending in asynq: releasing
// deletes no task; it still runs, checking the key first (it takes it if
// free, else gives way)". The holder here was enqueued under a caller-chosen
// ID with a per-call dedup.Key; after the release another task of the key
// is enqueued. When the released holder starts, it must take its own key
// again (and wait, since it is held), not run beside the key's other task.
func TestReleasedCallerIDOwnerTakesItsOwnKeyAgain(t *testing.T) {
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
		t.Errorf("key tenant-7: %s started while %s ran (released holder %s, new task %s); overlaps %v", id, first, ownerID, second.ID, overlap)
	case <-time.After(3 * time.Second):
	}
}

// README (Lock API, and release's own note): "A follow-up the lock owes
// that waits is queued now", also while the holder runs (the holder's run no
// longer holds the lock that would queue it at its end); dedupctl release
// prints "follow-up task … is queued now". After `dedupctl release --yes` of
// a running lock that owes a follow-up, and the run's end, the follow-up is
// pending, not left parked.
func TestReleaseOfARunningLockQueuesItsFollowUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
	}})
	running := f.enqueue(f.qb, "report:build", 1)
	started, finish := f.startServer(f.qb)
	select {
	case id := <-started:
		if id != running.ID {
			t.Fatalf("server ran %s, want %s", id, running.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never ran the task")
	}
	key := f.lockOf(running)
	f.waitRunning(key)
	follow := f.enqueue(f.qb, "report:build", 1)
	if follow.ID == running.ID {
		t.Fatal("the second enqueue did not create a follow-up")
	}
	r := f.ok("release", "--yes", key)
	if !strings.Contains(r.stdout, "is queued now") {
		t.Fatalf("release's note:\n%s", r.stdout)
	}
	finish() // the run ends (nil), and the server stops
	// The server may take the follow-up between the run's end and its stop:
	// that it ran proves it was queued too.
	for len(started) > 0 {
		if <-started == follow.ID {
			return
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for f.taskState(f.qb, follow.ID) != "pending" {
		if time.Now().After(deadline) {
			ti, _ := f.insp.GetTaskInfo(f.qb, follow.ID)
			due := ""
			if ti != nil {
				due = time.Until(ti.NextProcessAt).Round(time.Second).String()
			}
			t.Fatalf("after the released holder's run ended, its follow-up %s is %s (due in %s), want pending: release said it is queued now",
				follow.ID, f.taskState(f.qb, follow.ID), due)
		}
		time.Sleep(20 * time.Millisecond) // asynq's record changes without a signal
	}
}
