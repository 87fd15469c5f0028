package dedupotel

import (
	"context"
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestMetricsExportEventCounts: the counter has a point per type and
// event name (the keys of dedup.Stats.Map), each equal to Dedup.StatsByType's count,
// cumulative and monotonic.
func TestMetricsExportEventCounts(t *testing.T) {
	e := newEnv(t, dedup.Config{})
	reader := sdkmetric.NewManualReader()
	reg, err := RegisterMetrics(e.d, sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reg.Unregister() }()
	for _, p := range []string{`{"a":1}`, `{"a":2}`, `{"a":1}`} {
		_, err, _ := e.submit(asynq.NewTask("ot:m", []byte(p)), asynq.ProcessIn(time.Hour))
		if err != nil && !errors.Is(err, dedup.ErrDuplicateTask) {
			t.Fatal(err)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != MetricName {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok || !sum.IsMonotonic || sum.Temporality != metricdata.CumulativeTemporality {
				t.Fatalf("%s is %T %+v, want a cumulative monotonic int64 sum", MetricName, m.Data, m.Data)
			}
			for _, dp := range sum.DataPoints {
				typ, _ := dp.Attributes.Value(AttrMetricType)
				ev, _ := dp.Attributes.Value(AttrMetricEvent)
				if typ.AsString() == "ot:m" {
					got[ev.AsString()] = dp.Value
				}
			}
		}
	}
	want := e.d.StatsByType()["ot:m"].Map()
	if names := slices.Sorted(maps.Keys(got)); !slices.Equal(names, slices.Sorted(maps.Keys((dedup.Stats{}).Map()))) {
		t.Fatalf("events %v, want %v", names, maps.Keys((dedup.Stats{}).Map()))
	}
	for ev, n := range want {
		if got[ev] != int64(n) {
			t.Errorf("%s = %d, want %d", ev, got[ev], n)
		}
	}
	if got["locked"] != 2 || got["duplicate"] != 1 {
		t.Errorf("locked %d duplicate %d, want 2 and 1", got["locked"], got["duplicate"])
	}
}
