package versions

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// linked is the asynq version in the test binary ("" if it names none).
func linked() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	for _, m := range info.Deps {
		if m.Path == "github.com/hibiken/asynq" {
			if m.Replace != nil {
				m = m.Replace
			}
			return m.Version
		}
	}
	return ""
}

// hasHeaders reports whether the linked asynq has task headers (v0.26.0).
func hasHeaders() bool {
	_, ok := any((*asynq.Task)(nil)).(interface{ Headers() map[string]string })
	return ok
}

// env is one test's Dedup, queue and client, on the shared redis-server.
type env struct {
	t      *testing.T
	q      string
	d      *dedup.Dedup
	c      *dedup.Client
	insp   *asynq.Inspector
	logged *redistest.LogBuffer
	prefix string
	rdb    *redis.Client
}

// clients are the two ways to enqueue: NewClient (its direct path where the
// linked asynq is v0.26.0, asynq's client otherwise) and WrapClient over
// asynq's own client.
var clients = []string{"NewClient", "WrapClient"}

// eachClient runs f as a parallel subtest for each client.
func eachClient(t *testing.T, rules map[string]dedup.Rule, f func(t *testing.T, e *env)) {
	t.Parallel()
	redistest.NeedReal(t)
	for _, name := range clients {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f(t, newEnv(t, name, rules))
		})
	}
}

func newEnv(t *testing.T, client string, rules map[string]dedup.Rule) *env {
	uniq := redistest.Uniq(t)
	logged := &redistest.LogBuffer{}
	rdb := redistest.Client(t)
	d, err := dedup.New(context.Background(), rdb, dedup.Config{
		Prefix: "v-" + uniq, Rules: rules, Logger: slog.New(slog.NewTextHandler(logged, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	e := &env{t: t, q: uniq, d: d, logged: logged, prefix: "v-" + uniq, rdb: rdb, insp: asynq.NewInspector(asynq.RedisClientOpt{Addr: redistest.Addr()})}
	t.Cleanup(func() { _ = e.insp.Close() })
	switch client {
	case "NewClient":
		e.c = d.NewClient()
	default:
		e.c = d.WrapClient(asynq.NewClient(asynq.RedisClientOpt{Addr: redistest.Addr()}))
	}
	t.Cleanup(func() { _ = e.c.Close() })
	return e
}

// submit enqueues typ with payload p in the test's queue.
func (e *env) submit(typ, p string, opts ...asynq.Option) (dedup.Result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return e.c.Submit(ctx, asynq.NewTask(typ, []byte(p)), append([]asynq.Option{asynq.Queue(e.q)}, opts...)...)
}

// mustSubmit is submit, failing the test on an error or on another outcome
// than want.
func (e *env) mustSubmit(want dedup.Outcome, typ, p string, opts ...asynq.Option) dedup.Result {
	e.t.Helper()
	res, err := e.submit(typ, p, opts...)
	if err != nil || res.Outcome != want {
		e.t.Fatalf("submit %s %q: %v, %v; want %v", typ, p, res.Outcome, err, want)
	}
	return res
}

// duplicate submits typ with payload p and returns the refusal, failing the
// test on any other answer.
func (e *env) duplicate(typ, p string) *dedup.DuplicateTaskError {
	e.t.Helper()
	res, err := e.submit(typ, p)
	dup, ok := err.(*dedup.DuplicateTaskError)
	if !ok {
		e.t.Fatalf("submit %s %q: %v, %v; want a duplicate", typ, p, res.Outcome, err)
	}
	return dup
}

// free reports whether typ's key for payload p is free.
func (e *env) free(typ, p string) bool {
	_, found, err := e.d.Lookup(context.Background(), asynq.NewTask(typ, []byte(p)), asynq.Queue(e.q))
	if err != nil {
		e.t.Fatal(err)
	}
	return !found
}

// lookup returns the state of typ's key for payload p ("" when free).
func (e *env) lookup(typ, p string) string {
	l, found, err := e.d.Lookup(context.Background(), asynq.NewTask(typ, []byte(p)), asynq.Queue(e.q))
	if err != nil {
		e.t.Fatal(err)
	}
	if !found {
		return ""
	}
	return l.State
}

// serve runs a server on the test's queue with the middleware and h, until
// the test ends. Retries come after 100 ms.
func (e *env) serve(h asynq.HandlerFunc) {
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: redistest.Addr()}, asynq.Config{
		Concurrency: 4, Queues: map[string]int{e.q: 1}, LogLevel: asynq.FatalLevel,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond },
		DelayedTaskCheckInterval: 100 * time.Millisecond, ShutdownTimeout: 5 * time.Second,
	})
	if err := srv.Start(e.d.Middleware()(h)); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(srv.Shutdown)
}

// serveRecording serves a handler that succeeds at once, recording each
// run's payload.
func (e *env) serveRecording() *runs {
	r := newRuns()
	e.serve(func(_ context.Context, task *asynq.Task) error {
		r.enter(string(task.Payload()))
		r.exit(string(task.Payload()))
		return nil
	})
	return r
}

// runs records what a handler ran, and signals each run.
type runs struct {
	mu       sync.Mutex
	payloads []string
	live     int
	maxLive  int
	ran      chan string
}

func newRuns() *runs { return &runs{ran: make(chan string, 100)} }

// enter and exit bracket a run (maxLive: most runs of one key at once).
func (r *runs) enter(p string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.payloads = append(r.payloads, p)
	r.live++
	r.maxLive = max(r.maxLive, r.live)
}

func (r *runs) exit(p string) {
	r.mu.Lock()
	r.live--
	r.mu.Unlock()
	r.ran <- p
}

// most is the most runs there were at once.
func (r *runs) most() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.maxLive
}

func (r *runs) seen() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.payloads...)
}
