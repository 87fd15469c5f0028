package dedupotel

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// TestCreatedTaskContinuesTrace: a created task carries the producer's
// traceparent, and its consumer span is the producer span's child, with the
// attempt's outcome and the lock's hash.
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
	for key, want := range map[string]string{"dedup.outcome": "released", "dedup.key.hash": res.Fingerprint, "dedup.attempt": "0",
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
