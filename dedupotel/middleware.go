package dedupotel

import (
	"context"
	"errors"
	"fmt"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/attempt"
	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// Middleware returns an asynq middleware that runs each attempt in a
// consumer span ("process <queue>"), a child of the producer span whose
// context the task's headers carry (Options.Propagator), with what the
// dedup middleware did with the attempt's lock (attempt.Attempt). Mount it
// outside Dedup.Middleware:
//
//	mux.Use(dedupotel.Middleware(opts), d.Middleware())
//
// Once an attempt has run, its span is linked to the producers folded into
// the task since it was created or last run (Options.Redis; the latest
// Options.MaxLinks). An attempt that did not run (busy, refused) leaves
// them for the one that does. A busy attempt folded into the key's task
// (dedup.BusyFold) records its own span for that task's links.
func Middleware(o Options) asynq.MiddlewareFunc {
	s := o.settings()
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return s.process(ctx, t, next)
		})
	}
}

// process runs one attempt in its span.
func (s *settings) process(ctx context.Context, t *asynq.Task, next asynq.Handler) (err error) {
	id, _ := asynq.GetTaskID(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	retry, _ := asynq.GetRetryCount(ctx)
	parent := s.prop.Extract(ctx, propagation.MapCarrier(t.Headers()))
	ctx, span := s.tracer.Start(parent, "process "+queue, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
		semconv.MessagingSystemKey.String(MessagingSystem),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(queue),
		semconv.MessagingMessageID(id),
		AttrTaskType.String(t.Type()),
		AttrAttempt.Int(retry),
	))
	var a attempt.Attempt
	defer func() {
		// Recovered before the span ends: the SDK's End would record the
		// panic's value, which may quote the payload. It goes on to asynq.
		rec := recover()
		s.settle(ctx, span, queue, id, &a)
		if rec != nil {
			span.SetStatus(codes.Error, "handler panicked")
		}
		span.End()
		if rec != nil {
			panic(rec)
		}
	}()
	err = next.ProcessTask(attempt.With(ctx, &a), t)
	switch {
	case err == nil, errors.Is(err, dedup.ErrKeyBusy): // busy: retried later, no failure
	default:
		span.SetAttributes(semconv.ErrorTypeKey.String(errorType(err)))
		span.SetStatus(codes.Error, errorType(err))
	}
	return err
}

// settle puts what the dedup middleware did on the span, and the links
// of the producers folded into the task once it has run.
func (s *settings) settle(ctx context.Context, span trace.Span, queue, id string, a *attempt.Attempt) {
	span.SetAttributes(attemptAttrs(a)...)
	switch a.Outcome {
	case attempt.BusyRetried, attempt.BusyDropped, attempt.Superseded, attempt.Refused:
		return // did not run: its folds are for the attempt that does
	case attempt.BusyFolded:
		if err := s.links.push(ctx, queue, a.Holder, span.SpanContext()); err != nil {
			span.SetAttributes(AttrLinked.Bool(false))
		}
		return
	}
	ls, err := s.links.take(ctx, queue, id)
	if err != nil {
		span.SetAttributes(AttrLinked.Bool(false))
	}
	for _, l := range ls {
		span.AddLink(l)
	}
	if len(ls) > 0 {
		span.SetAttributes(AttrLinks.Int(len(ls)))
	}
}

// attemptAttrs describes the attempt's lock.
func attemptAttrs(a *attempt.Attempt) []attribute.KeyValue {
	kv := []attribute.KeyValue{AttrOutcome.String(a.Outcome.String()), AttrArrived.Bool(a.Arrived)}
	if a.Fingerprint != "" { // (a plain task's lock is asynq's: the middleware does not read it)
		kv = append(kv, AttrKeyHash.String(a.Fingerprint))
	}
	if a.Holder != "" {
		kv = append(kv, AttrHolder.String(a.Holder))
	}
	if a.FollowUp != "" {
		kv = append(kv, AttrFollowUpQueued.String(a.FollowUp))
	}
	return kv
}

// errorType names the class of a handler's error: dedup's, asynq's
// SkipRetry or RevokeTask, else its Go type (never its text, which may
// quote a payload).
func errorType(err error) string {
	switch c := errorClass(err); {
	case c != "_OTHER":
		return c
	case errors.Is(err, asynq.SkipRetry):
		return "skip_retry"
	case errors.Is(err, asynq.RevokeTask):
		return "revoke_task"
	}
	return fmt.Sprintf("%T", err)
}
