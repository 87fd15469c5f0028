package dedupprom_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup"
	dedupprom "github.com/asynq-dedup/dedup/dedupprom"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// newDedup returns a Dedup and a wrapped client on a fresh miniredis.
func newDedup(t *testing.T) (*dedup.Dedup, *dedup.Client) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	d, err := dedup.New(context.Background(), rdb, dedup.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	ac := asynq.NewClientFromRedisClient(rdb)
	return d, d.WrapClient(ac)
}

// exposition renders the expected text format: every event of every type,
// zero unless want says otherwise, labels in the order Prometheus sorts
// them.
func exposition(name string, types []string, want map[string]uint64, constLabels prometheus.Labels) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# HELP %s Deduplication events of this process by task type (asynq-dedup); see dedup.Stats for their meaning.\n# TYPE %s counter\n", name, name)
	var lines []string
	for _, typ := range types {
		for ev := range (dedup.Stats{}).Map() {
			labels := []string{fmt.Sprintf("event=%q", ev), fmt.Sprintf("type=%q", typ)}
			for k, v := range constLabels {
				labels = append(labels, fmt.Sprintf("%s=%q", k, v))
			}
			sort.Strings(labels)
			lines = append(lines, fmt.Sprintf("%s{%s} %d", name, strings.Join(labels, ","), want[typ+"/"+ev]))
		}
	}
	sort.Strings(lines)
	b.WriteString(strings.Join(lines, "\n") + "\n")
	return b.String()
}

func TestCollector(t *testing.T) {
	d, c := newDedup(t)
	col := dedupprom.NewCollector(d)
	if n := testutil.CollectAndCount(col); n != 0 {
		t.Fatalf("%d metrics before any event", n)
	}
	for i := range 3 {
		if _, err := c.Enqueue(asynq.NewTask("mail", []byte("same")), asynq.Queue("q")); err != nil && i == 0 {
			t.Fatal(err)
		} else if i > 0 && !errors.Is(err, dedup.ErrDuplicateTask) {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	if _, err := c.Enqueue(asynq.NewTask("report", []byte("r")), asynq.Queue("q")); err != nil {
		t.Fatal(err)
	}
	want := map[string]uint64{"mail/locked": 1, "mail/duplicate": 2, "report/locked": 1}
	exp := exposition("dedup_events_total", []string{"mail", "report"}, want, nil)
	if err := testutil.CollectAndCompare(col, strings.NewReader(exp), dedupprom.MetricName); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(col); n != 2*len((dedup.Stats{}).Map()) {
		t.Fatalf("%d metrics", n)
	}
	if problems, err := testutil.CollectAndLint(col); err != nil || len(problems) != 0 {
		t.Fatalf("lint: %v %+v", err, problems)
	}
}

// Two Dedups in one registry need telling apart.
func TestCollectorConstLabelsAndNamespace(t *testing.T) {
	d1, c1 := newDedup(t)
	d2, _ := newDedup(t)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(dedupprom.NewCollector(d1, dedupprom.WithNamespace("app"), dedupprom.WithConstLabels(prometheus.Labels{"instance_name": "a"})))
	reg.MustRegister(dedupprom.NewCollector(d2, dedupprom.WithNamespace("app"), dedupprom.WithConstLabels(prometheus.Labels{"instance_name": "b"})))
	if err := reg.Register(dedupprom.NewCollector(d2, dedupprom.WithNamespace("app"), dedupprom.WithConstLabels(prometheus.Labels{"instance_name": "b"}))); err == nil {
		t.Fatal("registered the same collector twice")
	}
	if _, err := c1.Enqueue(asynq.NewTask("mail", nil), asynq.Queue("q")); err != nil {
		t.Fatal(err)
	}
	exp := exposition("app_dedup_events_total", []string{"mail"}, map[string]uint64{"mail/locked": 1}, prometheus.Labels{"instance_name": "a"})
	if err := testutil.GatherAndCompare(reg, strings.NewReader(exp), "app_dedup_events_total"); err != nil {
		t.Fatal(err)
	}
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer.func2"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).ServeConn.func1"))
}
