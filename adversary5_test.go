package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// ---- a proxy that lets one script run and then loses its reply ----

// lossProxy forwards a connection's commands to Redis. Armed, the first
// chunk that match selects is forwarded, its reply is dropped and the
// connection closed (the node died right after running the call); then the
// next `refuse` retries of that call (chunks match selects) are answered
// "-LOADING ..." (the node restarted and loads its data set); other calls
// pass.
type lossProxy struct {
	ln      net.Listener
	target  string
	armed   atomic.Bool
	loading atomic.Int64
	match   func([]byte) bool
	fired   chan struct{}
	once    sync.Once
	refuse  int64 // LOADING replies after the lost one
}

func newLossProxy(t *testing.T, target string, match func([]byte) bool) *lossProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lossProxy{ln: ln, target: target, match: match, fired: make(chan struct{}), refuse: 20}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *lossProxy) addr() string { return p.ln.Addr().String() }

// respCommands counts the complete RESP commands (arrays of bulk strings)
// in b.
func respCommands(b []byte) int {
	n := 0
	for len(b) > 0 {
		if b[0] != '*' {
			return n + 1
		}
		i := bytes.Index(b, []byte("\r\n"))
		if i < 0 {
			return n
		}
		args, _ := strconv.Atoi(string(b[1:i]))
		b = b[i+2:]
		for range args {
			j := bytes.Index(b, []byte("\r\n"))
			if j < 0 || b[0] != '$' {
				return n
			}
			l, _ := strconv.Atoi(string(b[1:j]))
			if len(b) < j+2+l+2 {
				return n
			}
			b = b[j+2+l+2:]
		}
		n++
	}
	return n
}

func (p *lossProxy) serve(c net.Conn) {
	defer c.Close()
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer s.Close()
	var drop atomic.Bool
	answered := make(chan struct{}, 1) // Redis answered the call whose reply is dropped
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 && drop.Load() {
				select {
				case answered <- struct{}{}:
				default:
				}
			}
			if n > 0 && !drop.Load() {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				_ = c.Close()
				return
			}
		}
	}()
	buf := make([]byte, 256<<10)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return
		}
		chunk := buf[:n]
		if left := p.loading.Load(); left > 0 && p.match(chunk) { // retries of the lost call only
			k := int64(respCommands(chunk))
			p.loading.Add(-k)
			for range k {
				if _, err := c.Write([]byte("-LOADING Redis is loading the dataset in memory\r\n")); err != nil {
					return
				}
			}
			continue
		}
		if p.armed.Load() && p.match(chunk) && p.armed.CompareAndSwap(true, false) {
			drop.Store(true)
			_, _ = s.Write(chunk)
			// Let Redis run it and answer (the answer is dropped).
			select {
			case <-answered:
			case <-time.After(2 * time.Second):
			}
			p.loading.Store(p.refuse) // go-redis's retries meet LOADING
			p.once.Do(func() { close(p.fired) })
			return // closes the client's connection: EOF, retried by go-redis
		}
		if _, err := s.Write(chunk); err != nil {
			return
		}
	}
}

// A NewClient enqueue whose script ran but whose reply was lost (the node
// died right after), and whose retries by go-redis then met LOADING (the
// node restarting), must not be reported as a plain failure ("stored
// nothing"): the task is stored. README: "none of the tasks reported failed
// was stored"; a refused call is "not stored" only if it was never run.
func TestLostReplyRetriedIntoLoadingIsOutcomeUnknown(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5r-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool {
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte(prefix+":{"))
	})
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true}) // go-redis defaults: MaxRetries 3
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	q := "a5r-" + uniq(t)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	id := "a5-" + uniq(t)
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"x"}`)), asynq.Queue(q), asynq.TaskID(id))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw the script (err %v)", err)
	}
	direct := newRDB(t)
	stored, xerr := direct.Exists(ctx, store.TaskKey(q, id)).Result()
	if xerr != nil {
		t.Fatal(xerr)
	}
	t.Logf("enqueue error: %v; stored: %v", err, stored == 1)
	if err != nil && !errors.Is(err, ErrOutcomeUnknown) && stored == 1 {
		t.Fatalf("enqueue reported failed (%v), not ErrOutcomeUnknown, but task %s is stored: "+
			"go-redis ran the script, lost the reply, retried and met LOADING; NotRun trusted the last error", err, id)
	}
}

// The same loss, but the node serves again at once: go-redis's retry of
// the NewClient script meets the task its first run stored, and the
// script answers "the ID exists". That task is the caller's own (same
// type, same payload, its lock): the answer must be created (or outcome
// unknown), not a refusal saying another task holds the ID.
func TestLostReplyRetriedMeetsItsOwnTaskNotAConflict(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5c-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool {
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte(prefix+":{"))
	})
	proxy.refuse = 0
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	client := d.NewClient()
	q := "a5c-" + uniq(t)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	id := "a5-" + uniq(t)
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"x"}`)), asynq.Queue(q), asynq.TaskID(id))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw the script (err %v)", err)
	}
	ti, ierr := asynq.NewInspectorFromRedisClient(newRDB(t)).GetTaskInfo(q, id)
	if ierr != nil {
		t.Skipf("task not stored (%v), enqueue %v: no case", ierr, err)
	}
	if err != nil && !errors.Is(err, ErrOutcomeUnknown) {
		t.Fatalf("enqueue of %s answered %v, but the task stored under that ID is this very call's (%s %s, state %v)",
			id, err, ti.Type, ti.Payload, ti.State)
	}
}

// The same through WrapClient: asynq's enqueue script ran (the task is
// stored), the reply was lost and go-redis's retries met LOADING, so asynq
// answers "redis eval error: LOADING ...". The rollback must not give the
// lock back without asking: the stored task would run with no lock, and
// the next enqueue of its key would be admitted, a duplicate.
func TestLostReplyOfAsynqsEnqueueKeepsTheLock(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	prefix := "a5w-" + uniq(t)
	q := "a5w-" + uniq(t)
	proxy := newLossProxy(t, redistest.Addr(), func(b []byte) bool { // asynq's enqueue script (WrapClient's lock script names no pending list)
		return bytes.Contains(bytes.ToLower(b), []byte("eval")) && bytes.Contains(b, []byte("asynq:{"+q+"}:pending"))
	})
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr(), Protocol: 2, DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := New(ctx, rdb, Config{Prefix: prefix, LockTimeout: 5 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ac := asynq.NewClientFromRedisClient(rdb)
	client := d.WrapClient(ac)
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"warm"}`)), asynq.Queue(q)); err != nil {
		t.Fatal(err)
	}
	task := asynq.NewTask("a5:job", []byte(`{"k":"x"}`))
	proxy.armed.Store(true)
	_, err = client.EnqueueContext(ctx, task, asynq.Queue(q))
	select {
	case <-proxy.fired:
	default:
		t.Fatalf("the proxy never saw asynq's script (err %v)", err)
	}
	t.Logf("first enqueue: %v", err)
	insp := asynq.NewInspectorFromRedisClient(newRDB(t))
	pending, _ := insp.ListPendingTasks(q)
	n := 0
	for _, ti := range pending {
		if string(ti.Payload) == `{"k":"x"}` {
			n++
		}
	}
	if n == 0 {
		t.Skipf("asynq's script did not store the task (err %v): no case", err)
	}
	proxy.loading.Store(0) // the node serves again
	locks, _ := newRDB(t).Keys(ctx, store.NewKeys(prefix).LockPattern("")).Result()
	t.Logf("after the first enqueue: %d stored, locks %v (one is the warm-up task's)", n, locks)
	if len(locks) < 2 {
		t.Errorf("the stored task's lock was given back: its key is unguarded while the task waits")
	}
	// The task of the key is stored; its duplicate must be refused.
	info, err2 := client.EnqueueContext(ctx, task, asynq.Queue(q))
	t.Logf("second enqueue: %v", err2)
	pending, _ = insp.ListPendingTasks(q)
	n = 0
	for _, ti := range pending {
		if string(ti.Payload) == `{"k":"x"}` {
			n++
		}
	}
	if n > 1 {
		t.Fatalf("duplicate admitted: %d stored tasks of one key (second enqueue: %v, %v); the first enqueue's error %q was taken "+
			"for 'not run' and its lock given back though asynq had stored the task", n, info, err2, err)
	}
}

// After a master dies and its replica is promoted, and every queue's calls
// succeed again, d.BreakerState() must say closed again ("reports the worst
// of the masters' breakers", and the dead master is no longer one).
func TestClusterBreakerClosesAfterFailover(t *testing.T) {
	procs, c := redistest.OwnCluster(t, 3, true)
	queues := queuesOnEveryMaster(t, c, "a5bk")
	ctx := context.Background()
	d, err := New(ctx, c, Config{Prefix: "a5b-" + uniq(t), LockTimeout: 300 * time.Millisecond, Logger: quietLogger(),
		BreakerThreshold: 2, BreakerBackoff: Backoff{Min: 100 * time.Millisecond, Max: 300 * time.Millisecond}})
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
	for i, p := range procs[:3] {
		if p.Addr == masterOf(t, c, dead) {
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
			t.Fatalf("the dead master's queue never recovered (breaker %v)", d.BreakerState())
		}
		takeover()
		_, err := client.EnqueueContext(ctx, asynq.NewTask("a5:job", fmt.Appendf(nil, `{"i":%d}`, i)), asynq.Queue(dead))
		if d.BreakerState() == BreakerOpen {
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
	for d.BreakerState() != BreakerClosed {
		if time.Now().After(deadline) {
			t.Fatalf("every queue enqueues again (20 in a row on the promoted master), but BreakerState() = %v, want closed: "+
				"the dead master's shard (its old address) keeps its open breaker for ever", d.BreakerState())
		}
		_, _ = client.EnqueueContext(ctx, asynq.NewTask("a5:job", []byte(`{"k":"poll"}`)), asynq.Queue(dead))
		time.Sleep(50 * time.Millisecond)
	}
}

// (NotRun, and its false-positive test, went: the library no longer
// trusts a refusal to mean a call did not run.)

// A WrapClient lock counted under MaxPending whose asynq enqueue is refused
// (its caller-chosen ID is taken) gives its waiting-set slot back: the next
// key of the type is admitted.
func TestRollbackFreesTheWaitingSlot(t *testing.T) {
	needRealRedis(t)
	ctx := context.Background()
	rdb := newRDB(t)
	d, err := New(ctx, rdb, Config{Prefix: "a5m-" + uniq(t), Logger: quietLogger(),
		Rules: map[string]Rule{"a5:bounded": {MaxPending: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	q := "a5m-" + uniq(t)
	ac := asynq.NewClientFromRedisClient(rdb)
	taken := "a5-taken-" + uniq(t)
	if _, err := ac.EnqueueContext(ctx, asynq.NewTask("other", nil), asynq.Queue(q), asynq.TaskID(taken)); err != nil {
		t.Fatal(err)
	}
	client := d.WrapClient(ac)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("a5:bounded", []byte(`{"k":1}`)), asynq.Queue(q), asynq.TaskID(taken))
	if err == nil {
		t.Fatal("enqueue under a taken ID succeeded")
	}
	if _, err := client.EnqueueContext(ctx, asynq.NewTask("a5:bounded", []byte(`{"k":2}`)), asynq.Queue(q)); err != nil {
		t.Fatalf("the refused enqueue kept its waiting slot: %v", err)
	}
}

// With one master dead, the heartbeat keeps renewing the locks of tasks
// running on the other masters' queues ("the heartbeat renews each
// master's locks in a pipeline of their own, concurrently"): such a lock
// outlives several leases while its handler runs.
func TestClusterHeartbeatGoesOnWhenOneMasterDies(t *testing.T) {
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
