package dedupotel

import (
	"context"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Links of folded producers. A call folded into a task (Replaced, Merged,
// Deferred; a burst under Debounce) adds no headers to it: the task keeps
// the trace context of the call that created it. So the Client pushes the
// folded call's span context (W3C traceparent) onto a capped list keyed by
// the task that carries its payload, and the Middleware, once an attempt of
// that task has run, takes the list and links the attempt's span to each
// producer. The list lives in the queue's hash slot, beside asynq's record
// of the task, so it works on Redis Cluster.

// LinksKey is the Redis key of the list of the producers folded into task
// id of queue: "dedupotel:{<queue>}:links:<id>". This is the one place its
// format is written.
func LinksKey(queue, id string) string { return "dedupotel:{" + queue + "}:links:" + id }

// w3c encodes the links, whatever Options.Propagator is.
var w3c = propagation.TraceContext{}

// links keeps the lists; a nil rdb keeps none.
type links struct {
	rdb redis.UniversalClient
	max int64
	ttl time.Duration
}

// push records sc as folded into task id of queue: the newest first, the
// list cut to max, its lifetime renewed.
func (l *links) push(ctx context.Context, queue, id string, sc trace.SpanContext) error {
	if l.rdb == nil || !sc.IsValid() || id == "" {
		return nil
	}
	c := propagation.MapCarrier{}
	w3c.Inject(trace.ContextWithSpanContext(context.Background(), sc), c)
	key := LinksKey(queue, id)
	ctx = context.WithoutCancel(ctx) // a fold that happened is recorded even if the caller gives up
	_, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.LPush(ctx, key, c.Get("traceparent"))
		p.LTrim(ctx, key, 0, l.max-1)
		p.PExpire(ctx, key, l.ttl)
		return nil
	})
	return err
}

// clear forgets the links recorded for task id of queue: a new task of a
// caller-chosen ID must not inherit those of an earlier task of that ID.
func (l *links) clear(ctx context.Context, queue, id string) {
	if l.rdb == nil || id == "" {
		return
	}
	_ = l.rdb.Del(context.WithoutCancel(ctx), LinksKey(queue, id)).Err() // (at worst, stale links on one span)
}

// take returns the links recorded for task id of queue, oldest first, and
// deletes them.
func (l *links) take(ctx context.Context, queue, id string) ([]trace.Link, error) {
	if l.rdb == nil || id == "" {
		return nil, nil
	}
	key := LinksKey(queue, id)
	ctx = context.WithoutCancel(ctx) // the attempt's context may have ended with it
	var lr *redis.StringSliceCmd
	_, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		lr = p.LRange(ctx, key, 0, -1)
		p.Del(ctx, key)
		return nil
	})
	if err != nil {
		return nil, err
	}
	vals := lr.Val()
	slices.Reverse(vals)
	out := make([]trace.Link, 0, len(vals))
	for _, v := range vals {
		sc := trace.SpanContextFromContext(w3c.Extract(context.Background(), propagation.MapCarrier{"traceparent": v}))
		if sc.IsValid() {
			out = append(out, trace.Link{SpanContext: sc})
		}
	}
	return out, nil
}
