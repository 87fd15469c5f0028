package dedupotel

import (
	"context"

	"github.com/asynq-dedup/dedup"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// MetricName is the observable counter RegisterMetrics registers. Through
// OpenTelemetry's Prometheus exporter it becomes dedup_events_total with
// the labels type and event: the series package dedupprom exports.
const MetricName = "dedup.events"

// Attribute keys of the counter's points, named as dedupprom's labels.
const (
	// AttrMetricType is the task type.
	AttrMetricType = attribute.Key("type")
	// AttrMetricEvent is the event, one of the keys of dedup.Stats.Map.
	AttrMetricEvent = attribute.Key("event")
)

// RegisterMetrics registers, with a meter of mp, an observable counter of
// d's events for this process (Dedup.StatsByType), one point per task type
// and event name (the keys of dedup.Stats.Map), read at each collection. mp nil means
// otel.GetMeterProvider(). Unregister the returned registration before
// closing d if the meter provider outlives it.
func RegisterMetrics(d *dedup.Dedup, mp metric.MeterProvider) (metric.Registration, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	counter, err := meter.Int64ObservableCounter(MetricName,
		metric.WithDescription("Deduplication events of this process by task type (asynq-dedup); see dedup.Stats for their meaning."),
		metric.WithUnit("{event}"))
	if err != nil {
		return nil, err
	}
	return meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for typ, s := range d.StatsByType() {
			for event, n := range s.Map() {
				o.ObserveInt64(counter, int64(n), metric.WithAttributes(AttrMetricType.String(typ), AttrMetricEvent.String(event)))
			}
		}
		return nil
	}, counter)
}
