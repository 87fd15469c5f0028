package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// masterOf returns the address of the master serving queue's slot.
func masterOf(t *testing.T, c *redis.ClusterClient, queue string) string {
	t.Helper()
	node, err := c.MasterForKey(context.Background(), "{"+queue+"}")
	if err != nil {
		t.Fatal(err)
	}
	return node.Options().Addr
}

// The tests that own a cluster run in two lanes, each one test after
// another in a single parallel slot: redistest.OwnCluster lets two such
// clusters live at once, and as parallel tests of their own, the ones
// waiting for a cluster held slots that the other tests were waiting for.

// TestClusterMasterFaults: a master dies or hangs.
func TestClusterMasterFaults(t *testing.T) {
	t.Parallel()
	runLane(t, []lane{
		{"DeadMasterStaysItsOwnProblem", testClusterDeadMasterStaysItsOwnProblem},
		{"KilledMasterRecoversAfterPromotion", testClusterKilledMasterRecoversAfterPromotion},
		{"HeartbeatGoesOnWhenOneMasterDies", testClusterHeartbeatGoesOnWhenOneMasterDies},
		{"SettleOnAHealthyMasterDoesNotWaitForAHungOne", testClusterSettleOnAHealthyMasterDoesNotWaitForAHungOne},
	})
}

// TestClusterTopologyChanges: a failover, and a slot migrating.
func TestClusterTopologyChanges(t *testing.T) {
	t.Parallel()
	runLane(t, []lane{
		{"ManualFailoverWithHandlersRunning", testClusterManualFailoverWithHandlersRunning},
		{"BreakerClosesAfterFailover", testClusterBreakerClosesAfterFailover},
		{"OpenBreakerLearnsOfThePromotion", testClusterOpenBreakerLearnsOfThePromotion},
		{"SlotMigrationLosesNothing", testClusterSlotMigrationLosesNothing},
	})
}

// lane is one test of a cluster lane.
type lane struct {
	name string
	run  func(*testing.T)
}

func runLane(t *testing.T, tests []lane) {
	for _, c := range tests {
		t.Run(c.name, c.run)
	}
}

// A master killed with SIGKILL is its own problem: enqueues to its queue
// fail with ErrUnavailable (then fast, ErrCircuitOpen, once its breaker
// opens), while enqueues to the other masters' queues, sent concurrently
// and batched, all succeed, before and after that breaker opened.
func testClusterDeadMasterStaysItsOwnProblem(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, false)
	queues := queuesOnEveryMaster(t, c, "shard")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), BreakerThreshold: 3, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	seq := 0
	enqueue := func(q string) error {
		seq++
		_, err := client.EnqueueContext(ctx, asynq.NewTask("shard:job", fmt.Appendf(nil, `{"n":%d}`, seq)), asynq.Queue(q))
		return err
	}
	for _, q := range queues {
		if err := enqueue(q); err != nil {
			t.Fatalf("before the kill, queue %s: %v", q, err)
		}
	}
	dead := queues[0]
	for _, p := range procs {
		if p.Addr == masterOf(t, c, dead) {
			p.Kill()
		}
	}

	// 32 producers, each enqueueing to all three queues in turn.
	var (
		mu   sync.Mutex
		errs = map[string][]error{}
		wg   sync.WaitGroup
		n    = 0
	)
	for p := range 32 {
		wg.Go(func() {
			for i := range 9 {
				q := queues[(p+i)%len(queues)]
				mu.Lock()
				n++
				task := asynq.NewTask("shard:job", fmt.Appendf(nil, `{"p":%d,"i":%d}`, p, i))
				mu.Unlock()
				_, err := client.EnqueueContext(ctx, task, asynq.Queue(q))
				if err != nil {
					mu.Lock()
					errs[q] = append(errs[q], err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	for _, q := range queues[1:] {
		if len(errs[q]) > 0 {
			t.Errorf("queue %s on a healthy master: %d errors, first %v", q, len(errs[q]), errs[q][0])
		}
	}
	if len(errs[dead]) == 0 {
		t.Fatalf("queue %s on the dead master: no errors", dead)
	}
	for _, err := range errs[dead] {
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("queue %s on the dead master: %v, want ErrUnavailable", dead, err)
		}
	}
	if st := d.breakerState(); st != breakerOpen {
		t.Fatalf("breaker state %v after the dead master's failures, want open (its node's)", st)
	}
	// With the dead master's breaker open, the others go on.
	for _, q := range queues[1:] {
		if err := enqueue(q); err != nil {
			t.Errorf("queue %s after the dead master's breaker opened: %v", q, err)
		}
	}
	if err := enqueue(dead); !errors.Is(err, ErrCircuitOpen) || !errors.Is(err, ErrUnavailable) {
		t.Errorf("queue %s once its breaker is open: %v, want ErrCircuitOpen within ErrUnavailable", dead, err)
	}
	t.Logf("%d enqueues; %d failed, all on the dead master's queue", n, len(errs[dead]))
}

// clusterView says, for a failure's message, first a verdict: whether the
// live nodes of procs (all but dead, the killed master) give queue q's
// slot to a promoted node (then the client failed to learn of it), to the
// dead master still (the cluster never promoted a replica), or disagree (a
// promotion only some nodes heard of). Then which master the client maps q
// to, what its slot map reloads (watch) heard, and what each live node
// thinks: its ROLE, the master its CLUSTER SLOTS names for the slot, and
// each node its CLUSTER NODES knows (address, flags, master, config epoch,
// link).
func clusterView(c *redis.ClusterClient, watch *slotsWatch, procs []*redistest.Proc, q, dead string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var b strings.Builder
	if n, err := c.MasterForKey(ctx, "{"+q+"}"); err != nil {
		fmt.Fprintf(&b, "client: no master for %s: %v", q, err)
	} else {
		fmt.Fprintf(&b, "client maps %s to %s", q, n.Options().Addr)
	}
	slot := -1
	named := map[string][]string{} // master named for the slot → the live nodes naming it
	for _, p := range procs {
		if p.Addr == dead {
			continue
		}
		nc := redis.NewClient(&redis.Options{Addr: p.Addr, MaxRetries: -1})
		if slot < 0 {
			if n, err := nc.ClusterKeySlot(ctx, "{"+q+"}").Result(); err == nil {
				slot = int(n)
				if watch != nil {
					fmt.Fprintf(&b, "; %s", watch.about(slot))
				}
			}
		}
		role, err := nc.Do(ctx, "ROLE").Slice()
		if err != nil {
			fmt.Fprintf(&b, "; node %s: %v", p.Addr, err)
			named["(no answer)"] = append(named["(no answer)"], p.Addr)
			_ = nc.Close()
			continue
		}
		m := slotMaster(nc.ClusterSlots(ctx).Val(), slot)
		named[m] = append(named[m], p.Addr)
		fmt.Fprintf(&b, "; node %s: %v, slot %d on %s", p.Addr, role[0], slot, m)
		nodes, _ := nc.ClusterNodes(ctx).Result()
		addrOf := map[string]string{}
		for line := range strings.Lines(nodes) {
			if f := strings.Fields(line); len(f) > 7 {
				addrOf[f[0]] = strings.Split(f[1], "@")[0]
			}
		}
		fmt.Fprintf(&b, ", knows [")
		for line := range strings.Lines(nodes) {
			f := strings.Fields(line)
			if len(f) <= 7 {
				continue
			}
			of := ""
			if f[3] != "-" {
				of = " of " + addrOf[f[3]]
			}
			fmt.Fprintf(&b, " %s %s%s e%s %s;", strings.Split(f[1], "@")[0], f[2], of, f[6], f[7])
		}
		fmt.Fprintf(&b, " ]")
		_ = nc.Close()
	}
	var verdict string
	switch {
	case len(named) > 1:
		verdict = fmt.Sprintf("the live nodes disagree on the master of %s's slot (%v): a promotion only part of the cluster heard of", q, named)
	case len(named[dead]) > 0:
		verdict = fmt.Sprintf("every live node still gives %s's slot to the dead master %s: the cluster never promoted a replica", q, dead)
	default:
		for m := range named {
			verdict = fmt.Sprintf("every live node gives %s's slot to %s: the cluster promoted it, the client has not learnt of it", q, m)
		}
	}
	return verdict + "; " + b.String()
}

// logNodesOnFailure logs, if the test fails, the logs of the nodes of
// procs still running then (call it after OwnCluster: it runs before the
// cluster's cleanups kill them).
func logNodesOnFailure(t *testing.T, procs []*redistest.Proc) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, p := range procs {
			if l := p.Log(); l != "" {
				t.Logf("log of node %s:\n%s", p.Addr, l)
			}
		}
	})
}

// slotMaster is the master CLUSTER SLOTS names for slot ("none" if no range
// holds it).
func slotMaster(slots []redis.ClusterSlot, slot int) string {
	for _, s := range slots {
		if s.Start <= slot && slot <= s.End && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr
		}
	}
	return "none"
}

// slotsWatch records a Cluster client's slot map reloads (the CLUSTER
// SLOTS calls go-redis makes on its node clients), for a failure's message.
type slotsWatch struct {
	mu    sync.Mutex
	start time.Time
	loads []slotsLoad
}

// slotsLoad is one reload: when, from which node, and its answer.
type slotsLoad struct {
	at    time.Time
	from  string
	slots []redis.ClusterSlot
}

// watchSlots starts recording c's reloads; call it before c's first call
// (it sees the node clients made after it).
func watchSlots(c *redis.ClusterClient) *slotsWatch {
	w := &slotsWatch{start: time.Now()}
	c.OnNewNode(func(nc *redis.Client) {
		addr := nc.Options().Addr
		nc.AddHook(slotsHook{w, addr})
	})
	return w
}

// about says how often the client reloaded its slot map, and which node
// named which master for slot, how often, and when last (since the watch
// began).
func (w *slotsWatch) about(slot int) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.loads) == 0 {
		return "the client never reloaded its slot map"
	}
	type said struct{ from, named string }
	var order []said
	count, last := map[said]int{}, map[said]time.Time{}
	for _, l := range w.loads {
		k := said{l.from, slotMaster(l.slots, slot)}
		if count[k] == 0 {
			order = append(order, k)
		}
		count[k]++
		last[k] = l.at
	}
	var b strings.Builder
	fmt.Fprintf(&b, "the client loaded its slot map %d times, the last %v ago; for slot %d:", len(w.loads),
		time.Since(w.loads[len(w.loads)-1].at).Round(time.Millisecond), slot)
	for _, k := range order {
		fmt.Fprintf(&b, " %s named %s %d times (last at +%v),", k.from, k.named, count[k], last[k].Sub(w.start).Round(time.Millisecond))
	}
	return strings.TrimSuffix(b.String(), ",")
}

type slotsHook struct {
	w    *slotsWatch
	addr string
}

func (h slotsHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h slotsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h slotsHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if sc, ok := cmd.(*redis.ClusterSlotsCmd); ok && err == nil {
			h.w.mu.Lock()
			h.w.loads = append(h.w.loads, slotsLoad{time.Now(), h.addr, sc.Val()})
			h.w.mu.Unlock()
		}
		return err
	}
}

// forcedTakeover returns a function that, called while the test waits for a
// replica to be promoted (its master killed, or a manual failover asked
// for), makes the replica take over (CLUSTER FAILOVER TAKEOVER) once Redis
// has not promoted it for 8 s after since: on a machine whose CPUs other
// processes keep busy, the election (node timeout 2 s, gossip, votes) can
// stall for a minute and a manual failover's handshake can give up, and
// what the tests check is the library's recovery after a promotion, not
// Redis's election.
func forcedTakeover(replica *redis.Client, since time.Time) func() {
	done := false
	return func() {
		if done || time.Since(since) < 8*time.Second {
			return
		}
		done = replica.Do(context.Background(), "CLUSTER", "FAILOVER", "TAKEOVER").Err() == nil
	}
}

// A master killed with SIGKILL is replaced by its replica (node timeout
// 2 s): enqueues to its queue fail with ErrUnavailable until the promotion
// and succeed again soon after it (each failure asks go-redis to reload
// the slot map; the breaker probes every BreakerBackoff); no task reported
// failed was stored; the other queues never fail; a task and its lock
// written (and replicated) before the kill survive it: its duplicate is
// still refused.
func testClusterKilledMasterRecoversAfterPromotion(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	watch := watchSlots(c)
	logNodesOnFailure(t, procs)
	queues := queuesOnEveryMaster(t, c, "promo")
	ctx := context.Background()
	// LockTimeout leaves the live masters room for a loaded machine: a
	// dead master's calls fail at once (connection refused) whatever it is.
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), LockTimeout: time.Second, Logger: quietLogger(),
		breakerBackoff: backoff{Min: 100 * time.Millisecond, Max: 500 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	dead := queues[0]
	for _, q := range queues[1:] {
		// A queue's first enqueue registers it in asynq's set of queues, a
		// key of one master's (asynq's own client does the same): warm
		// the queues up, as producers running before the kill would have.
		if _, err := client.EnqueueContext(ctx, asynq.NewTask("promo:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
			t.Fatal(err)
		}
	}
	before := asynq.NewTask("promo:job", []byte(`{"k":"before"}`))
	first, err := client.EnqueueContext(ctx, before, asynq.Queue(dead))
	if err != nil {
		t.Fatal(err)
	}
	var master, replica *redistest.Proc
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, dead) {
			master, replica = p, procs[3+i]
		}
	}
	mc := redis.NewClient(&redis.Options{Addr: master.Addr})
	if n, err := mc.Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica: %d %v", n, err)
	}
	_ = mc.Close()
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	t.Cleanup(func() { _ = rc.Close() })

	master.Kill()
	killed := time.Now()
	var promoted, recovered time.Time
	failures := 0
	var failed []string
	var lastErr error
	takeover := forcedTakeover(rc, killed)
	for i := 0; recovered.IsZero(); i++ {
		if time.Since(killed) > 60*time.Second {
			seen := "never seen promoted"
			if !promoted.IsZero() {
				seen = fmt.Sprintf("seen promoted %v after the kill", promoted.Sub(killed).Round(time.Millisecond))
			}
			t.Fatalf("no recovery 60 s after the kill (replica %s %s, %d failures, the last: %v; %s)", replica.Addr, seen, failures, lastErr, clusterView(c, watch, procs, dead, master.Addr))
		}
		takeover()
		if promoted.IsZero() && strings.Contains(rc.Info(ctx, "replication").Val(), "role:master") {
			promoted = time.Now()
		}
		for _, q := range queues[1:] {
			if _, err := client.EnqueueContext(ctx, asynq.NewTask("promo:job", fmt.Appendf(nil, `{"q":%q,"i":%d}`, q, i)), asynq.Queue(q)); err != nil {
				t.Fatalf("queue %s on a live master, %v after the kill: %v", q, time.Since(killed), err)
			}
		}
		id := fmt.Sprintf("promo-%d", i) // a caller-chosen ID, to look for it afterwards
		_, err := client.EnqueueContext(ctx, asynq.NewTask("promo:job", fmt.Appendf(nil, `{"i":%d}`, i)), asynq.Queue(dead), asynq.TaskID(id))
		switch {
		case err == nil:
			recovered = time.Now()
		case !errors.Is(err, ErrUnavailable):
			t.Fatalf("queue %s on the killed master: %v, want ErrUnavailable", dead, err)
		default:
			failures++
			lastErr = err
			if !errors.Is(err, ErrOutcomeUnknown) {
				failed = append(failed, id)
			}
			time.Sleep(50 * time.Millisecond) // the time under test: polling the recovery
		}
	}
	// No task reported failed (as opposed to "outcome unknown") was stored.
	insp := asynq.NewInspectorFromRedisClient(c)
	for _, id := range failed {
		if ti, err := insp.GetTaskInfo(dead, id); err == nil {
			t.Errorf("task %s was reported failed but is stored (%v)", id, ti.State)
		}
	}
	if promoted.IsZero() {
		t.Fatal("recovered before the replica was seen promoted")
	}
	t.Logf("promoted %v after the kill; enqueues recovered %v after the promotion (%d failures meanwhile)",
		promoted.Sub(killed).Round(time.Millisecond), recovered.Sub(promoted).Round(time.Millisecond), failures)
	if lag := recovered.Sub(promoted); lag > 5*time.Second {
		t.Errorf("recovered %v after the promotion; want within 5 s (a slot map reload and a breaker probe)", lag)
	}
	var dup *DuplicateTaskError
	if _, err := client.EnqueueContext(ctx, before, asynq.Queue(dead)); !errors.As(err, &dup) || dup.Holder != first.ID {
		t.Fatalf("duplicate of the task written before the kill: %v, want a DuplicateTaskError naming %s", err, first.ID)
	}
	// No lock is left whose owner cannot run (what dedupctl doctor looks for).
	var keys []string
	var mu sync.Mutex
	_ = c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		ks, _ := m.Keys(ctx, store.NewKeys(d.cfg.Prefix).LockPattern("")).Result()
		mu.Lock()
		keys = append(keys, ks...)
		mu.Unlock()
		return nil
	})
	ls, err := store.ReadLocks(ctx, c, d.store.Keys(), keys)
	if err != nil {
		t.Fatal(err)
	}
	if ds, _, err := store.Diagnose(ctx, c, ls, 0, time.Now()); err != nil || len(ds) > 0 {
		t.Fatalf("after the recovery, locks whose owner cannot run: %+v %v", ds, err)
	}
}

// A manual failover (CLUSTER FAILOVER on a replica) while producers enqueue
// and handlers run: no producer error, every accepted task runs exactly
// once, and no key ever runs twice at once.
func testClusterManualFailoverWithHandlersRunning(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	queue := queuesOnEveryMaster(t, c, "fo")[0]
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "dd-" + uniq(t), Logger: quietLogger(), heartbeat: (3 * time.Second) / 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	var (
		mu      sync.Mutex
		running = map[string]bool{}
		runs    = map[string]int{}
		overlap []string
	)
	handler := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		key := string(task.Payload()[:10]) // {"user":NN
		mu.Lock()
		if running[key] {
			overlap = append(overlap, key)
		}
		running[key] = true
		runs[id]++
		mu.Unlock()
		time.Sleep(50 * time.Millisecond) // simulated work
		mu.Lock()
		running[key] = false
		mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(c, asynq.Config{Concurrency: 8, Queues: map[string]int{queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond }})
	if err := srv.Start(d.Middleware()(handler)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)

	client := d.NewClient()
	var (
		accepted []string
		perrs    []error
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	for p := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				payload := fmt.Appendf(nil, `{"user":%d,"seq":%d}`, 10+(p*7+i)%20, i)
				info, err := client.EnqueueContext(ctx, asynq.NewTask("fo:job", payload), asynq.Queue(queue), Fields("user"))
				var dup *DuplicateTaskError
				mu.Lock()
				switch {
				case err == nil:
					accepted = append(accepted, info.ID)
				case !errors.As(err, &dup):
					perrs = append(perrs, err)
				}
				mu.Unlock()
				time.Sleep(5 * time.Millisecond) // a steady trickle
			}
		})
	}
	var replica *redistest.Proc
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, queue) {
			replica = procs[3+i]
		}
	}
	time.Sleep(time.Second) // the time under test: load before the failover
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	t.Cleanup(func() { _ = rc.Close() })
	asked := time.Now()
	if err := rc.Do(ctx, "CLUSTER", "FAILOVER").Err(); err != nil {
		t.Fatal(err)
	}
	// A manual failover that does not complete in Redis's own time (its
	// handshake gives up under load, and is not tried again) is forced.
	takeover := forcedTakeover(rc, asked)
	eventually(t, "the replica is promoted", func() bool {
		takeover()
		return strings.Contains(rc.Info(ctx, "replication").Val(), "role:master")
	})
	time.Sleep(time.Second) // and load after it
	close(stop)
	wg.Wait()
	eventually(t, "every accepted task ran", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range accepted {
			if runs[id] == 0 {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	if len(perrs) > 0 {
		t.Errorf("%d producer errors across the failover, first: %v", len(perrs), perrs[0])
	}
	for _, id := range accepted {
		if runs[id] != 1 {
			t.Errorf("task %s ran %d times", id, runs[id])
		}
	}
	if len(overlap) > 0 {
		t.Errorf("keys run twice at once: %v", overlap)
	}
	t.Logf("%d tasks accepted and run once each across the failover", len(accepted))
}

// After a master dies and its replica is promoted, and every queue's calls
// succeed again, d.BreakerState() must say closed again ("reports the worst
// of the masters' breakers", and the dead master is no longer one).
func testClusterBreakerClosesAfterFailover(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	watch := watchSlots(c)
	logNodesOnFailure(t, procs)
	queues := queuesOnEveryMaster(t, c, "a5bk")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "a5b-" + uniq(t), LockTimeout: 300 * time.Millisecond, Logger: quietLogger(),
		BreakerThreshold: 2, breakerBackoff: backoff{Min: 100 * time.Millisecond, Max: 300 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	for _, q := range queues {
		if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
			t.Fatal(err)
		}
	}
	dead := queues[0]
	var replica *redis.Client
	var deadAddr string
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, dead) {
			deadAddr = p.Addr
			replica = redis.NewClient(&redis.Options{Addr: procs[3+i].Addr})
			t.Cleanup(func() { _ = replica.Close() })
			p.Kill()
		}
	}
	start := time.Now()
	takeover := forcedTakeover(replica, start)
	opened := false
	ok := 0
	for i := 0; ok < 20; i++ {
		if time.Since(start) > 60*time.Second { // (a failover takes ~8 s; far more on a loaded machine)
			t.Fatalf("the dead master's queue never recovered (breaker %v; last error: %v; %s)", d.breakerState(), err, clusterView(c, watch, procs, dead, deadAddr))
		}
		takeover()
		_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:job", fmt.Appendf(nil, `{"i":%d}`, i)), asynq.Queue(dead))
		if d.breakerState() == breakerOpen {
			opened = true
		}
		if err == nil {
			ok++
		} else {
			ok = 0
			time.Sleep(50 * time.Millisecond) // polling the recovery
		}
	}
	if !opened {
		t.Log("the breaker never opened (the promotion came first)")
	}
	for _, q := range queues {
		if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"after"}`)), asynq.Queue(q)); err != nil {
			t.Fatalf("queue %s after the recovery: %v", q, err)
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for d.breakerState() != breakerClosed {
		if time.Now().After(deadline) {
			t.Fatalf("every queue enqueues again (20 in a row on the promoted master), but BreakerState() = %v, want closed: "+
				"the dead master's shard (its old address) keeps its open breaker for ever", d.breakerState())
		}
		_, _ = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"poll"}`)), asynq.Queue(dead))
		time.Sleep(50 * time.Millisecond)
	}
}

// A master dies and its breaker opens with a long wait (BreakerBackoff up
// to 30 s by default): no probe comes for a while, and every call of its
// queue is refused at once, without reaching Redis. Once its replica is
// promoted, the queue must still recover within seconds, not at the next
// probe or at go-redis's own periodic reload (ClusterStateReloadInterval,
// a minute): a refused call asks go-redis to reload the slot map (at most
// once a second), which then routes the queue's calls to the promoted
// replica, whose breaker is its own.
func testClusterOpenBreakerLearnsOfThePromotion(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	watch := watchSlots(c)
	logNodesOnFailure(t, procs)
	queues := queuesOnEveryMaster(t, c, "obp")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "obp-" + uniq(t), LockTimeout: 300 * time.Millisecond, Logger: quietLogger(),
		BreakerThreshold: 2, breakerBackoff: backoff{Min: 5 * time.Minute, Max: 5 * time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	for _, q := range queues {
		if _, err := client.EnqueueContext(ctx, asynq.NewTask("obp:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
			t.Fatal(err)
		}
	}
	dead := queues[0]
	var master, replica *redistest.Proc
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, dead) {
			master, replica = p, procs[3+i]
		}
	}
	rc := redis.NewClient(&redis.Options{Addr: replica.Addr})
	t.Cleanup(func() { _ = rc.Close() })
	master.Kill()
	killed := time.Now()
	// The calls fail until the breaker opens; then they are refused.
	// (d.breakerState() is not asked: it reloads the slot map itself.)
	for i := 0; ; i++ {
		_, err := client.EnqueueContext(ctx, asynq.NewTask("obp:job", fmt.Appendf(nil, `{"i":%d}`, i)), asynq.Queue(dead))
		if errors.Is(err, ErrCircuitOpen) {
			break
		}
		if err == nil || time.Since(killed) > 30*time.Second {
			t.Fatalf("queue %s on the killed master, %v after the kill: %v, want ErrCircuitOpen", dead, time.Since(killed), err)
		}
	}
	// The replica is promoted, and every live node says so.
	promoted := awaitPromotion(t, c, watch, procs, dead, master.Addr, replica.Addr, rc, killed)
	var last error
	for i := 0; ; i++ {
		_, last = client.EnqueueContext(ctx, asynq.NewTask("obp:job", fmt.Appendf(nil, `{"j":%d}`, i)), asynq.Queue(dead))
		if last == nil {
			break
		}
		if time.Since(promoted) > 10*time.Second {
			t.Fatalf("queue %s: %v, 10 s after every live node named the promoted replica %s (%s)",
				dead, last, replica.Addr, clusterView(c, watch, procs, dead, master.Addr))
		}
		time.Sleep(50 * time.Millisecond) // polling the recovery
	}
	t.Logf("recovered %v after the promotion was known to every live node", time.Since(promoted).Round(time.Millisecond))
}

// awaitPromotion waits (forcing it after 8 s: forcedTakeover) until the
// replica rc (at replica) of the killed master dead is a master and every
// live node of procs names it for queue q's slot, and returns when; it
// fails the test, saying what each node thinks, when that takes over 45 s:
// then the cluster, not the client, is at fault.
func awaitPromotion(t *testing.T, c *redis.ClusterClient, watch *slotsWatch, procs []*redistest.Proc, q, dead, replica string,
	rc *redis.Client, since time.Time) time.Time {
	t.Helper()
	takeover := forcedTakeover(rc, since)
	for {
		takeover()
		if everyNodeNames(procs, q, dead, replica) {
			return time.Now()
		}
		if time.Since(since) > 45*time.Second {
			t.Fatalf("%v after the kill of %s, its replica %s is not the master of queue %s's slot for every live node: "+
				"the cluster never promoted it (%s)", time.Since(since).Round(time.Millisecond), dead, replica, q, clusterView(c, watch, procs, q, dead))
		}
		time.Sleep(50 * time.Millisecond) // gossip has no signal to wait on
	}
}

// everyNodeNames reports whether every node of procs but dead answers and
// names addr as the master of queue q's slot (CLUSTER SLOTS).
func everyNodeNames(procs []*redistest.Proc, q, dead, addr string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for _, p := range procs {
		if p.Addr == dead {
			continue
		}
		nc := redis.NewClient(&redis.Options{Addr: p.Addr, MaxRetries: -1})
		slot, err := nc.ClusterKeySlot(ctx, "{"+q+"}").Result()
		var slots []redis.ClusterSlot
		if err == nil {
			slots, err = nc.ClusterSlots(ctx).Result()
		}
		_ = nc.Close()
		if err != nil || slotMaster(slots, int(slot)) != addr {
			return false
		}
	}
	return true
}

// With one master dead, the heartbeat keeps renewing the locks of tasks
// running on the other masters' queues ("the heartbeat renews each
// master's locks in a pipeline of their own, concurrently"): such a lock
// outlives several leases while its handler runs.
func testClusterHeartbeatGoesOnWhenOneMasterDies(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, false)
	queues := queuesOnEveryMaster(t, c, "a5hb")
	ctx := context.Background()
	const lease = 900 * time.Millisecond
	d, err := New(ctx, c, Config{Prefix: "a5h-" + uniq(t), heartbeat: (lease) / 3, LockTimeout: 300 * time.Millisecond, Logger: quietLogger(),
		BreakerThreshold: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	release := make(chan struct{})
	started := make(chan string, 8)
	srv := asynq.NewServerFromRedisClient(c, asynq.Config{
		Concurrency: 4, Queues: map[string]int{queues[0]: 1, queues[1]: 1, queues[2]: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, ShutdownTimeout: time.Second,
	})
	if err := srv.Start(d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		q, _ := asynq.GetQueueName(ctx)
		started <- q
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(func() { close(release); srv.Shutdown() }) }
	t.Cleanup(stop)
	client := d.WrapClient(asynq.NewClientFromRedisClient(c))
	keys := map[string]string{}
	for _, q := range queues[:2] {
		info, err := client.EnqueueContext(ctx, asynq.NewTask("a5:long", []byte(`{"k":"`+q+`"}`)), asynq.Queue(q))
		if err != nil {
			t.Fatal(err)
		}
		keys[q] = taskLock(t, c, q, info.ID)
	}
	running := map[string]bool{}
	for len(running) < 2 {
		select {
		case q := <-started:
			running[q] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("handlers never started (%v)", running)
		}
	}
	dead, live := queues[0], queues[1]
	for _, p := range procs {
		if p.Addr == masterOf(t, c, dead) {
			p.Kill()
		}
	}
	killed := time.Now()
	for time.Since(killed) < 4*lease { // the time under test: the live lock must outlive several leases
		ttl, err := c.PTTL(ctx, keys[live]).Result()
		if err != nil || ttl <= 0 {
			t.Fatalf("%v after the kill of another master, the running task's lock on queue %s: ttl %v err %v (heartbeat stalled)",
				time.Since(killed).Round(time.Millisecond), live, ttl, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// README (Failure modes): "a Cluster master dies | its queue's calls fail …;
// the other masters' queues go on | errors on that queue only".
//
// On a Cluster, one master hangs just as a task of its queue succeeds
// under a Cooldown, so that task's settle call (its cooling hold) hangs
// (until LockTimeout). (The tasks have caller-chosen IDs: their cooldowns
// are settled by the middleware, not kept by asynq's record, call.keptFor.) A task of a queue on a healthy master then succeeds:
// its settle must not wait behind the hung one, so its key cools at once.
func testClusterSettleOnAHealthyMasterDoesNotWaitForAHungOne(t *testing.T) {
	_, c := redistest.OwnCluster(t, 3, false)
	// A try is conclusive when the healthy queue's task ran while the hung
	// master was still paused; asynq's own calls may meet that master (its
	// registries' keys may live there) and run it only after the pause: then
	// the scenario is made again, on new queues.
	for try := 1; ; try++ {
		if settleBesideAHungMaster(t, c, fmt.Sprintf("a10t%d", try)) {
			return
		}
		if try == 5 {
			t.Fatalf("the healthy queue's task ran after the pause in %d tries: the scenario could not be made", try)
		}
	}
}

// settleBesideAHungMaster runs one try of
// TestClusterMasterFaults/SettleOnAHealthyMasterDoesNotWaitForAHungOne on queues tagged
// tag; conclusive is false when the healthy queue's task ran too late to
// meet the hung master's pause.
func settleBesideAHungMaster(t *testing.T, c *redis.ClusterClient, tag string) (conclusive bool) {
	t.Helper()
	ctx := context.Background()
	queues := queuesOnEveryMaster(t, c, tag)
	hungQ, okQ := queues[0], queues[1]
	prefix := "dd-" + uniq(t)
	d, err := New(ctx, c, Config{Prefix: prefix, LockTimeout: 3 * time.Second, Logger: quietLogger(), Rules: counterRules(Rule{Cooldown: time.Hour}).Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	hungNode, err := c.MasterForKey(ctx, "{"+hungQ+"}")
	if err != nil {
		t.Fatal(err)
	}
	seen := &scriptSeen{mark: lockKeyHex(prefix, hungQ, ""), seen: make(chan struct{})}
	c.AddHook(redistest.CmdHook(seen.check))
	// The hung queue's handler pauses its master, then succeeds.
	_, _ = serveRaw(t, c, hungQ, d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if err := hungNode.Do(context.Background(), "CLIENT", "PAUSE", 5000, "ALL").Err(); err != nil {
			t.Errorf("CLIENT PAUSE: %v", err)
		}
		seen.armed.Store(true)
		return nil
	})), nil)
	returned := make(chan time.Time, 1)
	okMW := func(next asynq.Handler) asynq.Handler { // outside dedup's: runs after its settle
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			err := next.ProcessTask(ctx, t)
			returned <- time.Now()
			return err
		})
	}
	_, _ = serveRaw(t, c, okQ, okMW(d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))), nil)
	client := d.NewClient()
	// The healthy queue is published in asynq's registry of queues now:
	// that key (asynq:queues) has one slot, which may be the hung master's.
	if err := d.store.PublishQueue(ctx, okQ); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(counterTask("h", 1, 1), asynq.Queue(hungQ), asynq.TaskID("h-"+tag)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, seen.seen, "the hung master's settle sent")
	sentAt := time.Now()
	okTask := counterTask("o", 1, 1)
	if _, err := client.Enqueue(okTask, asynq.Queue(okQ), asynq.TaskID("o-"+tag)); err != nil {
		t.Fatal(err)
	}
	at := waitFor(t, returned, "the healthy queue's task succeeds")
	fp, err := d.fingerprintHex(okTask.Type(), okTask.Payload(), ptr(d.ruleFor(okTask.Type())))
	if err != nil {
		t.Fatal(err)
	}
	key := lockKeyHex(prefix, okQ, fp)
	cooling := func() bool { return strings.HasPrefix(c.Get(ctx, key).Val(), "~c:") }
	// The settle is written before the handler's result reaches asynq: by
	// the time the outer middleware sees the handler return, it is done.
	took := time.Since(at)
	t.Logf("the healthy queue's handler returned %v after the hung settle was sent", at.Sub(sentAt).Round(time.Millisecond))
	if at.Sub(sentAt) > 2*time.Second {
		t.Logf("the healthy queue's task itself ran late (asynq's own calls met the hung master): inconclusive, trying again")
		return false
	}
	if !cooling() {
		t.Errorf("the key of a task on a healthy master does not cool %v after its handler returned: its settle waited behind the hung master's", took.Round(time.Millisecond))
	}
	return true
}

// ptr is a pointer to a copy of v.
func ptr[T any](v T) *T { return &v }

// scriptSeen signals the first script call carrying a key with mark once armed.
type scriptSeen struct {
	mark  string
	armed atomic.Bool
	once  sync.Once
	seen  chan struct{}
}

func (h *scriptSeen) check(cmd redis.Cmder) {
	if !h.armed.Load() {
		return
	}
	for _, a := range cmd.Args() {
		if s, ok := a.(string); ok && strings.HasPrefix(s, h.mark) {
			h.once.Do(func() { close(h.seen) })
			return
		}
	}
}
