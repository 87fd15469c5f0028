package dedup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// Fault tests: real redis-server and real worker processes, started and
// killed by the tests. Every wait on another process polls Redis (there is
// no other signal between processes) with a bound.

// faultPoll is eventually with a bound of the caller's choosing.
func faultPoll(t *testing.T, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting until %s", bound, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// faultWorker is a worker process: this test binary running
// runFaultWorker.
type faultWorker struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed when the process has exited and been reaped
}

func startFaultWorker(t *testing.T, addr, prefix, queue string, lease time.Duration, name string) *faultWorker {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "worker-"+name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close() // the child has its own descriptor
	var env []string
	for _, kv := range os.Environ() {
		// The child needs no redis-server of its own (it is given one), and
		// must not fail for lack of one.
		if !strings.HasPrefix(kv, "DEDUP_REQUIRE_REDIS=") && !strings.HasPrefix(kv, "DEDUP_TEST_MINIREDIS=") {
			env = append(env, kv)
		}
	}
	env = append(env, "DEDUP_TEST_MINIREDIS=1", faultWorkerEnv+"=1", faultAddrEnv+"="+addr,
		faultPrefixEnv+"="+prefix, faultQueueEnv+"="+queue, faultLeaseEnv+"="+lease.String(), faultNameEnv+"="+name)
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logf, logf // files: no copying goroutines
	if err := cmd.Start(); err != nil {
		t.Fatalf("start worker %s: %v", name, err)
	}
	w := &faultWorker{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(w.done) }()
	t.Cleanup(func() {
		w.kill()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("worker %s output:\n%s", name, b)
		}
	})
	return w
}

// kill sends SIGKILL and waits until the process is gone.
func (w *faultWorker) kill() {
	_ = w.cmd.Process.Kill()
	<-w.done
}

// stop asks the worker to shut down (SIGTERM), and kills it if it does not
// within the bound.
func (w *faultWorker) stop(t *testing.T) {
	t.Helper()
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		w.kill()
		return
	}
	select {
	case <-w.done:
	case <-time.After(15 * time.Second):
		t.Errorf("worker %s ignored SIGTERM; killing it", w.name)
		w.kill()
	}
}

// faultRecords reads what the worker processes of h's fault test recorded:
// all records, and whether one of a kind, worker and task exists.
func faultRecords(t *testing.T, h *harness) (events func() []faultEvent, seen func(kind, worker, id string) bool) {
	evKey := faultEventsKey(h.prefix)
	t.Cleanup(func() { h.rdb.Del(context.Background(), evKey) })
	events = func() []faultEvent {
		t.Helper()
		lines, err := h.rdb.LRange(context.Background(), evKey, 0, -1).Result()
		if err != nil {
			t.Fatalf("LRANGE: %v", err)
		}
		evs, err := parseFaultEvents(lines)
		if err != nil {
			t.Fatal(err)
		}
		return evs
	}
	seen = func(kind, worker, id string) bool {
		for _, e := range events() {
			if e.kind == kind && e.worker == worker && e.id == id {
				return true
			}
		}
		return false
	}
	return events, seen
}

// TestFaultWorkerKilled SIGKILLs a worker process in the middle of a handler
// and checks the whole recovery:
//
//   - the key stays with the killed worker's task (a duplicate is refused,
//     naming it) while asynq still believes the task is running, past the
//     library's heartbeats: its lock is asynq's unique key;
//   - asynq's recoverer puts the killed task back as a retry, which a second
//     worker runs, finding the key its own; its success frees the key (the
//     crash counts as a retry);
//   - a new task of the key is then accepted and runs;
//   - no two handlers ever ran the key at once (intervals recorded in Redis
//     by both processes, on the Redis clock).
//
// asynq's 30 s lease and 30 s recovery margin are hard-coded: the test ages
// the dead worker's lease (expireAsynqLease) rather than wait that minute,
// and the second worker's recoverer, which runs as the server starts,
// recovers the task.
func TestFaultWorkerKilled(t *testing.T) {
	needRealRedis(t)
	t.Parallel() // mostly waiting for processes
	const lease = 1200 * time.Millisecond
	h := newHarness(t, Config{heartbeat: (lease) / 3, RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return faultRetryDelay }})
	ctx := context.Background()
	events, seen := faultRecords(t, h)
	job := func(mode string) *asynq.Task {
		b, _ := json.Marshal(faultJob{UserID: 7, Mode: mode})
		return asynq.NewTask(faultTaskType, b)
	}
	keyOpt := Fields("user_id")
	refused := func(when string) {
		t.Helper()
		var dup *DuplicateTaskError
		if _, err := h.client.Enqueue(job("dup"), asynq.Queue(h.queue), keyOpt); !errors.As(err, &dup) || dup.Holder != first(t, h, events) {
			t.Fatalf("enqueue %s: err = %v, want a duplicate of the killed worker's task", when, err)
		}
	}

	a := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "A")
	firstTask := h.enqueue(job("block"), keyOpt, asynq.Retention(time.Hour))
	key := h.keyOf(job("block"), h.queue, keyOpt)
	faultPoll(t, 30*time.Second, "worker A runs the first task", func() bool { return seen("start", "A", firstTask.ID) })
	a.kill()
	killed := time.Now()
	if err := faultRecord(ctx, h.rdb, h.prefix, "killed", "A", firstTask.ID, 0); err != nil {
		t.Fatal(err)
	}
	// The key stays with the killed worker's task until asynq runs it again:
	// its lock is asynq's unique key, and asynq keeps the task active (then
	// recovers it as a retry).
	refused("right after the kill")
	if owner := h.lockOwner(key); owner != firstTask.ID {
		t.Fatalf("lock owner %q after the kill, want %s", owner, firstTask.ID)
	}
	faultPoll(t, 10*time.Second, "three of the library's heartbeats pass after the kill", func() bool { return time.Since(killed) > 3*lease })
	refused("while asynq has not recovered it")
	// asynq's recoverer moves the killed task to retry once its asynq lease
	// has been expired for 30 s; it runs as a server starts.
	expireAsynqLease(t, h, firstTask.ID)
	b := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "B")
	faultPoll(t, 30*time.Second, "worker B runs the recovered task", func() bool { return seen("end", "B", firstTask.ID) })
	faultPoll(t, 30*time.Second, "the recovered task completed", func() bool { return h.taskState(firstTask.ID) == asynq.TaskStateCompleted })
	faultPoll(t, 10*time.Second, "lock released", func() bool { return h.rdb.Exists(ctx, key).Val() == 0 })
	second := h.enqueue(job("once"), keyOpt, asynq.Retention(time.Hour))
	faultPoll(t, 30*time.Second, "a new task of the key runs", func() bool { return seen("end", "B", second.ID) })
	b.stop(t)
	if ti, err := h.insp.GetTaskInfo(h.queue, firstTask.ID); err != nil || ti.Retried != 1 {
		t.Fatalf("recovered task: info %+v, err %v; want Retried 1 (the crash counts)", ti, err)
	}
	checkFaultIntervals(t, events())
}

// RunningDefer when the holder's worker is killed: the key stays with the
// killed worker's task, an enqueue meanwhile folds into the follow-up it
// owes, and asynq's recovered retry of the holder runs before the follow-up,
// which runs once, last, with the newest payload; never two at once.
func TestFaultDeferFollowUpRunsAfterADeadWorkersTask(t *testing.T) {
	needRealRedis(t)
	t.Parallel() // mostly waiting for processes
	const lease = 1200 * time.Millisecond
	h := newHarness(t, Config{heartbeat: (lease) / 3, RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return faultRetryDelay },
		Rules: map[string]Rule{faultTaskType: {Fields: []string{"user_id"}, OnConflict: Replace, OnRunning: RunningDefer}}})
	ctx := context.Background()
	events, seen := faultRecords(t, h)
	job := func(mode string) *asynq.Task {
		b, _ := json.Marshal(faultJob{UserID: 9, Mode: mode})
		return asynq.NewTask(faultTaskType, b)
	}
	a := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "A")
	holder := h.enqueue(job("block"), asynq.Retention(time.Hour))
	faultPoll(t, 30*time.Second, "worker A runs the holder", func() bool { return seen("start", "A", holder.ID) })
	f, err := h.client.Submit(ctx, job("v2"), asynq.Queue(h.queue))
	if err != nil || f.Outcome != Deferred {
		t.Fatalf("enqueue while the holder runs: %+v %v, want a follow-up", f, err)
	}
	a.kill()
	if err := faultRecord(ctx, h.rdb, h.prefix, "killed", "A", holder.ID, 0); err != nil {
		t.Fatal(err)
	}
	r, err := h.client.Submit(ctx, job("v3"), asynq.Queue(h.queue))
	if err != nil || r.Outcome != Replaced || r.TaskID != f.TaskID {
		t.Fatalf("enqueue after the kill: %+v %v, want replaced into the follow-up %s", r, err, f.TaskID)
	}
	expireAsynqLease(t, h, holder.ID) // as a minute after the kill: B's recoverer retries it as B starts
	b := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "B")
	faultPoll(t, 30*time.Second, "the follow-up runs", func() bool { return seen("end", "B", f.TaskID) })
	b.stop(t)
	evs := events()
	checkFaultIntervals(t, evs)
	order := []string{}
	for _, e := range evs {
		if e.kind == "start" {
			order = append(order, e.worker+" "+e.id)
		}
	}
	if want := []string{"A " + holder.ID, "B " + holder.ID, "B " + f.TaskID}; fmt.Sprint(order) != fmt.Sprint(want) {
		t.Fatalf("runs %v, want %v: the holder, its recovered retry, then the follow-up", order, want)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, f.TaskID)
	if err != nil || !strings.Contains(string(ti.Payload), `"v3"`) {
		t.Fatalf("the follow-up ran %v (%v), want the newest payload (v3)", ti, err)
	}
}

// first is the ID of the first task the fault worker records started.
func first(t *testing.T, h *harness, events func() []faultEvent) string {
	t.Helper()
	for _, e := range events() {
		if e.kind == "start" {
			return e.id
		}
	}
	return ""
}

// checkFaultIntervals fails the test if two handlers ever ran at once. All
// records are of one key. A handler runs from its "start" to its "end", or
// to the "killed" record the test writes once the process is gone.
func checkFaultIntervals(t *testing.T, evs []faultEvent) {
	t.Helper()
	open := map[string]faultEvent{} // worker/task → its start
	var last int64
	for _, e := range evs {
		if e.at < last {
			t.Errorf("records out of time order at %v", e)
		}
		last = e.at
		k := e.worker + "/" + e.id
		switch e.kind {
		case "start":
			for _, o := range open {
				t.Errorf("overlap: %v while %v had not ended", e, o)
			}
			open[k] = e
		case "end", "killed":
			if _, ok := open[k]; !ok {
				t.Errorf("%v without a start", e)
			}
			delete(open, k)
		}
	}
	if len(open) != 0 {
		t.Errorf("handlers never ended: %v", open)
	}
}

// faultOutageErr reports whether err is what an enqueue may return while
// Redis is down or just back: the wrapper's ErrUnavailable (fail-closed), or
// asynq's own error when the lock was taken but asynq's enqueue then failed
// (or, just after the restart, met Redis still loading its AOF).
// asynq flattens the go-redis error into text ("UNKNOWN: redis eval error:
// dial tcp ...: connect: connection refused"), so that one is told by its
// message.
func faultOutageErr(err error) bool {
	var ne net.Error
	if errors.Is(err, ErrUnavailable) || errors.As(err, &ne) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
		return true
	}
	msg := err.Error()
	for _, s := range []string{"connection refused", "connection reset", "broken pipe", "EOF", "i/o timeout", "closed network connection",
		"LOADING"} { // the restarted server still reading its AOF
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// faultRootType names the type of the innermost cause of err.
func faultRootType(err error) string {
	for {
		next := errors.Unwrap(err)
		if next == nil {
			return fmt.Sprintf("%T", err)
		}
		err = next
	}
}

// faultAttempt is one enqueue of the load tests.
type faultAttempt struct {
	user   int
	id     string // task ID, on success
	err    error
	phase0 int32 // phase when the call began
}

const (
	phaseUp      = 0 // Redis up, before the kill
	phaseDown    = 1 // after the kill
	phaseRestart = 2 // after the restarted Redis answered PING
)

// faultLoad runs producers that enqueue distinct keys through client until
// stopped (or a per-producer cap), recording every attempt.
type faultLoad struct {
	phase atomic.Int32
	stop  chan struct{}
	wg    sync.WaitGroup

	mu       sync.Mutex
	attempts []faultAttempt
}

func startFaultLoad(client *Client, queue, typ string, producers int, pace time.Duration) *faultLoad {
	l := &faultLoad{stop: make(chan struct{})}
	for p := range producers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			tick := time.NewTicker(pace) // at most one enqueue per tick
			defer tick.Stop()
			for i := range 20000 { // bound; the test stops it long before
				select {
				case <-l.stop:
					return
				case <-tick.C:
				}
				user := (p+1)*1_000_000 + i
				ph := l.phase.Load()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				info, err := client.EnqueueContext(ctx, faultLoadTask(typ, user), asynq.Queue(queue))
				cancel()
				a := faultAttempt{user: user, err: err, phase0: ph}
				if err == nil {
					a.id = info.ID
				}
				l.mu.Lock()
				l.attempts = append(l.attempts, a)
				l.mu.Unlock()
				if err != nil { // a producer backs off a little on errors
					select {
					case <-l.stop:
						return
					case <-time.After(20 * time.Millisecond):
					}
				}
			}
		}()
	}
	return l
}

func faultLoadTask(typ string, user int) *asynq.Task {
	b, _ := json.Marshal(map[string]any{"user_id": user})
	return asynq.NewTask(typ, b)
}

// count returns how many attempts match.
func (l *faultLoad) count(match func(a faultAttempt) bool) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, a := range l.attempts {
		if match(a) {
			n++
		}
	}
	return n
}

func (l *faultLoad) halt() []faultAttempt {
	close(l.stop)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]faultAttempt(nil), l.attempts...)
}

// faultProcessed counts handler runs per task ID.
type faultProcessed struct {
	mu   sync.Mutex
	runs map[string]int
}

func (p *faultProcessed) handler() asynq.HandlerFunc {
	return func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		p.mu.Lock()
		p.runs[id]++
		p.mu.Unlock()
		return nil
	}
}

func (p *faultProcessed) ran(id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.runs[id] > 0
}

func (p *faultProcessed) total() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.runs)
}

func (p *faultProcessed) reruns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.runs {
		n += c - 1
	}
	return n
}

// TestFaultRedisRestartUnderLoad SIGKILLs the only redis-server (asynq's and
// the locks') while producers enqueue through the wrapper and a server
// processes, keeps producing through the outage, restarts redis-server on
// the same address and checks that:
//
//   - every enqueue that failed failed the fail-closed way (ErrUnavailable,
//     or asynq's own connection error after the lock was taken), nothing
//     panicked;
//   - the same Client, Dedup and asynq server recover by themselves:
//     enqueues succeed and tasks run again, nothing recreated;
//   - no task that was accepted is lost. The server runs with AOF and
//     appendfsync always, so whatever Redis acknowledged survives the kill;
//     with persistence off the restart would empty Redis and only tasks
//     accepted after it could be checked. Every accepted task runs at least
//     once, except those the kill caught between asynq's dequeue and its
//     reply: asynq keeps them active and its crash recovery reruns them a
//     minute later (its lease is 30 s plus a 30 s margin, hard-coded);
//   - a failed enqueue leaves no lock that blocks its key beyond HealGrace:
//     the key can be enqueued again, or is held by the task that did land
//     although its reply was lost;
//   - no goroutine is left once everything is shut down.
func TestFaultRedisRestartUnderLoad(t *testing.T) {
	needRealRedis(t)
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) }) // registered first: runs last
	ctx := context.Background()

	aof := []string{"--appendonly", "yes", "--appendfsync", "always", "--dir", t.TempDir()}
	rp, err := spawnRedis("", aof...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rp.Kill() }) // the current one (killing twice is harmless)
	addr := rp.Addr

	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 32, DialTimeout: 300 * time.Millisecond,
		ReadTimeout: time.Second, WriteTimeout: time.Second})
	name := uniq(t)
	prefix, queue := "dd-"+name, "q-"+name
	const concurrency = 8
	retryDelay := func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond }
	d, err := New(ctx, rdb, Config{Prefix: prefix, heartbeat: (2 * time.Second) / 3, LockTimeout: 500 * time.Millisecond,
		healGrace: time.Second, RetryDelayFunc: retryDelay, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ac := asynq.NewClientFromRedisClient(rdb)
	client := d.WrapClient(ac)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	processed := &faultProcessed{runs: map[string]int{}}
	srv := startFaultServer(t, rdb, d, queue, concurrency, retryDelay, processed.handler())
	shutdown := sync.OnceFunc(func() {
		srv.Shutdown()
		_ = d.Close()
		_ = insp.Close()
		_ = ac.Close()
		_ = rdb.Close()
	})
	t.Cleanup(shutdown)

	const typ = "fault:load"
	load := startFaultLoad(client, queue, typ, 4, 2*time.Millisecond)
	halted := false
	defer func() {
		if !halted {
			load.halt()
		}
	}()
	ok := func(a faultAttempt) bool { return a.err == nil }
	faultPoll(t, 30*time.Second, "load before the kill", func() bool { return load.count(ok) >= 300 && processed.total() >= 100 })

	rp.Kill() // SIGKILL; its own directory goes, the AOF (in ours) stays
	load.phase.Store(phaseDown)
	killedAt := time.Now()
	waitingAtKill := load.count(func(a faultAttempt) bool { return a.err == nil && !processed.ran(a.id) })
	failed := func(a faultAttempt) bool { return a.err != nil && a.phase0 == phaseDown }
	faultPoll(t, 30*time.Second, "enqueues fail during the outage", func() bool { return load.count(failed) >= 20 })

	np, err := spawnRedis(addr, aof...)
	if err != nil {
		t.Fatalf("restart redis-server on %s: %v", addr, err)
	}
	rp = np
	load.phase.Store(phaseRestart)
	restartedAt := time.Now()
	after := func(a faultAttempt) bool { return a.err == nil && a.phase0 == phaseRestart }
	faultPoll(t, 30*time.Second, "enqueues succeed again after the restart", func() bool { return load.count(after) >= 300 })
	recoveredIn := time.Since(restartedAt)
	attempts := load.halt()
	halted = true

	// Settled: every call succeeds now, on the same client.
	for i := range 50 {
		if _, err := client.EnqueueContext(ctx, faultLoadTask(typ, 9_000_000+i), asynq.Queue(queue)); err != nil {
			t.Fatalf("enqueue %d after recovery: %v", i, err)
		}
	}

	var accepted []faultAttempt
	var failures []faultAttempt
	kinds := map[string]int{}
	for _, a := range attempts {
		if a.err == nil {
			accepted = append(accepted, a)
			continue
		}
		failures = append(failures, a)
		if !faultOutageErr(a.err) {
			t.Errorf("enqueue of user %d failed with %T %v: not an outage error", a.user, a.err, a.err)
		}
		if errors.Is(a.err, ErrUnavailable) {
			kinds["ErrUnavailable"]++
		} else {
			kinds["not ErrUnavailable ("+faultRootType(a.err)+")"]++
		}
	}
	for _, a := range failures {
		if a.phase0 == phaseUp {
			// Began before the kill and failed because of it: fine, counted.
			kinds["began before the kill"]++
		}
	}

	// No accepted task lost.
	var stuck []string
	faultPoll(t, 30*time.Second, "every accepted task ran (or is held by asynq as active)", func() bool {
		qi, err := insp.GetQueueInfo(queue)
		if err != nil && strings.Contains(err.Error(), "NOT_FOUND") { // asynq returns no sentinel here
			// asynq's client registers a queue once per process: a Redis
			// that restarts empty forgets it, and every task with it.
			t.Fatalf("queue gone after the restart: Redis lost its data (%v)", err)
		}
		if err != nil || qi.Pending+qi.Retry+qi.Scheduled != 0 {
			return false
		}
		stuck = stuck[:0]
		var lost []string
		for _, a := range accepted {
			if processed.ran(a.id) {
				continue
			}
			ti, err := insp.GetTaskInfo(queue, a.id)
			switch {
			case errors.Is(err, asynq.ErrTaskNotFound) && !processed.ran(a.id): // (it may have just run and gone)
				lost = append(lost, a.id)
			case err != nil || ti.State != asynq.TaskStateActive:
				return false
			default:
				stuck = append(stuck, a.id)
			}
		}
		if len(lost) > 0 {
			t.Fatalf("%d accepted tasks lost: never run and gone from asynq (%v...)", len(lost), lost[0])
		}
		return true
	})
	if len(stuck) > 2*concurrency {
		t.Errorf("%d accepted tasks left active, more than the kill can catch in flight: %v", len(stuck), stuck)
	}

	// A failed enqueue's key is not blocked for longer than HealGrace.
	var landed, healed int
	for _, a := range failures {
		task := faultLoadTask(typ, a.user)
		waited := false
		faultPoll(t, 15*time.Second, fmt.Sprintf("key of the failed enqueue of user %d usable again", a.user), func() bool {
			_, err := client.EnqueueContext(ctx, task, asynq.Queue(queue))
			var dup *DuplicateTaskError
			switch {
			case err == nil:
				return true
			case errors.As(err, &dup):
				// Held: legitimate only by a task that exists (its enqueue
				// landed, the reply was lost), else it must heal soon.
				if _, gerr := insp.GetTaskInfo(queue, dup.Holder); gerr == nil {
					landed++
					return true
				}
				if !waited {
					waited = true
					healed++
				}
				return false
			default:
				t.Fatalf("re-enqueue of user %d: %v", a.user, err)
				return false
			}
		})
	}

	s := d.Stats()
	t.Logf("accepted %d (%d waiting when Redis was killed, %d after the restart), failed %d %v; ran %d tasks (%d reruns); %d left active by the kill; "+
		"%d failed enqueues had landed, %d left a lock that healed; outage %v, recovered %v after the restart; stats %+v",
		len(accepted), waitingAtKill, load.count(after), len(failures), kinds, processed.total(), processed.reruns(), len(stuck),
		landed, healed, restartedAt.Sub(killedAt).Round(time.Millisecond), recoveredIn.Round(time.Millisecond), s)
	if s.RedisErrors == 0 {
		t.Error("no Redis error counted through the outage")
	}
	shutdown()
}

// TestFaultLockRedisDownFailOpen cuts the Dedup off Redis, with FailOpen,
// under load: its lock calls go through a proxy process, which is SIGKILLed
// and started again, while asynq's client and server talk to the same Redis
// directly. While the proxy is dead every enqueue still succeeds (counted in
// Stats().FailOpen), tasks keep running, and duplicates get through (that
// is what fail-open means); once it is back, locks are taken and duplicates
// refused again, with the same Client and Dedup.
func TestFaultLockRedisDownFailOpen(t *testing.T) {
	needRealRedis(t)
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	ctx := context.Background()

	lp, addr := startFaultProxy(t, "", redistest.Addr())
	t.Cleanup(func() { lp.kill() }) // the current one (killing twice is harmless)
	lrdb := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 300 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second})
	ardb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), PoolSize: 32})
	name := uniq(t)
	prefix, queue := "dd-"+name, "q-"+name
	d, err := New(ctx, lrdb, Config{Prefix: prefix, FailOpen: true, LockTimeout: 300 * time.Millisecond, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ac := asynq.NewClientFromRedisClient(ardb)
	client := d.WrapClient(ac)
	processed := &faultProcessed{runs: map[string]int{}}
	srv := startFaultServer(t, ardb, d, queue, 8, func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond }, processed.handler())
	shutdown := sync.OnceFunc(func() {
		srv.Shutdown()
		_ = d.Close()
		_ = ac.Close()
		_ = ardb.Close()
		_ = lrdb.Close()
	})
	t.Cleanup(shutdown)

	const typ = "fault:open"
	load := startFaultLoad(client, queue, typ, 2, 10*time.Millisecond)
	halted := false
	defer func() {
		if !halted {
			load.halt()
		}
	}()
	ok := func(a faultAttempt) bool { return a.err == nil }
	faultPoll(t, 30*time.Second, "load before the kill", func() bool { return load.count(ok) >= 100 })
	if s := d.Stats(); s.Locked < 100 || s.FailOpen != 0 {
		t.Fatalf("before the kill: stats %+v", s)
	}

	lp.kill()
	load.phase.Store(phaseDown)
	down := func(a faultAttempt) bool { return a.phase0 == phaseDown }
	faultPoll(t, 30*time.Second, "enqueues during the outage", func() bool { return load.count(down) >= 50 })
	// While the proxy is surely down, from here: every enqueue goes
	// through, and is counted as fail-open. The same key twice included:
	// both get through, that is what fail-open means.
	before := d.Stats().FailOpen
	var mine []string
	for i := range 22 {
		task := faultLoadTask(typ, 42)
		if i < 20 {
			task = faultLoadTask(typ, 500+i)
		}
		info, err := client.EnqueueContext(ctx, task, asynq.Queue(queue))
		if err != nil {
			t.Fatalf("fail-open enqueue %d while the proxy is down: %v", i, err)
		}
		mine = append(mine, info.ID)
	}
	if n := d.Stats().FailOpen - before; n < uint64(len(mine)) {
		t.Errorf("FailOpen grew by %d over %d enqueues made while the proxy was down", n, len(mine))
	}

	lp, _ = startFaultProxy(t, addr, redistest.Addr())
	load.phase.Store(phaseRestart)
	restartedAt := time.Now()
	// Locks work again, on the same Dedup: a scheduled task keeps its lock,
	// so its duplicate is refused. Until the client has reconnected (and a
	// circuit breaker, if any, has probed) calls still fail open: each try
	// uses a fresh key.
	tries := 0
	faultPoll(t, 45*time.Second, "locks taken again after the restart", func() bool {
		tries++
		task := faultLoadTask(typ, 100+tries)
		info, err := client.EnqueueContext(ctx, task, asynq.Queue(queue), asynq.ProcessIn(time.Hour))
		if err != nil {
			t.Fatalf("enqueue after the restart: %v", err)
		}
		var dup *DuplicateTaskError
		_, err = client.EnqueueContext(ctx, task, asynq.Queue(queue), asynq.ProcessIn(time.Hour))
		switch {
		case errors.As(err, &dup):
			if dup.Holder != info.ID {
				t.Fatalf("duplicate of %s, want of %s", dup.Holder, info.ID)
			}
			return true
		case err != nil:
			t.Fatalf("enqueue after the restart: %v", err)
		}
		return false
	})
	locksBack := time.Since(restartedAt)
	after := func(a faultAttempt) bool { return a.err == nil && a.phase0 == phaseRestart }
	faultPoll(t, 30*time.Second, "enqueues after the restart", func() bool { return load.count(after) >= 100 })
	attempts := load.halt()
	halted = true

	var outage int
	for _, a := range attempts {
		if a.err != nil {
			t.Errorf("enqueue of user %d failed with FailOpen: %v", a.user, a.err)
		}
		if a.phase0 == phaseDown {
			outage++
		}
	}
	faultPoll(t, 30*time.Second, "every task ran", func() bool {
		for _, a := range attempts {
			if !processed.ran(a.id) {
				return false
			}
		}
		for _, id := range mine {
			if !processed.ran(id) {
				return false
			}
		}
		return true
	})
	s := d.Stats()
	t.Logf("%d enqueues (%d during the outage, all let through); locks back %v after the restart (%d tries); stats %+v",
		len(attempts), outage, locksBack.Round(time.Millisecond), tries, s)
	shutdown()
}

// startFaultServer runs an asynq server with the middleware on one queue,
// polling fast so a fault test sees recoveries promptly.
func startFaultServer(t *testing.T, rdb redis.UniversalClient, d *Dedup, queue string, concurrency int, retryDelay asynq.RetryDelayFunc, h asynq.Handler) *asynq.Server {
	t.Helper()
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          3 * time.Second,
		IsFailure:                IsFailure,
		RetryDelayFunc:           retryDelay,
	})
	if err := srv.Start(d.Middleware()(h)); err != nil {
		t.Fatal(err)
	}
	return srv
}

// TestCooldownSurvivesAWorkerCrash SIGKILLs a worker in the middle of a
// task enqueued with a per-call Cooldown (which only the lock records): the
// key stays held past the lease (no new task may run within the cooldown),
// asynq's recoverer retries the task on a second worker, which finds the
// lock its own, and the retry's success starts the cooldown.
func TestCooldownSurvivesAWorkerCrash(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	const lease = 1200 * time.Millisecond
	h := newHarness(t, Config{heartbeat: (lease) / 3, RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return faultRetryDelay }})
	ctx := context.Background()
	events, seen := faultRecords(t, h)
	job := func(mode string) *asynq.Task {
		b, _ := json.Marshal(faultJob{UserID: 8, Mode: mode})
		return asynq.NewTask(faultTaskType, b)
	}
	keyOpt := Fields("user_id")

	a := startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "A")
	first := h.enqueue(job("block"), keyOpt, Cooldown(10*time.Minute), asynq.Retention(time.Hour))
	faultPoll(t, 30*time.Second, "worker A runs the task", func() bool { return seen("start", "A", first.ID) })
	a.kill()
	killed := time.Now()
	if err := faultRecord(ctx, h.rdb, h.prefix, "killed", "A", first.ID, 0); err != nil {
		t.Fatal(err)
	}
	faultPoll(t, 10*time.Second, "three leases pass after the kill", func() bool { return time.Since(killed) > 3*lease })
	if dup := h.duplicateOf(job("dup"), keyOpt); dup.Holder != first.ID || dup.CoolingDown {
		t.Fatalf("after the kill: %+v, want a plain duplicate of the crashed task %s", dup, first.ID)
	}

	expireAsynqLease(t, h, first.ID) // as a minute after the kill: B's recoverer retries it as B starts
	startFaultWorker(t, redistest.Addr(), h.prefix, h.queue, lease, "B")
	faultPoll(t, 30*time.Second, "the recovered task runs on B", func() bool { return seen("end", "B", first.ID) })
	faultPoll(t, 10*time.Second, "the key cools down", func() bool {
		kl, found, err := h.d.Lookup(ctx, job("x"), keyOpt, asynq.Queue(h.queue))
		return err == nil && found && kl.State == "cooling"
	})
	coolingDup(t, h.client, job("again"), h.queue, first.ID, keyOpt)
	checkFaultIntervals(t, events())
	if ti, err := h.insp.GetTaskInfo(h.queue, first.ID); err != nil || ti.Retried != 1 {
		t.Fatalf("recovered task: %+v, %v; want it retried once", ti, err)
	}
}
