package dedupotel

import (
	"context"
	"errors"
	"strings"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/hook"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// Client traces the enqueues of a *dedup.Client: a producer span per call,
// its trace context in the headers of the task the call creates, and, for
// a call folded into another task, a link recorded for that task's
// consumer span. It is safe for concurrent use.
type Client struct {
	d    *dedup.Dedup
	next *dedup.Client
	s    *settings
}

var _ dedup.Enqueuer = (*Client)(nil)

// NewClient returns a Client over next, a client of d (Dedup.NewClient or
// Dedup.WrapClient). Options.Redis should be d's Redis for folds to be
// linked.
func NewClient(d *dedup.Dedup, next *dedup.Client, o Options) *Client {
	return &Client{d: d, next: next, s: o.settings()}
}

// Enqueue is EnqueueContext with context.Background().
func (c *Client) Enqueue(task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return c.EnqueueContext(context.Background(), task, opts...)
}

// EnqueueContext is dedup.Client.EnqueueContext, traced (see Submit).
func (c *Client) EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	res, err := c.Submit(ctx, task, opts...)
	if err != nil {
		return nil, err
	}
	return res.Info, nil
}

// Submit is dedup.Client.Submit in a producer span ("send <queue>") that
// names the decision, the policies, the key's hash, the holder of a
// duplicate and the breaker's state. The span's context goes into the
// headers of the task the call creates (dedup.Headers, through the
// Propagator); a call folded into another task (Replaced, Merged,
// Deferred) records its span context for that task's consumer span to
// link to (Options.Redis).
func (c *Client) Submit(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (dedup.Result, error) {
	ctx, span := c.s.tracer.Start(ctx, "send", trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		semconv.MessagingSystemKey.String(MessagingSystem),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
	))
	defer func() {
		// Recovered before the span ends: the SDK's End would record the
		// panic's value (a KeyFunc's or MergeFunc's), which may quote the
		// payload. It goes on to the caller.
		if rec := recover(); rec != nil {
			span.SetStatus(codes.Error, "panicked")
			span.End()
			panic(rec)
		}
		span.End()
	}()
	if task != nil {
		span.SetAttributes(AttrTaskType.String(task.Type()))
	}
	carrier := propagation.MapCarrier{}
	c.s.prop.Inject(ctx, carrier)
	if len(carrier) > 0 {
		opts = append(opts[:len(opts):len(opts)], dedup.Headers(carrier))
	}
	res, err := c.next.Submit(ctx, task, opts...)
	queue := queueOf(c.d, task, opts, res, err)
	span.SetName("send " + queue)
	span.SetAttributes(semconv.MessagingDestinationName(queue), AttrBreaker.String(hook.BreakerState(c.d)))
	if err != nil {
		failed(span, err)
		return res, err
	}
	span.SetAttributes(resultAttrs(res)...)
	switch res.Outcome {
	case dedup.Created:
		if !strings.HasPrefix(res.TaskID, "dd-") { // a caller-chosen ID: folds into an earlier task of it are not this one's
			c.s.links.clear(ctx, queue, res.TaskID)
		}
	case dedup.Replaced, dedup.Merged, dedup.Deferred:
		if lerr := c.s.links.push(ctx, queue, res.TaskID, span.SpanContext()); lerr != nil {
			span.SetAttributes(AttrLinked.Bool(false))
		}
	}
	return res, nil
}

// resultAttrs describes an accepted call.
func resultAttrs(res dedup.Result) []attribute.KeyValue {
	decision := res.Outcome.String()
	if res.FailOpen {
		decision = "fail_open"
	}
	kv := []attribute.KeyValue{AttrDecision.String(decision), semconv.MessagingMessageID(res.TaskID)}
	if res.Fingerprint != "" {
		kv = append(kv, AttrKeyHash.String(res.Fingerprint), AttrConflict.String(res.Conflict.String()),
			AttrRunning.String(res.Running.String()), AttrFollowUp.Bool(res.FollowUp))
	}
	if len(res.NotApplied) > 0 {
		kv = append(kv, AttrNotApplied.StringSlice(res.NotApplied))
	}
	return kv
}

// failed describes a call that returned an error. A duplicate, a key
// cooling down and a full MaxPending are decisions, not failures: the
// span's status stays unset. Error texts are not recorded (a PayloadError
// may quote a field path); error.type names the class.
func failed(span trace.Span, err error) {
	var dup *dedup.DuplicateTaskError
	switch {
	case errors.As(err, &dup):
		decision := "duplicate"
		if dup.CoolingDown {
			decision = "cooling"
		}
		span.SetAttributes(AttrDecision.String(decision), AttrHolder.String(dup.Holder), AttrKeyHash.String(keyHash(dup.Key)))
	case errors.Is(err, dedup.ErrTooManyPending):
		span.SetAttributes(AttrDecision.String("over_bound"))
	default:
		class := errorClass(err)
		span.SetAttributes(AttrDecision.String("error"), semconv.ErrorTypeKey.String(class))
		span.SetStatus(codes.Error, class)
	}
}

// errorClasses name dedup's sentinel errors for error.type.
var errorClasses = []struct {
	err  error
	name string
}{
	{dedup.ErrOutcomeUnknown, "outcome_unknown"}, // before ErrUnavailable, which it matches too
	{dedup.ErrUnavailable, "unavailable"},
	{dedup.ErrInvalidPayload, "invalid_payload"},
	{dedup.ErrInvalidOption, "invalid_option"},
	{dedup.ErrContention, "contention"},
	{dedup.ErrIncompatible, "incompatible"},
	{dedup.ErrTasksElsewhere, "tasks_elsewhere"},
	{dedup.ErrKeyBusy, "busy"},
	{context.Canceled, "canceled"},
	{context.DeadlineExceeded, "deadline_exceeded"},
	{asynq.ErrTaskIDConflict, "task_id_conflict"},
}

// errorClass names err's class, "_OTHER" (OpenTelemetry's fallback) if it
// has none of dedup's.
func errorClass(err error) string {
	for _, c := range errorClasses {
		if errors.Is(err, c.err) {
			return c.name
		}
	}
	return "_OTHER"
}

// queueOf is the queue of a call: the task's, else the one its lock named,
// else the one the call would use (the call's or asynq.NewTask's, as
// dedup chooses it).
func queueOf(d *dedup.Dedup, task *asynq.Task, opts []asynq.Option, res dedup.Result, err error) string {
	var dup *dedup.DuplicateTaskError
	switch {
	case err == nil && res.Info != nil && res.Info.Queue != "":
		return res.Info.Queue
	case errors.As(err, &dup) && dup.Queue != "":
		return dup.Queue
	}
	return hook.QueueOf(d, task, opts...)
}

// keyHash is the fingerprint a lock key ends with; "" for a string that
// does not end as a lock key does.
func keyHash(lockKey string) string {
	_, _, fp, _ := store.ParseLockKey(lockKey)
	return fp
}
