package dedup

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// harness is one test's private world on the shared Redis: its own key
// prefix and queue, a Dedup, a wrapped client and, on demand, a server.
type harness struct {
	t      *testing.T
	rdb    redis.UniversalClient
	d      *Dedup
	client *Client
	asynq  *asynq.Client
	insp   *asynq.Inspector
	queue  string
	prefix string
}

func quietLogger() *slog.Logger { return redistest.QuietLogger() }

func newHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	return newHarnessOn(t, newRDB(t), cfg)
}

// newHarnessOn is newHarness on a given Redis client (a second process's
// view of the same Redis).
func newHarnessOn(t *testing.T, rdb redis.UniversalClient, cfg Config) *harness {
	t.Helper()
	name := uniq(t)
	if cfg.Prefix == "" {
		cfg.Prefix = "dd-" + name
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	d, err := New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ac := asynq.NewClientFromRedisClient(rdb)
	return &harness{t: t, rdb: rdb, d: d, client: d.WrapClient(ac), asynq: ac,
		insp: asynq.NewInspectorFromRedisClient(rdb), queue: "q-" + name, prefix: cfg.Prefix}
}

// serve runs an asynq server on the harness queue with the middleware,
// until the test ends.
func (h *harness) serve(handler asynq.HandlerFunc, tweak func(*asynq.Config)) *asynq.Server {
	h.t.Helper()
	cfg := asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{h.queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          5 * time.Second,
		IsFailure:                IsFailure,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(h.rdb, cfg)
	// Same as mux.Use(h.d.Middleware()) on a ServeMux, for every type.
	if err := srv.Start(h.d.Middleware()(handler)); err != nil {
		h.t.Fatalf("server start: %v", err)
	}
	var once sync.Once
	h.t.Cleanup(func() { once.Do(srv.Shutdown) })
	return srv
}

// lockOwner returns the task holding the lock at key, or "".
func (h *harness) lockOwner(key string) string {
	h.t.Helper()
	v, err := h.rdb.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return ""
	}
	if err != nil {
		h.t.Fatalf("GET %s: %v", key, err)
	}
	return holderIn(v)
}

// locks returns the lock keys of this harness (on every master of a cluster).
func (h *harness) locks() []string {
	h.t.Helper()
	ctx := context.Background()
	var (
		mu  sync.Mutex
		out []string
	)
	scan := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, store.NewKeys(h.prefix).LockPattern(""), 1000).Iterator()
		for iter.Next(ctx) {
			mu.Lock()
			out = append(out, iter.Val())
			mu.Unlock()
		}
		return iter.Err()
	}
	var err error
	switch c := h.rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	default:
		h.t.Fatalf("locks: unsupported client %T", h.rdb)
	}
	if err != nil {
		h.t.Fatalf("scan: %v", err)
	}
	return out
}

// keyOf returns the lock key the wrapper uses for a task in queue q.
func (h *harness) keyOf(task *asynq.Task, q string, opts ...asynq.Option) string {
	h.t.Helper()
	r := h.d.ruleFor(task.Type())
	for _, o := range opts {
		if ov, ok := o.(option); ok {
			if err := ov.apply(&r); err != nil {
				h.t.Fatal(err)
			}
		}
	}
	fp, err := h.d.fingerprintHex(task.Type(), task.Payload(), &r)
	if err != nil {
		h.t.Fatal(err)
	}
	return lockKeyHex(h.prefix, q, fp)
}

func waitFor[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	return redistest.WaitFor(t, ch, what)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	redistest.Eventually(t, what, cond)
}

// payloadOf reads task id's payload from asynq.
func (h *harness) payloadOf(id string) string {
	h.t.Helper()
	ti, err := h.insp.GetTaskInfo(h.queue, id)
	if err != nil {
		h.t.Fatalf("GetTaskInfo %s: %v", id, err)
	}
	return string(ti.Payload)
}

// fpOfKey returns a lock key's fingerprint.
func fpOfKey(key string) string { return fpOfLock(key) }

// heldThrough checks, every 20 ms until d has passed, that each of keys is
// a lock with a holder, and fails at the first that is not: a wait whose
// length is what is under test (locks outliving their TTL while their
// handlers run), which fails as soon as one is lost.
func (h *harness) heldThrough(d time.Duration, keys ...string) {
	h.t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); {
		for _, k := range keys {
			if h.lockOwner(k) == "" {
				h.t.Fatalf("lock %s lapsed while its handler ran", k)
			}
		}
		if err := sleep(context.Background(), 20*time.Millisecond); err != nil {
			h.t.Fatal(err)
		}
	}
}

// lockState returns what Lookup would say of the lock at key ("" for none).
func (h *harness) lockState(key string) string {
	h.t.Helper()
	ls, err := store.ReadLocks(context.Background(), h.rdb, store.NewKeys(h.prefix), []string{key})
	if err != nil {
		h.t.Fatal(err)
	}
	if len(ls) == 0 {
		return ""
	}
	return ls[0].State()
}

// ---- shared by the tests of several behaviours ----

// decisions records what Config.OnDecision hears.
type decisions struct {
	mu    sync.Mutex
	heard []Decision
}

func (r *decisions) hook(d Decision) { r.mu.Lock(); r.heard = append(r.heard, d); r.mu.Unlock() }

func (r *decisions) all() []Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Decision(nil), r.heard...)
}

// queueMover is an Enqueuer that puts every task in its own queue, whatever
// the call said: the README's "an enqueuer that changes the queue", whose
// lock the Client moves to where the task landed.
type queueMover struct {
	c *asynq.Client
	q string
}

func (m queueMover) Enqueue(t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return m.EnqueueContext(context.Background(), t, opts...)
}

func (m queueMover) EnqueueContext(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return m.c.EnqueueContext(ctx, t, append(append([]asynq.Option(nil), opts...), asynq.Queue(m.q))...)
}

// keyRun is one handler run seen by keyTracker.
type keyRun struct {
	id, key string
	seq     int
	retry   int
	err     error // what the handler returned
}

// keyTracker is a handler that records every run per key, notes any two runs
// of one key at once, and holds the runs of chosen sequence numbers until
// the test opens their gate.
type keyTracker struct {
	keyOf func(*asynq.Task) string

	mu       sync.Mutex
	active   map[string][]string
	overlaps []string
	gates    map[int]chan struct{}
	done     []keyRun

	starts chan keyRun
	ends   chan keyRun
}

func newKeyTracker(keyOf func(*asynq.Task) string, gated ...int) *keyTracker {
	tr := &keyTracker{keyOf: keyOf, active: map[string][]string{}, gates: map[int]chan struct{}{},
		starts: make(chan keyRun, 1000), ends: make(chan keyRun, 1000)}
	for _, s := range gated {
		tr.gates[s] = make(chan struct{})
	}
	return tr
}

// counterKeyOf keys counter tasks by their "key" field.
func counterKeyOf(t *asynq.Task) string { return decodeCounter(t).Key }

// open lets the held runs of seq return.
func (tr *keyTracker) open(seq int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if g, ok := tr.gates[seq]; ok {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

// openAll opens every gate (for cleanups).
func (tr *keyTracker) openAll() {
	tr.mu.Lock()
	seqs := make([]int, 0, len(tr.gates))
	for s := range tr.gates {
		seqs = append(seqs, s)
	}
	tr.mu.Unlock()
	for _, s := range seqs {
		tr.open(s)
	}
}

func (tr *keyTracker) handler(result func(keyRun) error) asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		r := keyRun{id: id, key: tr.keyOf(t), seq: decodeCounter(t).Seq, retry: n}
		tr.mu.Lock()
		if others := tr.active[r.key]; len(others) > 0 {
			tr.overlaps = append(tr.overlaps, fmt.Sprintf("key %q: %s (seq %d) started while %v ran", r.key, id, r.seq, others))
		}
		tr.active[r.key] = append(tr.active[r.key], id)
		gate := tr.gates[r.seq]
		tr.mu.Unlock()
		tr.starts <- r
		if gate != nil {
			select {
			case <-gate:
			case <-ctx.Done():
			}
		}
		var err error
		if result != nil {
			err = result(r)
		}
		r.err = err
		tr.mu.Lock()
		ids := tr.active[r.key]
		for i, x := range ids {
			if x == id {
				tr.active[r.key] = append(ids[:i:i], ids[i+1:]...)
				break
			}
		}
		tr.done = append(tr.done, r)
		tr.mu.Unlock()
		tr.ends <- r
		return err
	}
}

func (tr *keyTracker) overlapsSeen() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]string(nil), tr.overlaps...)
}

// noSecondStart fails the test if another run of the key starts while
// first runs (its handler blocked): it waits until asynq has answered
// every other task of h's queue that could run (none pending, none active
// but first), so the middleware has decided each.
func (tr *keyTracker) noSecondStart(t *testing.T, h *harness, first keyRun, why string) {
	t.Helper()
	eventually(t, "every other task of the queue answered while "+first.id+" runs", func() bool {
		select {
		case r := <-tr.starts:
			t.Errorf("%s: %s (seq %d, retry %d) started while %s (seq %d) was still running; overlaps: %v",
				why, r.id, r.seq, r.retry, first.id, first.seq, tr.overlapsSeen())
			return true
		default:
		}
		qi, err := h.insp.GetQueueInfo(h.queue)
		return err == nil && qi.Pending == 0 && qi.Active <= 1
	})
}

// taskStateName names a task's asynq state ("gone" when asynq has no record).
func taskStateName(h *harness, id string) string {
	if s := h.taskState(id); s != 0 {
		return s.String()
	}
	return "gone"
}

// seqRun is one handler run seen by seqTracker.
type seqRun struct {
	id       string
	key      string
	seq, n   int
	retry    int
	overlaps []string // runs of the same key going on when this one started
}

// seqTracker is a handler that reports every start and end, notes runs of
// one key at once, and holds the runs of gated sequence numbers until the
// test opens their gate.
type seqTracker struct {
	mu     sync.Mutex
	active map[string][]string
	gates  map[int]chan struct{}
	seen   []seqRun
	starts chan seqRun
	ends   chan seqRun
}

func newSeqTracker(gated ...int) *seqTracker {
	tr := &seqTracker{active: map[string][]string{}, gates: map[int]chan struct{}{},
		starts: make(chan seqRun, 1000), ends: make(chan seqRun, 1000)}
	for _, s := range gated {
		tr.gates[s] = make(chan struct{})
	}
	return tr
}

func (tr *seqTracker) open(seq int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if g, ok := tr.gates[seq]; ok {
		select {
		case <-g:
		default:
			close(g)
		}
	}
}

func (tr *seqTracker) openAll() {
	tr.mu.Lock()
	var seqs []int
	for s := range tr.gates {
		seqs = append(seqs, s)
	}
	tr.mu.Unlock()
	for _, s := range seqs {
		tr.open(s)
	}
}

// runs returns every run started so far.
func (tr *seqTracker) runs() []seqRun {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]seqRun(nil), tr.seen...)
}

func (tr *seqTracker) handler() asynq.HandlerFunc {
	return func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		p := decodeCounter(t)
		r := seqRun{id: id, key: p.Key, seq: p.Seq, n: p.N, retry: n}
		tr.mu.Lock()
		r.overlaps = append([]string(nil), tr.active[r.key]...)
		tr.active[r.key] = append(tr.active[r.key], id)
		tr.seen = append(tr.seen, r)
		gate := tr.gates[r.seq]
		tr.mu.Unlock()
		tr.starts <- r
		if gate != nil {
			select {
			case <-gate:
			case <-ctx.Done():
			}
		}
		tr.mu.Lock()
		ids := tr.active[r.key]
		for i, x := range ids {
			if x == id {
				tr.active[r.key] = append(ids[:i:i], ids[i+1:]...)
				break
			}
		}
		tr.mu.Unlock()
		tr.ends <- r
		return nil
	}
}

// serveWith runs an asynq server on queue with d's middleware until the test
// ends.
func serveWith(t *testing.T, rdb redis.UniversalClient, d *Dedup, queue string, handler asynq.Handler, tweak func(*asynq.Config)) *asynq.Server {
	t.Helper()
	cfg := asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          5 * time.Second,
		IsFailure:                IsFailure,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(d.Middleware()(handler)); err != nil {
		t.Fatalf("server start: %v", err)
	}
	var once sync.Once
	t.Cleanup(func() { once.Do(srv.Shutdown) })
	return srv
}

// within polls cond until it holds or d passes; it reports whether it
// held. For state asynq changes in Redis, which sends no signal.
func within(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// waitSeqStart waits up to d for a run of seq to start; nil if none did.
func waitSeqStart(tr *seqTracker, seq int, d time.Duration) *seqRun {
	timeout := time.After(d)
	for {
		select {
		case r := <-tr.starts:
			if r.seq == seq {
				return &r
			}
		case <-timeout:
			return nil
		}
	}
}

// metKeyHeld reports whether d's middleware has answered a task that met its
// key held (busy, or superseded).
func metKeyHeld(d *Dedup, n uint64) func() bool {
	return func() bool { s := d.Stats(); return s.Busy+s.Superseded >= n }
}

// dueIn is how long until a scheduled task is due, or 0.
func dueIn(h *harness, id string) time.Duration {
	ti, err := h.insp.GetTaskInfo(h.queue, id)
	if err != nil || ti.State != asynq.TaskStateScheduled {
		return 0
	}
	return time.Until(ti.NextProcessAt).Round(time.Second)
}

// serveRaw starts an asynq server on queue with handler (already wrapped in
// whatever middleware the test wants) and returns it with a shutdown that
// runs once (also at cleanup).
func serveRaw(t *testing.T, rdb redis.UniversalClient, queue string, handler asynq.Handler, tweak func(*asynq.Config)) (*asynq.Server, func()) {
	t.Helper()
	cfg := asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{queue: 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
		ShutdownTimeout:          5 * time.Second,
		IsFailure:                IsFailure,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return time.Hour },
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(handler); err != nil {
		t.Fatalf("server start: %v", err)
	}
	var once sync.Once
	stop := func() { once.Do(srv.Shutdown) }
	t.Cleanup(stop)
	return srv, stop
}

// requirePlainID fails the test unless id is of the library's own plain
// form: a task NewClient stored with its lock, whose attempts start with the
// begin script shared between attempts (begin.go). The tests that call it
// are about such tasks.
func requirePlainID(t *testing.T, id string) {
	t.Helper()
	if store.KindOf(id) != store.IDPlain {
		t.Fatalf("task ID %q is not the wrapper's own", id)
	}
}

// newDirectHarness is a harness over counter tasks keyed by "key",
// enqueuing through NewClient (the direct path, timed IDs).
func newDirectHarness(t *testing.T, r Rule) *harness {
	t.Helper()
	h := newHarness(t, counterRules(r))
	h.client = h.d.NewClient()
	return h
}

// jobType is the type of jobTask's tasks; jobRules keys it on "key".
const jobType = "job"

// jobTask is a task of jobType for key, n telling its payloads apart.
func jobTask(key string, n int) *asynq.Task {
	return asynq.NewTask(jobType, fmt.Appendf(nil, `{"key":%q,"n":%d}`, key, n))
}

// jobPayload is jobTask's payload.
type jobPayload struct {
	Key string `json:"key"`
	N   int    `json:"n"`
}

func decodeJob(task *asynq.Task) jobPayload {
	var p jobPayload
	_ = json.Unmarshal(task.Payload(), &p)
	return p
}

// jobRulesQuickHeartbeat is jobRules with a one-second heartbeat, so that a
// failure's hold settled on a guess is checked again soon (at the next
// heartbeat, Lease/3).
func jobRulesQuickHeartbeat(r Rule) Config {
	cfg := jobRules(r)
	cfg.heartbeat = (3 * time.Second) / 3
	return cfg
}

// queueTasks counts the tasks of h's queue in any state.
func queueTasks(t *testing.T, h *harness) int {
	t.Helper()
	qi, err := h.insp.GetQueueInfo(h.queue)
	if err != nil {
		return 0 // (no such queue yet)
	}
	return qi.Size
}

// jobRules is a Config whose one rule, r keyed on "key", is jobType's.
func jobRules(r Rule) Config {
	r.Fields = []string{"key"}
	return Config{Rules: map[string]Rule{jobType: r}}
}

// outlivingHandler is a handler under h's middleware that sends each run's
// task ID on started and ignores its context until finish (called at the
// test's cleanup too): a handler that outlives ShutdownTimeout or its
// deadline.
func outlivingHandler(t *testing.T, h *harness) (handler asynq.Handler, started <-chan string, finish func()) {
	leftover, ids := make(chan struct{}), make(chan string, 4)
	var once sync.Once
	finish = func() { once.Do(func() { close(leftover) }) }
	t.Cleanup(finish)
	handler = h.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ids <- id
		<-leftover // ignores its context
		return nil
	}))
	return handler, ids, finish
}
