// Package dedupotel traces and measures github.com/asynq-dedup/dedup with
// OpenTelemetry. It is a module of its own, so that programs using only
// package dedup do not link OpenTelemetry.
//
//	client := dedupotel.NewClient(d, d.NewClient(), dedupotel.Options{Redis: rdb})
//	mux.Use(dedupotel.Middleware(dedupotel.Options{Redis: rdb}), d.Middleware())
//	reg, err := dedupotel.RegisterMetrics(d, nil)
//
// The Client makes a producer span per enqueue, naming what deduplication
// decided, and injects the span's context into the headers of the task the
// call creates (dedup.Headers). The Middleware, mounted outside
// Dedup.Middleware, continues that trace in a consumer span per attempt,
// naming what became of the attempt's lock (attempt.Attempt), and links the
// span of every producer whose call was folded into the task (Replace,
// Merge, Debounce, RunningDefer). RegisterMetrics exports the counters of
// Dedup.StatsByType as an observable counter. See docs/otel.md.
//
// No span attribute ever holds a payload or a key's text: keys appear
// hashed (dedup.key.hash, the lock's fingerprint).
package dedupotel

import (
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the tracers and the meter.
const ScopeName = "github.com/asynq-dedup/dedup/dedupotel"

// MessagingSystem is the messaging.system attribute of every span.
const MessagingSystem = "asynq"

// Attribute keys of this package's spans, beside OpenTelemetry's messaging
// conventions (messaging.system, messaging.destination.name,
// messaging.operation.type and .name, messaging.message.id).
const (
	// AttrTaskType is the task type.
	AttrTaskType = attribute.Key("dedup.task.type")
	// AttrDecision is what an enqueue did: created, replaced, merged,
	// deferred, duplicate, cooling, over_bound, fail_open or error.
	AttrDecision = attribute.Key("dedup.decision")
	// AttrConflict and AttrRunning are the call's policies (dedup.Conflict,
	// dedup.Running), on calls that returned a dedup.Result.
	AttrConflict = attribute.Key("dedup.policy.conflict")
	AttrRunning  = attribute.Key("dedup.policy.running")
	// AttrKeyHash is the key hashed: the lock's fingerprint (16 or 32 hex
	// digits), never the key's text.
	AttrKeyHash = attribute.Key("dedup.key.hash")
	// AttrHolder is the task holding the key: of a duplicate, of a busy
	// attempt, or the task a busy attempt was folded into.
	AttrHolder = attribute.Key("dedup.holder.task_id")
	// AttrFollowUp is true on an enqueue whose task is a running task's
	// follow-up (dedup.Result.FollowUp).
	AttrFollowUp = attribute.Key("dedup.follow_up")
	// AttrNotApplied names the options a folded call's task did not take
	// (dedup.Result.NotApplied): option names, never their values' payloads.
	AttrNotApplied = attribute.Key("dedup.not_applied")
	// AttrBreaker is the circuit breaker's state after the call
	// (read through internal/hook): closed, open or probing.
	AttrBreaker = attribute.Key("dedup.breaker")
	// AttrLinked is false on a folded enqueue whose link could not be
	// recorded for the task's consumer span (Redis failed).
	AttrLinked = attribute.Key("dedup.link.recorded")
	// AttrAttempt is asynq's retry count of the attempt: 0 on the first.
	AttrAttempt = attribute.Key("dedup.attempt")
	// AttrOutcome is what the dedup middleware did with the attempt
	// (attempt.Outcome's name: released, held, cooling, busy_retried,
	// busy_dropped, busy_folded, superseded, fail_open, allowed, ...).
	AttrOutcome = attribute.Key("dedup.outcome")
	// AttrArrived is true for a task that arrived without a lock (a
	// Scheduler, another service): the execution-time guard keyed it.
	AttrArrived = attribute.Key("dedup.arrived")
	// AttrFollowUpQueued is the follow-up task (RunningDefer) the attempt's
	// release queued.
	AttrFollowUpQueued = attribute.Key("dedup.follow_up.task_id")
	// AttrLinks is the number of folded producers linked to the attempt.
	AttrLinks = attribute.Key("dedup.links")
)

// Options configures a Client and the Middleware. The zero value is usable:
// spans go to the global providers, and no links are recorded.
type Options struct {
	// TracerProvider makes the spans. Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagator writes the producer span's context into the headers of the
	// task a call creates, and reads it back in the Middleware. Default:
	// otel.GetTextMapPropagator(), which is a no-op until set, as with
	// otel.SetTextMapPropagator(propagation.TraceContext{}).
	Propagator propagation.TextMapPropagator
	// Redis is where the Client keeps, per task, the span contexts of the
	// producers folded into it, and where the Middleware takes them back
	// (the Dedup's Redis, where the tasks live). Default: nil, no links.
	Redis redis.UniversalClient
	// MaxLinks bounds the links kept per task: the latest ones. Default: 32.
	MaxLinks int
	// LinkTTL is how long a task's links outlive the last fold into it, if
	// no attempt takes them. Default: 24 hours.
	LinkTTL time.Duration
}

// Defaults of Options.
const (
	DefaultMaxLinks = 32
	DefaultLinkTTL  = 24 * time.Hour
)

// settings are Options with the defaults filled in.
type settings struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	links  links
}

func (o Options) settings() *settings {
	tp, prop := o.TracerProvider, o.Propagator
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	l := links{rdb: o.Redis, max: int64(o.MaxLinks), ttl: o.LinkTTL}
	if l.max <= 0 {
		l.max = DefaultMaxLinks
	}
	if l.ttl <= 0 {
		l.ttl = DefaultLinkTTL
	}
	return &settings{tracer: tp.Tracer(ScopeName), prop: prop, links: l}
}
