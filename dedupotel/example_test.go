package dedupotel_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupotel"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// A traced client: each enqueue is a producer span naming the decision;
// the created task carries the span's traceparent header.
func ExampleNewClient() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, err := dedup.New(ctx, rdb, dedup.Config{Rules: map[string]dedup.Rule{"email:send": {Fields: []string{"to"}}}})
	if err != nil {
		panic(err)
	}
	defer d.Close()

	spans := tracetest.NewSpanRecorder() // in a program: an exporter's span processor
	opts := dedupotel.Options{
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		Propagator:     propagation.TraceContext{}, // default: otel.GetTextMapPropagator()
		Redis:          rdb,                        // for the links of folded calls
	}
	client := dedupotel.NewClient(d, d.NewClient(), opts)

	task := asynq.NewTask("email:send", []byte(`{"to":"a@example.com"}`))
	res, err := client.Submit(ctx, task, asynq.Queue("mail"))
	if err != nil {
		panic(err)
	}
	_, err = client.Submit(ctx, task, asynq.Queue("mail"))
	fmt.Println("second is a duplicate:", errors.Is(err, dedup.ErrDuplicateTask))

	info, _ := asynq.NewInspectorFromRedisClient(rdb).GetTaskInfo("mail", res.TaskID)
	fmt.Println("task has a traceparent:", info.Headers["traceparent"] != "")
	for _, s := range spans.Ended() {
		for _, kv := range s.Attributes() {
			if kv.Key == dedupotel.AttrDecision {
				fmt.Printf("%s: %s\n", s.Name(), kv.Value.AsString())
			}
		}
	}
	// Output:
	// second is a duplicate: true
	// task has a traceparent: true
	// send mail: created
	// send mail: duplicate
}

// The middleware, outside the dedup middleware, continues the producer's
// trace in a consumer span naming what became of the lock.
func ExampleMiddleware() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := dedup.New(ctx, rdb, dedup.Config{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	spans := tracetest.NewSpanRecorder()
	opts := dedupotel.Options{
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		Propagator:     propagation.TraceContext{},
		Redis:          rdb,
	}

	done := make(chan struct{}, 1)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		IsFailure: dedup.IsFailure, TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel,
	})
	mux := asynq.NewServeMux()
	mux.Use(dedupotel.Middleware(opts), d.Middleware()) // the OpenTelemetry one outside
	mux.HandleFunc("report:build", func(context.Context, *asynq.Task) error {
		done <- struct{}{}
		return nil
	})
	if err := srv.Start(mux); err != nil {
		panic(err)
	}
	client := dedupotel.NewClient(d, d.NewClient(), opts)
	if _, err := client.Submit(ctx, asynq.NewTask("report:build", []byte(`{"tenant":7}`))); err != nil {
		panic(err)
	}
	<-done
	srv.Shutdown() // waits for the attempt, and so for its span to end

	ended := spans.Ended()
	sort.Slice(ended, func(i, j int) bool { return ended[i].SpanKind() < ended[j].SpanKind() })
	for _, s := range ended {
		fmt.Println(s.SpanKind(), s.Name(), "trace shared:", s.SpanContext().TraceID() == ended[0].SpanContext().TraceID())
		for _, kv := range s.Attributes() {
			if kv.Key == dedupotel.AttrOutcome {
				fmt.Println("  dedup.outcome:", kv.Value.AsString())
			}
		}
	}
	// Output:
	// producer send default trace shared: true
	// consumer process default trace shared: true
	//   dedup.outcome: released
}
