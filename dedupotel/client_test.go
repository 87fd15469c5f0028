package dedupotel

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// TestCreatedTaskContinuesTrace: a created task carries the producer's
// traceparent, and its consumer span is the producer span's child, with the
// attempt's outcome. (A plain task's lock is asynq's, which the middleware
// does not read: its consumer span has no key hash; the producer's has.)
func TestCreatedTaskContinuesTrace(t *testing.T) {
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:new": {Fields: []string{"k"}}}})
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	res, err, prod := e.submit(asynq.NewTask("ot:new", []byte(`{"k":1}`)))
	if err != nil || res.Outcome != dedup.Created {
		t.Fatalf("Submit: %+v, %v", res, err)
	}
	for key, want := range map[string]string{"dedup.decision": "created", "messaging.system": "asynq", "messaging.destination.name": e.queue,
		"messaging.operation.type": "send", "dedup.key.hash": res.Fingerprint, "dedup.breaker": "closed", "messaging.message.id": res.TaskID,
		"dedup.policy.conflict": "reject", "dedup.task.type": "ot:new"} {
		if got := attr(prod, key).Emit(); got != want {
			t.Errorf("producer %s = %q, want %q", key, got, want)
		}
	}
	if prod.Name() != "send "+e.queue || prod.SpanKind() != trace.SpanKindProducer {
		t.Errorf("producer span %q kind %v", prod.Name(), prod.SpanKind())
	}
	cons := e.consumer(res.TaskID)
	if cons.SpanContext().TraceID() != prod.SpanContext().TraceID() || cons.Parent().SpanID() != prod.SpanContext().SpanID() {
		t.Errorf("consumer span is not the producer's child: trace %v parent %v, producer %v", cons.SpanContext().TraceID(), cons.Parent().SpanID(), prod.SpanContext())
	}
	for key, want := range map[string]string{"dedup.outcome": "released", "dedup.key.hash": "", "dedup.attempt": "0",
		"messaging.operation.type": "process", "dedup.arrived": "false"} {
		if got := attr(cons, key).Emit(); got != want {
			t.Errorf("consumer %s = %q, want %q", key, got, want)
		}
	}
}

// TestFoldedBurstLinksEachProducer: a burst folded by Merge, and one by
// Replace, runs as one task whose one consumer span continues the first
// producer's trace and links every folded producer, oldest first; the
// links are bounded to the latest MaxLinks (32).
func TestFoldedBurstLinksEachProducer(t *testing.T) {
	latest := func(_, n []byte) ([]byte, error) { return n, nil }
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{
		"ot:merge":   {Fields: []string{"k"}, OnConflict: dedup.Merge, MergeFunc: latest},
		"ot:replace": {Fields: []string{"k"}, OnConflict: dedup.Replace},
	}})
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	for typ, burst := range map[string]int{"ot:merge": 4, "ot:replace": 40} {
		first, err, firstSpan := e.submit(asynq.NewTask(typ, []byte(`{"k":1,"n":0}`)), asynq.ProcessIn(time.Hour))
		if err != nil || first.Outcome != dedup.Created {
			t.Fatalf("%s: first: %+v, %v", typ, first, err)
		}
		var folded []trace.SpanContext
		for i := 1; i <= burst; i++ {
			res, err, span := e.submit(asynq.NewTask(typ, fmt.Appendf(nil, `{"k":1,"n":%d}`, i)))
			if err != nil || res.TaskID != first.TaskID || (res.Outcome != dedup.Merged && res.Outcome != dedup.Replaced) {
				t.Fatalf("%s: fold %d: %+v, %v", typ, i, res, err)
			}
			if got := attr(span, "dedup.not_applied").AsStringSlice(); !strings.Contains(strings.Join(got, ","), "dedup.Headers") {
				t.Errorf("%s: fold's not_applied %q lacks dedup.Headers", typ, got)
			}
			folded = append(folded, span.SpanContext())
		}
		if err := e.insp.RunTask(e.queue, first.TaskID); err != nil {
			t.Fatal(err)
		}
		cons := e.consumer(first.TaskID)
		if cons.SpanContext().TraceID() != firstSpan.SpanContext().TraceID() {
			t.Errorf("%s: consumer not in the first producer's trace", typ)
		}
		want := folded[max(0, len(folded)-DefaultMaxLinks):]
		if got := linkedTo(cons); !equalContexts(got, want) {
			t.Errorf("%s: links %d, want the last %d folded producers, oldest first", typ, len(got), len(want))
		}
	}
}

func linkedTo(s sdktrace.ReadOnlySpan) []trace.SpanContext {
	var out []trace.SpanContext
	for _, l := range s.Links() {
		out = append(out, l.SpanContext)
	}
	return out
}

func equalContexts(a, b []trace.SpanContext) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].TraceID() != b[i].TraceID() || a[i].SpanID() != b[i].SpanID() {
			return false
		}
	}
	return true
}

// TestDuplicateNamesHolder: a duplicate's span names the holder and the
// key's hash; its status is no error.
func TestDuplicateNamesHolder(t *testing.T) {
	e := newEnv(t, dedup.Config{})
	first, err, _ := e.submit(asynq.NewTask("ot:dup", []byte(`{}`)), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	_, err, span := e.submit(asynq.NewTask("ot:dup", []byte(`{}`)))
	if !errors.Is(err, dedup.ErrDuplicateTask) {
		t.Fatalf("second call: %v", err)
	}
	if attr(span, "dedup.decision").AsString() != "duplicate" || attr(span, "dedup.holder.task_id").AsString() != first.TaskID ||
		attr(span, "dedup.key.hash").AsString() != first.Fingerprint || span.Status().Code != 0 {
		t.Errorf("duplicate span: %v, status %v", span.Attributes(), span.Status())
	}
}

// TestNoPayloadOrKeyInSpans: no attribute, event, link or status of any
// span, producer or consumer, holds the payload or the key's text.
func TestNoPayloadOrKeyInSpans(t *testing.T) {
	const payloadSecret, keySecret = "PAYLOAD-7f3a9c", "KEYTEXT-91c2ee"
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:sec": {OnConflict: dedup.Replace}}})
	e.serve(func(context.Context, *asynq.Task) error { return errors.New("handler fails") })
	payload := []byte(`{"secret":"` + payloadSecret + `"}`)
	first, err, _ := e.submit(asynq.NewTask("ot:sec", payload), dedup.Key(keySecret), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	e.submit(asynq.NewTask("ot:sec", payload), dedup.Key(keySecret)) // folded
	e.submit(asynq.NewTask("ot:sec", payload), dedup.Key(keySecret), dedup.OnConflict(dedup.Reject))
	e.submit(asynq.NewTask("ot:sec", payload), dedup.Fields("secret.nope"))
	e.submit(asynq.NewTask("ot:sec", []byte(payloadSecret)), dedup.Fields("x"))
	if err := e.insp.RunTask(e.queue, first.TaskID); err != nil {
		t.Fatal(err)
	}
	e.consumer(first.TaskID)
	for _, s := range e.sr.Ended() {
		texts := []string{s.Name(), s.Status().Description}
		for _, kv := range s.Attributes() {
			texts = append(texts, kv.Value.Emit())
		}
		for _, ev := range s.Events() {
			for _, kv := range ev.Attributes {
				texts = append(texts, kv.Value.Emit())
			}
		}
		for _, l := range s.Links() {
			for _, kv := range l.Attributes {
				texts = append(texts, kv.Value.Emit())
			}
		}
		for _, txt := range texts {
			if strings.Contains(txt, payloadSecret) || strings.Contains(txt, keySecret) {
				t.Errorf("span %q holds a secret: %q", s.Name(), txt)
			}
		}
	}
}

// ---- what hostile payloads, reused IDs, bad headers and outages cannot do to the spans ----

// spanTexts is every text a span exports: name, status, attributes, event
// names and attributes, link attributes.
func spanTexts(s sdktrace.ReadOnlySpan) []string {
	texts := []string{s.Name(), s.Status().Description}
	for _, kv := range s.Attributes() {
		texts = append(texts, string(kv.Key)+"="+kv.Value.Emit())
	}
	for _, ev := range s.Events() {
		texts = append(texts, "event "+ev.Name)
		for _, kv := range ev.Attributes {
			texts = append(texts, "event "+ev.Name+" "+string(kv.Key)+"="+kv.Value.Emit())
		}
	}
	for _, l := range s.Links() {
		for _, kv := range l.Attributes {
			texts = append(texts, "link "+string(kv.Key)+"="+kv.Value.Emit())
		}
	}
	return texts
}

// noSecretInSpans fails the test for every exported text of every ended span
// that holds one of secrets.
func noSecretInSpans(t *testing.T, sr *tracetest.SpanRecorder, secrets ...string) {
	t.Helper()
	for _, s := range sr.Ended() {
		for _, txt := range spanTexts(s) {
			for _, sec := range secrets {
				if strings.Contains(txt, sec) {
					t.Errorf("span %q (%v) exports %q", s.Name(), s.SpanKind(), txt)
				}
			}
		}
	}
}

// serveRetryingFast is env.serve with a fast retry and the attempts' IDs counted.
func (e *env) serveRetryingFast(handler asynq.HandlerFunc) {
	e.t.Helper()
	srv := asynq.NewServerFromRedisClient(e.rdb, asynq.Config{
		Concurrency: 4, Queues: map[string]int{e.queue: 1},
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: dedup.IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 50 * time.Millisecond },
	})
	if err := srv.Start(Middleware(e.opts)(e.d.Middleware()(handler))); err != nil {
		e.t.Fatal(err)
	}
	var once sync.Once
	e.t.Cleanup(func() { once.Do(srv.Shutdown) })
}

// consumerSpans waits for n consumer spans of task id and returns them in
// the order they ended.
func (e *env) consumerSpans(id string, n int) []sdktrace.ReadOnlySpan {
	e.t.Helper()
	var found []sdktrace.ReadOnlySpan
	redistest.Eventually(e.t, fmt.Sprintf("%d consumer spans of %s", n, id), func() bool {
		found = found[:0]
		for _, s := range e.sr.Ended() {
			if s.SpanKind() == trace.SpanKindConsumer && attr(s, "messaging.message.id").AsString() == id {
				found = append(found, s)
			}
		}
		return len(found) >= n
	})
	return found
}

// Promised (docs/otel.md, Spans): "No attribute holds a payload or a key's
// text: keys appear only hashed, and error texts are not recorded (a span's
// status names the class)." (otel.go: "No span attribute ever holds a
// payload".)
//
// Tried here: the handler panics with a message quoting the payload, as
// `panic(fmt.Sprintf("bad order %s", payload))` does. The dedup middleware
// does not recover, so the panic unwinds through the consumer span's
// deferred span.End, which the OpenTelemetry SDK uses to record an
// "exception" event with exception.message = fmt.Sprint(the panic value).
// Likewise a KeyFunc panicking under Client.Submit's deferred span.End.
func TestPanicTextIsNotRecorded(t *testing.T) {
	const secret = "PANIC-PAYLOAD-5d1e77"
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:panic": {Fields: []string{"k"}}}})
	e.serve(func(_ context.Context, tk *asynq.Task) error {
		panic("cannot handle order " + string(tk.Payload()))
	})
	res, err, _ := e.submit(asynq.NewTask("ot:panic", []byte(`{"k":"`+secret+`"}`)), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	cons := e.consumer(res.TaskID)
	if cons.Status().Description != "handler panicked" {
		t.Errorf("status %q, want \"handler panicked\"", cons.Status().Description)
	}
	noSecretInSpans(t, e.sr, secret)

	// The producer side: a KeyFunc that panics quoting the payload (dedup
	// does not recover it), under the Client's deferred span.End.
	const psecret = "KEYFUNC-PAYLOAD-77aa01"
	p := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:kpanic": {KeyFunc: func(_ string, payload []byte) (string, error) {
		panic("cannot key " + string(payload))
	}}}})
	func() {
		defer func() { _ = recover() }()
		_, _ = p.client.Submit(context.Background(), asynq.NewTask("ot:kpanic", []byte(psecret)), asynq.Queue(p.queue))
	}()
	if len(p.sr.Ended()) == 0 {
		t.Fatal("no producer span")
	}
	noSecretInSpans(t, p.sr, psecret)
}

// Promised (docs/otel.md, Links): "the consumer span of a task into which
// others were folded links to each folded producer's span"; the list is
// "keyed by the task that carries the payload"; "each link appears on the
// first attempt that ran after its fold".
//
// Tried here: a caller-chosen task ID is reused. Task "order-…" gets a call
// folded into it (Replace), then is deleted before it runs (asynqmon,
// Inspector.DeleteTask). The same order is enqueued again with the same
// caller-chosen ID: a new task, created (not folded into), into which
// nothing was folded. Its consumer span must link to no producer; the
// deleted task's list (kept 24 h) must not be inherited.
func TestLinksDoNotLeakToAReusedTaskID(t *testing.T) {
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:reuse": {Fields: []string{"k"}, OnConflict: dedup.Replace}}})
	id := "order-" + redistest.Uniq(t)
	first, err, _ := e.submit(asynq.NewTask("ot:reuse", []byte(`{"k":1,"n":0}`)), asynq.TaskID(id), asynq.ProcessIn(time.Hour))
	if err != nil || first.Outcome != dedup.Created || first.TaskID != id {
		t.Fatalf("first: %+v, %v", first, err)
	}
	fold, err, foldSpan := e.submit(asynq.NewTask("ot:reuse", []byte(`{"k":1,"n":1}`)))
	if err != nil || fold.Outcome != dedup.Replaced || fold.TaskID != id {
		t.Fatalf("fold: %+v, %v", fold, err)
	}
	if err := e.insp.DeleteTask(e.queue, id); err != nil {
		t.Fatal(err)
	}
	// Its lock is orphaned now: the operator releases it (Dedup.Release).
	if ok, err := e.d.Release(context.Background(), asynq.NewTask("ot:reuse", []byte(`{"k":1}`)), id, asynq.Queue(e.queue)); err != nil || !ok {
		t.Logf("Release: %v, %v (the enqueue below heals the orphan instead)", ok, err)
	}
	second, err, _ := e.submit(asynq.NewTask("ot:reuse", []byte(`{"k":1,"n":2}`)), asynq.TaskID(id))
	if err != nil || second.Outcome != dedup.Created || second.TaskID != id {
		t.Fatalf("the order enqueued again: %+v, %v", second, err)
	}
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	cons := e.consumer(id)
	for _, l := range cons.Links() {
		if l.SpanContext.SpanID() == foldSpan.SpanContext().SpanID() {
			t.Errorf("the new task %s's consumer span links to the producer folded into the deleted task of that ID (links: %d, dedup.links=%s)",
				id, len(cons.Links()), attr(cons, "dedup.links").Emit())
		}
	}
}

// Promised (docs/otel.md): the Middleware reads the producer's context back
// from the task's headers; a consumer span per attempt with the outcome.
// Links "oldest first", only valid span contexts.
//
// Tried here: tasks enqueued by asynq's own client (no dedup, arriving without
// a lock) with hostile headers: garbage, all-zero IDs, an unknown version,
// a 256 KB traceparent, a 40 KB tracestate; and a links list stuffed with
// garbage (including a 1 MB entry) by another writer of the same Redis.
// Each must still run, in a root consumer span (no foreign parent out of
// garbage) with its outcome, and link to nothing.
func TestMalformedTraceparentIsHarmless(t *testing.T) {
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:tp": {Fields: []string{"k"}}}})
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	plain := asynq.NewClientFromRedisClient(e.rdb)
	hostile := []map[string]string{
		{"traceparent": "garbage"},
		{"traceparent": "00-00000000000000000000000000000000-0000000000000000-01"},
		{"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-" + strings.Repeat("x", 256<<10)},
		{"traceparent": "\r\n00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"},
		{"tracestate": strings.Repeat("a=b,", 10000), "traceparent": "00-zz"},
	}
	var ids []string
	for i, h := range hostile {
		id := fmt.Sprintf("tp-%s-%d", redistest.Uniq(t), i)
		if err := e.rdb.LPush(context.Background(), LinksKey(e.queue, id), "garbage", strings.Repeat("y", 1<<20), "00-"+strings.Repeat("0", 32)+"-"+strings.Repeat("0", 16)+"-01").Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := plain.Enqueue(asynq.NewTaskWithHeaders("ot:tp", fmt.Appendf(nil, `{"k":%d}`, i), h), asynq.Queue(e.queue), asynq.TaskID(id)); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	for i, id := range ids {
		cons := e.consumer(id)
		if cons.Parent().IsValid() {
			t.Errorf("headers %d: consumer span has parent %v out of a malformed traceparent", i, cons.Parent())
		}
		if got := attr(cons, "dedup.outcome").AsString(); got != "released" {
			t.Errorf("headers %d: outcome %q, want released", i, got)
		}
		if len(cons.Links()) != 0 || attr(cons, "dedup.links").Emit() != "" {
			t.Errorf("headers %d: %d links out of a garbage list", i, len(cons.Links()))
		}
		if n, _ := e.rdb.Exists(context.Background(), LinksKey(e.queue, id)).Result(); n != 0 {
			t.Errorf("headers %d: the garbage list was not taken", i)
		}
	}
}

// Promised (docs/otel.md): the list is "cut to the latest MaxLinks and kept
// LinkTTL after the last fold"; MaxLinks "links kept per task: the latest".
//
// Tried here: 10,000 concurrent folds into one task. The list must never hold
// more than MaxLinks entries nor live without a TTL, and the consumer span
// must carry at most MaxLinks links, with dedup.links saying how many.
func TestTenThousandFoldsStayBounded(t *testing.T) {
	const folds = 10000
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:many": {Fields: []string{"k"}, OnConflict: dedup.Replace}}})
	first, err, _ := e.submit(asynq.NewTask("ot:many", []byte(`{"k":1,"n":0}`)), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	key := LinksKey(e.queue, first.TaskID)
	ctx := context.Background()
	var next, okN atomic.Int64
	var wg sync.WaitGroup
	var maxLen atomic.Int64
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > folds {
					return
				}
				res, err := e.client.Submit(ctx, asynq.NewTask("ot:many", fmt.Appendf(nil, `{"k":1,"n":%d}`, i)), asynq.Queue(e.queue))
				if err == nil && res.TaskID == first.TaskID {
					okN.Add(1)
				}
				if i%500 == 0 {
					n, _ := e.rdb.LLen(ctx, key).Result()
					if n > maxLen.Load() {
						maxLen.Store(n)
					}
				}
			}
		}()
	}
	wg.Wait()
	if okN.Load() < folds/2 {
		t.Fatalf("only %d of %d calls were folded", okN.Load(), folds)
	}
	n, _ := e.rdb.LLen(ctx, key).Result()
	ttl, _ := e.rdb.PTTL(ctx, key).Result()
	if n > DefaultMaxLinks || maxLen.Load() > DefaultMaxLinks {
		t.Errorf("links list holds %d (at most %d seen), want at most %d", n, maxLen.Load(), DefaultMaxLinks)
	}
	if ttl <= 0 || ttl > DefaultLinkTTL {
		t.Errorf("links list TTL %v, want within (0, %v]", ttl, DefaultLinkTTL)
	}
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	if err := e.insp.RunTask(e.queue, first.TaskID); err != nil {
		t.Fatal(err)
	}
	cons := e.consumer(first.TaskID)
	if l := len(cons.Links()); l == 0 || l > DefaultMaxLinks || attr(cons, "dedup.links").AsInt64() != int64(l) {
		t.Errorf("consumer span: %d links, dedup.links=%s; want 1..%d and equal", l, attr(cons, "dedup.links").Emit(), DefaultMaxLinks)
	}
}

// Promised (docs/otel.md, Headers; headers.go): the producer's context goes
// into the task the call creates "on the NewClient direct path, through
// WrapClient's enqueuer, and for a call that is not deduplicated; the
// task's own headers and asynq.NewTask options are kept"; "A call folded
// into another task ... changes no headers".
//
// Tried here: through WrapClient (and the direct path, and dedup.Skip), a task
// made with NewTaskWithHeaders carrying its own header and NewTask options
// (Queue, MaxRetry, Timeout, Retention); then a call folded into it with
// its own hostile header.
func TestHeadersKeepTaskOptionsAndSkipFolds(t *testing.T) {
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:hdr": {Fields: []string{"k"}, OnConflict: dedup.Replace}}})
	wrapped := NewClient(e.d, e.d.WrapClient(asynq.NewClientFromRedisClient(e.rdb)), e.opts)
	ctx := context.Background()
	for name, c := range map[string]*Client{"wrap": wrapped, "direct": e.client} {
		for _, skip := range []bool{false, true} {
			k := fmt.Sprintf(`{"k":"%s-%v"}`, name, skip)
			task := asynq.NewTaskWithHeaders("ot:hdr", []byte(k), map[string]string{"x-tenant": "acme"},
				asynq.Queue(e.queue), asynq.MaxRetry(3), asynq.Timeout(7*time.Minute), asynq.Retention(time.Hour))
			opts := []asynq.Option{asynq.ProcessIn(time.Hour)}
			if skip {
				opts = append(opts, dedup.Skip())
			}
			res, err := c.Submit(ctx, task, opts...)
			if err != nil || res.Outcome != dedup.Created {
				t.Fatalf("%s skip=%v: %+v, %v", name, skip, res, err)
			}
			prod := e.sr.Ended()[len(e.sr.Ended())-1]
			carrier := propagation.MapCarrier{}
			propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(ctx, prod.SpanContext()), carrier)
			info, err := e.insp.GetTaskInfo(e.queue, res.TaskID)
			if err != nil {
				t.Fatalf("%s skip=%v: task not in queue %s: %v", name, skip, e.queue, err)
			}
			if info.MaxRetry != 3 || info.Timeout != 7*time.Minute || info.Retention != time.Hour {
				t.Errorf("%s skip=%v: NewTask options lost: MaxRetry %d Timeout %v Retention %v", name, skip, info.MaxRetry, info.Timeout, info.Retention)
			}
			if info.Headers["x-tenant"] != "acme" || info.Headers["traceparent"] != carrier.Get("traceparent") {
				t.Errorf("%s skip=%v: headers %v, want x-tenant and the producer's traceparent %s", name, skip, info.Headers, carrier.Get("traceparent"))
			}
			if skip {
				continue
			}
			before := info.Headers["traceparent"]
			folded := asynq.NewTaskWithHeaders("ot:hdr", []byte(k), map[string]string{"x-tenant": "evil", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, asynq.Queue(e.queue))
			fres, err := c.Submit(ctx, folded)
			if err != nil || fres.Outcome != dedup.Replaced || fres.TaskID != res.TaskID {
				t.Fatalf("%s fold: %+v, %v", name, fres, err)
			}
			info, _ = e.insp.GetTaskInfo(e.queue, res.TaskID)
			if info.Headers["traceparent"] != before || info.Headers["x-tenant"] != "acme" {
				t.Errorf("%s: a folded call changed the task's headers to %v", name, info.Headers)
			}
		}
	}
}

// Promised (docs/otel.md): dedup.outcome is attempt.Outcome: "held
// (for the retry)", "released", "busy_folded"; dedup.attempt is "asynq's
// retry count: 0 on the first attempt"; "A busy arrival folded into the
// key's task (BusyFold) records its own consumer span for that task in the
// same way" (as a link); a busy retry is "not errors".
//
// Tried here: a task that fails once then succeeds; a task arriving from
// asynq's own client that meets its key held (BusyFold), then the holder
// runs.
func TestConsumerSpanOutcomeIsTheAttemptsOutcome(t *testing.T) {
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{
		"ot:retry": {Fields: []string{"k"}},
		"ot:bfold": {Fields: []string{"k"}, OnBusy: dedup.BusyFold},
	}})
	e.serveRetryingFast(func(ctx context.Context, tk *asynq.Task) error {
		if n, _ := asynq.GetRetryCount(ctx); tk.Type() == "ot:retry" && n == 0 {
			return errors.New("first attempt fails")
		}
		return nil
	})
	res, err, _ := e.submit(asynq.NewTask("ot:retry", []byte(`{"k":1}`)))
	if err != nil {
		t.Fatal(err)
	}
	spans := e.consumerSpans(res.TaskID, 2)
	for i, want := range []struct{ outcome, attempt string }{{"held", "0"}, {"released", "1"}} {
		if got := attr(spans[i], "dedup.outcome").AsString(); got != want.outcome || attr(spans[i], "dedup.attempt").Emit() != want.attempt {
			t.Errorf("attempt %d: outcome %q attempt %s, want %s %s", i, got, attr(spans[i], "dedup.attempt").Emit(), want.outcome, want.attempt)
		}
	}
	if spans[0].Status().Code == 0 || attr(spans[0], "error.type").AsString() != "*errors.errorString" {
		t.Errorf("failed attempt: status %v error.type %q", spans[0].Status(), attr(spans[0], "error.type").AsString())
	}

	holder, err, _ := e.submit(asynq.NewTask("ot:bfold", []byte(`{"k":1}`)), asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	arrival, err := asynq.NewClientFromRedisClient(e.rdb).Enqueue(asynq.NewTask("ot:bfold", []byte(`{"k":1,"n":2}`)), asynq.Queue(e.queue))
	if err != nil {
		t.Fatal(err)
	}
	arr := e.consumer(arrival.ID)
	if attr(arr, "dedup.outcome").AsString() != "busy_folded" || attr(arr, "dedup.holder.task_id").AsString() != holder.TaskID || arr.Status().Code != 0 {
		t.Errorf("busy arrival: outcome %q holder %q status %v", attr(arr, "dedup.outcome").AsString(), attr(arr, "dedup.holder.task_id").AsString(), arr.Status())
	}
	if err := e.insp.RunTask(e.queue, holder.TaskID); err != nil {
		t.Fatal(err)
	}
	h := e.consumer(holder.TaskID)
	if got := linkedTo(h); len(got) != 1 || got[0].SpanID() != arr.SpanContext().SpanID() {
		t.Errorf("holder's span links %v, want the busy arrival's span %v", got, arr.SpanContext().SpanID())
	}
}

// Promised (docs/otel.md): dedup.decision "fail_open (created without a
// lock, Redis down)"; dedup.outcome "fail_open"; "dedup.link.recorded:
// false when a fold's link could not be written or read".
//
// Tried here: the Dedup's Redis (and the links' Redis) dies; asynq's Redis
// stays up. Config.FailOpen: the producer enqueues through WrapClient
// without a lock, the attempt runs without one.
func TestFailOpenIsRecordedWithRedisDown(t *testing.T) {
	proc, own := redistest.Own(t, nil)
	shared := redistest.Client(t)
	name := redistest.Uniq(t)
	d, err := dedup.New(context.Background(), own, dedup.Config{Prefix: "dd-" + name, Logger: redistest.QuietLogger(), FailOpen: true,
		Rules: map[string]dedup.Rule{"ot:fo": {Fields: []string{"k"}}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	sr := tracetest.NewSpanRecorder()
	opts := Options{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr)), Propagator: propagation.TraceContext{}, Redis: own}
	e := &env{t: t, rdb: shared, d: d, queue: "q-" + name, sr: sr, opts: opts,
		client: NewClient(d, d.WrapClient(asynq.NewClientFromRedisClient(shared)), opts), insp: asynq.NewInspectorFromRedisClient(shared)}
	proc.Kill()
	res, err, prod := e.submit(asynq.NewTask("ot:fo", []byte(`{"k":1}`)))
	if err != nil || !res.FailOpen {
		t.Fatalf("fail-open call: %+v, %v", res, err)
	}
	if got := attr(prod, "dedup.decision").AsString(); got != "fail_open" {
		t.Errorf("producer decision %q, want fail_open", got)
	}
	e.serve(func(context.Context, *asynq.Task) error { return nil })
	cons := e.consumer(res.TaskID)
	if got := attr(cons, "dedup.outcome").AsString(); got != "fail_open" {
		t.Errorf("consumer outcome %q, want fail_open", got)
	}
	if cons.Parent().SpanID() != prod.SpanContext().SpanID() {
		t.Errorf("fail-open consumer span is not the producer's child")
	}
	if attr(cons, "dedup.link.recorded").Emit() != "false" {
		t.Errorf("links could not be read, yet dedup.link.recorded=%q", attr(cons, "dedup.link.recorded").Emit())
	}
}

// Promised (docs/otel.md): the producer span is "send <queue>" with
// messaging.destination.name = the queue; client.go queueOf: "the task's,
// else the one its lock named, else the one the call or asynq.NewTask
// named, else \"default\"". Error texts are not recorded.
//
// Tried here: the queue is given only as an asynq.NewTask option (which dedup
// honours), and the call fails: a MergeFunc whose error quotes both
// payloads, and a payload the key's field cannot be read from.
func TestFailedCallNamesTheTasksQueue(t *testing.T) {
	const secret = "MERGE-SECRET-c0ffee"
	e := newEnv(t, dedup.Config{Rules: map[string]dedup.Rule{"ot:merr": {Fields: []string{"k"}, OnConflict: dedup.Merge,
		MergeFunc: func(old, new []byte) ([]byte, error) { return nil, fmt.Errorf("cannot merge %s into %s", new, old) }}}})
	ctx := context.Background()
	first, err := e.client.Submit(ctx, asynq.NewTask("ot:merr", []byte(`{"k":1,"s":"`+secret+`"}`), asynq.Queue(e.queue)), asynq.ProcessIn(time.Hour))
	if err != nil || first.Info == nil || first.Info.Queue != e.queue {
		t.Fatalf("first: %+v, %v", first, err)
	}
	for name, payload := range map[string]string{"merge error": `{"k":1,"s":"` + secret + `"}`, "bad payload": secret} {
		_, err := e.client.Submit(ctx, asynq.NewTask("ot:merr", []byte(payload), asynq.Queue(e.queue)))
		if err == nil {
			t.Fatalf("%s: no error", name)
		}
		prod := e.sr.Ended()[len(e.sr.Ended())-1]
		if prod.Name() != "send "+e.queue || attr(prod, "messaging.destination.name").AsString() != e.queue {
			t.Errorf("%s (%v): span %q destination %q, want the task's queue %s", name, err, prod.Name(), attr(prod, "messaging.destination.name").AsString(), e.queue)
		}
	}
	noSecretInSpans(t, e.sr, secret)
}
