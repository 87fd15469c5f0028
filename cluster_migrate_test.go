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
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// migration moves one slot from one master to another, step by step, as
// redis-cli --cluster reshard does.
type migration struct {
	t            *testing.T
	slot         int64
	src, dst     *redis.Client
	srcID, dstID string
	dstHost      string
	dstPort      string
}

func newMigration(t *testing.T, c *redis.ClusterClient, queue string, procs []*redistest.Proc) *migration {
	t.Helper()
	ctx := context.Background()
	slot, err := c.ClusterKeySlot(ctx, "{"+queue+"}").Result()
	if err != nil {
		t.Fatal(err)
	}
	src := masterOf(t, c, queue)
	m := &migration{t: t, slot: slot}
	for _, p := range procs {
		cl := redis.NewClient(&redis.Options{Addr: p.Addr})
		t.Cleanup(func() { _ = cl.Close() })
		id := cl.Do(ctx, "CLUSTER", "MYID").Val().(string)
		if p.Addr == src {
			m.src, m.srcID = cl, id
		} else if m.dst == nil {
			m.dst, m.dstID = cl, id
			m.dstHost, m.dstPort, _ = strings.Cut(p.Addr, ":")
		}
	}
	return m
}

// begin marks the slot importing on the destination, migrating on the source.
func (m *migration) begin() {
	ctx := context.Background()
	if err := m.dst.Do(ctx, "CLUSTER", "SETSLOT", m.slot, "IMPORTING", m.srcID).Err(); err != nil {
		m.t.Fatal(err)
	}
	if err := m.src.Do(ctx, "CLUSTER", "SETSLOT", m.slot, "MIGRATING", m.dstID).Err(); err != nil {
		m.t.Fatal(err)
	}
}

// moveSome migrates up to n of the slot's keys (without REPLACE: a key
// that exists on both sides fails with BUSYKEY) and reports how many keys
// are left on the source.
func (m *migration) moveSome(n int) int {
	ctx := context.Background()
	keys, err := m.src.ClusterGetKeysInSlot(ctx, int(m.slot), n).Result()
	if err != nil {
		m.t.Fatal(err)
	}
	for _, k := range keys {
		if err := m.src.Migrate(ctx, m.dstHost, m.dstPort, k, 0, 5*time.Second).Err(); err != nil && !errors.Is(err, redis.Nil) {
			m.t.Fatalf("MIGRATE %s: %v", k, err)
		}
	}
	left, err := m.src.ClusterCountKeysInSlot(ctx, int(m.slot)).Result()
	if err != nil {
		m.t.Fatal(err)
	}
	return int(left)
}

// finish hands the slot to the destination on both nodes.
func (m *migration) finish() {
	ctx := context.Background()
	for _, cl := range []*redis.Client{m.dst, m.src} {
		if err := cl.Do(ctx, "CLUSTER", "SETSLOT", m.slot, "NODE", m.dstID).Err(); err != nil {
			m.t.Fatal(err)
		}
	}
}

// A queue's slot migrates, slowly (10 keys at a time), while producers
// enqueue new and duplicate keys through both clients, a long task runs
// across it and a server works the queue: MIGRATE (without REPLACE) never
// meets BUSYKEY, every error matches ErrUnavailable (Redis said TRYAGAIN:
// nothing stored) or is a duplicate, and afterwards every accepted task
// runs once and no lock is left. (A refused WrapClient enqueue gives its
// lock back: its unlock declares only keys that exist, so it runs on one
// side of the migration.)
func testClusterSlotMigrationLosesNothing(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 2, false)
	queue := "mig-" + uniq(t)
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	clients := []*Client{d.NewClient(), d.WrapClient(asynq.NewClientFromRedisClient(c))}
	var (
		mu       sync.Mutex
		runs     = map[string]int{}
		retried  = map[string][]int{} // the retry count asynq gave each run of a task
		accepted = map[string]bool{}
	)
	holding, release := make(chan string, 1), make(chan struct{})
	srv := asynq.NewServerFromRedisClient(c, asynq.Config{Concurrency: 8, Queues: map[string]int{queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond }})
	if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		mu.Lock()
		runs[id]++
		retried[id] = append(retried[id], n)
		mu.Unlock()
		if strings.Contains(string(task.Payload()), `"user":5000`) {
			holding <- id
			<-release // runs across the whole migration
		}
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	var unavailable, dups int
	enqueue := func(round, n int) {
		for i := range n {
			for ci, cl := range clients {
				for _, user := range []int{i, 1000 + round*100 + i} { // an old key (a duplicate while it waits or runs), a new one
					info, err := cl.EnqueueContext(ctx, asynq.NewTask("mig:job", fmt.Appendf(nil, `{"user":%d,"c":%d}`, user, ci)), asynq.Queue(queue), Fields("user", "c"))
					var dup *DuplicateTaskError
					switch {
					case err == nil:
						mu.Lock()
						accepted[info.ID] = true
						mu.Unlock()
					case errors.As(err, &dup):
						dups++
					case errors.Is(err, ErrUnavailable):
						unavailable++ // Redis refused (TRYAGAIN) and nothing was stored
					default:
						t.Fatalf("round %d: %v", round, err)
					}
				}
			}
		}
	}
	held, err := clients[0].EnqueueContext(ctx, asynq.NewTask("mig:job", []byte(`{"user":5000,"c":0}`)), asynq.Queue(queue), Fields("user", "c"))
	if err != nil {
		t.Fatal(err)
	}
	accepted[held.ID] = true
	waitFor(t, holding, "the long task runs")
	enqueue(0, 10)
	m := newMigration(t, c, queue, procs)
	m.begin()
	for round := 1; ; round++ {
		enqueue(round, 5)
		if m.moveSome(10) == 0 {
			break
		}
	}
	enqueue(99, 5)
	m.finish()
	enqueue(100, 5)
	close(release)
	t.Logf("%d accepted, %d duplicates, %d unavailable (TRYAGAIN) during the migration", len(accepted), dups, unavailable)

	notRun := func() []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for id := range accepted {
			if runs[id] == 0 {
				out = append(out, id)
			}
		}
		return out
	}
	// A task asynq moved to active while the slot was migrating may have
	// found its next step refused (TRYAGAIN: our start, or asynq's own
	// retry); asynq's recoverer puts it back once its 30 s lease has been
	// expired for 30 s, so it runs within about a minute and a half.
	waited := time.Now()
	for deadline := time.Now().Add(150 * time.Second); len(notRun()) > 0 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond) // the server works through the queue; asynq's recoverer has its own clock
	}
	t.Logf("every accepted task ran %v after the migration", time.Since(waited).Round(100*time.Millisecond))
	for _, id := range notRun() {
		st := c.HGet(ctx, "asynq:{"+queue+"}:t:"+id, "state").Val()
		pos, perr := c.LPos(ctx, "asynq:{"+queue+"}:pending", id, redis.LPosArgs{}).Result()
		t.Errorf("accepted task %s never ran: state %q, pending position %d (%v)", id, st, pos, perr)
	}
	// A task runs once, unless asynq ran it again: its own step that marks
	// a task done can be refused mid-migration too (TRYAGAIN), and then its
	// recoverer retries the task (retry count + 1), as asynq does with any
	// success it could not record (README: "Release happens just before
	// asynq marks the task done"). A second run asynq did not retry would
	// be a duplicate this library let through.
	mu.Lock()
	for id := range accepted {
		rs := retried[id]
		for i := 1; i < len(rs); i++ {
			if rs[i] <= rs[i-1] {
				t.Errorf("accepted task %s ran %d times with retry counts %v: a run asynq did not retry", id, runs[id], rs)
				break
			}
		}
		if len(rs) > 1 {
			t.Logf("task %s ran %d times, retried by asynq (retry counts %v): its done step was refused mid-migration", id, len(rs), rs)
		}
	}
	mu.Unlock()
	leftLocks := func() []string {
		var (
			mu  sync.Mutex
			out []string
		)
		_ = c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			keys, _ := m.Keys(ctx, store.NewKeys(d.cfg.Prefix).LockPattern("")).Result()
			mu.Lock()
			out = append(out, keys...)
			mu.Unlock()
			return nil
		})
		return out
	}
	// A release refused during the migration (a wrapped task's, which the
	// middleware makes at its success) leaves its lock behind, held by a task
	// asynq has since completed: the key's next enqueue heals it at once. A
	// lock left must be such a one, or held by a task that ran and whose done
	// step asynq could not record (its record still says active, until its
	// recoverer retries it, above): never one that holds its key otherwise.
	for _, k := range leftLocks() {
		ls, err := store.ReadLocks(ctx, c, store.NewKeys(d.cfg.Prefix), []string{k})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range ls {
			mu.Lock()
			ran := runs[l.Owner] > 0
			mu.Unlock()
			if st := l.State(); st == "running" && l.TaskState == store.StateActive && ran {
				t.Logf("lock left: %s, held by %s, which ran and which asynq still records active (its done step refused mid-migration)", k, l.Owner)
			} else if st != "orphaned" {
				v := c.Get(ctx, k).Val()
				owner := holderIn(v)
				t.Errorf("lock left: %s %v ttl %v, state %q; owner %s record state %q, accepted %v", k, v, c.PTTL(ctx, k).Val(), st, owner,
					c.HGet(ctx, "asynq:{"+queue+"}:t:"+owner, "state").Val(), accepted[owner])
			}
		}
	}
}
