package dedupotel

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "dedupotel")) }

// env is one test's world on the shared Redis: a Dedup with its own
// prefix, a queue, a traced client and a span recorder.
type env struct {
	t      *testing.T
	rdb    redis.UniversalClient
	d      *dedup.Dedup
	queue  string
	sr     *tracetest.SpanRecorder
	opts   Options
	client *Client
	insp   *asynq.Inspector
}

func newEnv(t *testing.T, cfg dedup.Config) *env {
	t.Helper()
	rdb := redistest.Client(t)
	name := redistest.Uniq(t)
	cfg.Prefix, cfg.Logger = "dd-"+name, redistest.QuietLogger()
	d, err := dedup.New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	opts := Options{TracerProvider: tp, Propagator: propagation.TraceContext{}, Redis: rdb}
	return &env{t: t, rdb: rdb, d: d, queue: "q-" + name, sr: sr, opts: opts,
		client: NewClient(d, d.NewClient(), opts), insp: asynq.NewInspectorFromRedisClient(rdb)}
}

// serve runs an asynq server on the env's queue: Middleware outside the
// dedup middleware, outside handler.
func (e *env) serve(handler asynq.HandlerFunc) {
	e.t.Helper()
	srv := asynq.NewServerFromRedisClient(e.rdb, asynq.Config{
		Concurrency: 4, Queues: map[string]int{e.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: dedup.IsFailure,
	})
	if err := srv.Start(Middleware(e.opts)(e.d.Middleware()(handler))); err != nil {
		e.t.Fatal(err)
	}
	var once sync.Once
	e.t.Cleanup(func() { once.Do(srv.Shutdown) })
}

// submit makes a call through the traced client in the env's queue and
// returns its result, error and producer span.
func (e *env) submit(task *asynq.Task, opts ...asynq.Option) (dedup.Result, error, sdktrace.ReadOnlySpan) {
	e.t.Helper()
	res, err := e.client.Submit(context.Background(), task, append(opts, asynq.Queue(e.queue))...)
	ended := e.sr.Ended()
	for i := len(ended) - 1; i >= 0; i-- { // the call's span ended before Submit returned
		if ended[i].SpanKind() == trace.SpanKindProducer {
			return res, err, ended[i]
		}
	}
	e.t.Fatal("no producer span")
	return res, err, nil
}

// consumer waits for the consumer span of task id to end, and checks it
// is the only one.
func (e *env) consumer(id string) sdktrace.ReadOnlySpan {
	e.t.Helper()
	var found []sdktrace.ReadOnlySpan
	redistest.Eventually(e.t, "the consumer span of "+id, func() bool {
		found = found[:0]
		for _, s := range e.sr.Ended() {
			if s.SpanKind() == trace.SpanKindConsumer && attr(s, "messaging.message.id").AsString() == id {
				found = append(found, s)
			}
		}
		return len(found) > 0
	})
	if len(found) != 1 {
		e.t.Fatalf("%d consumer spans for %s, want 1", len(found), id)
	}
	return found[0]
}

// attr returns the span's attribute key, or an empty value.
func attr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}
