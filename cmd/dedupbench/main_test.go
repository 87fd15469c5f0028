package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestHistQuantiles(t *testing.T) {
	h := new(hist)
	for i := 1; i <= 10000; i++ {
		h.record(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 5 * time.Millisecond}, {0.99, 9900 * time.Microsecond}, {1, 10 * time.Millisecond}} {
		got := h.quantile(c.q)
		if d := float64(got-c.want) / float64(c.want); d < -0.035 || d > 0.035 {
			t.Errorf("quantile(%v) = %v, want %v ±3.5%%", c.q, got, c.want)
		}
	}
	for i := range histBuckets {
		low, w := bucketRange(i)
		if bucketOf(low) != i || bucketOf(low+w-1) != i {
			t.Fatalf("bucket %d: range [%d, %d) does not map back", i, low, low+w)
		}
	}
}

func TestPayload(t *testing.T) {
	for _, user := range []int64{0, 7, 123456789012} {
		p := payload(200, user, traceOf(user))
		if len(p) != 200 {
			t.Fatalf("payload is %d bytes, want 200: %s", len(p), p)
		}
		var v struct {
			UserID  int64  `json:"user_id"`
			TraceID string `json:"trace_id"`
		}
		if err := json.Unmarshal(p, &v); err != nil || v.UserID != user || len(v.TraceID) != 16 {
			t.Fatalf("payload %s: %+v, %v", p, v, err)
		}
	}
}

func needRedisServer(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("DEDUP_REQUIRE_REDIS") != "" {
			t.Fatal("redis-server not installed but DEDUP_REQUIRE_REDIS is set")
		}
		t.Skip("redis-server not installed (apt-get install redis-server)")
	}
}

// TestSmoke runs every case and the end-to-end comparison, tiny.
func TestSmoke(t *testing.T) {
	needRedisServer(t)
	var out, errOut bytes.Buffer
	cfg, err := parseFlags([]string{"-duration", "100ms", "-rounds", "1", "-warmup", "0", "-c", "1,4", "-keys", "50",
		"-e2e-tasks", "300", "-e2e-keys", "30", "-e2e-workers", "8", "-e2e-producers", "8", "-drain-tasks", "200", "-drain-workers", "8",
		"-batch-size", "50", "-batch-runs", "2", "-q"}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	if code := run(context.Background(), cfg); code != 0 {
		t.Fatalf("exit status %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"plain Enqueue", "asynq.Unique dup", "dedup accepted", "dedup rejected", "dedup replaced",
		"c=4", "enqueued before workers start", "server already running", "dedup Replace", "→",
		"worker side: 200 unique tasks", "middleware, guard", "middleware, Cooldown", "2 calls of 50 tasks", "EnqueueBatch"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "warning") || strings.Contains(out.String(), "UNEXPECTED") {
		t.Errorf("output:\n%s", out.String())
	}
}

// TestSmokeJSON checks the machine output and the commands per call.
// (-ctx-timeouts: the library then sends its calls through the shared
// client, whose commands the report counts per call.)
func TestSmokeJSON(t *testing.T) {
	needRedisServer(t)
	var out, errOut bytes.Buffer
	cfg, err := parseFlags([]string{"-duration", "100ms", "-rounds", "2", "-warmup", "50ms", "-c", "2", "-keys", "20",
		"-cases", "plain,accepted,rejected,replaced", "-ctx-timeouts", "-json", "-q"}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	if code := run(context.Background(), cfg); code != 0 {
		t.Fatalf("exit status %d\nstderr:\n%s", code, errOut.String())
	}
	var rep report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if len(rep.Throughput) != 4 || rep.E2E != nil || rep.Errors != 0 || rep.Meta.KeysLeft != 0 {
		t.Fatalf("report: %s", out.String())
	}
	// Round trips per call: the lock script alone, which also stores a new
	// task (Dedup.NewClient), plus one SADD per new queue, hence the slack.
	// A rejection of a lock stored with its task reads the owner's record: a
	// process's first one per key takes one round trip more, to learn the
	// owner's ID (20 keys, a fresh Dedup each of the 2 rounds).
	want := map[string]float64{"plain": 1, "accepted": 1, "rejected": 1, "replaced": 1}
	for _, s := range rep.Throughput {
		slack := 0.05
		if s.Case == "rejected" && s.Ops > 0 {
			slack += 20 * 2 / float64(s.Ops)
		}
		if s.Ops == 0 || s.CmdsPerOp < want[s.Case] || s.CmdsPerOp > want[s.Case]+slack || s.Ratio == nil {
			t.Errorf("%s: %d ops, %.3f cmds/op (want %v), ratio %v", s.Case, s.Ops, s.CmdsPerOp, want[s.Case], s.Ratio)
		}
		// Every round has a CPU reading here; plain over itself is 1.
		if s.RCPURatio == nil || len(s.RCPURatioRounds) != 2 || *s.RCPURatio <= 0 || (s.Case == "plain" && *s.RCPURatio != 1) {
			t.Errorf("%s: redis CPU ratio %v, rounds %v", s.Case, deref(s.RCPURatio), s.RCPURatioRounds)
		}
	}
	if !strings.Contains(out.String(), `"redis_cpu_ratio":`) {
		t.Errorf("JSON lacks redis_cpu_ratio:\n%s", out.String())
	}
}

// TestSmokeDrain checks the worker side's machine output: every variant
// drains every task, with a ratio to the plain server's and counts per task.
func TestSmokeDrain(t *testing.T) {
	needRedisServer(t)
	var out, errOut bytes.Buffer
	cfg, err := parseFlags([]string{"-rounds", "2", "-warmup", "0", "-cases", "drain", "-drain-tasks", "300", "-drain-workers", "16",
		"-drain-work", "1ms", "-json", "-q"}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	if code := run(context.Background(), cfg); code != 0 {
		t.Fatalf("exit status %d\nstderr:\n%s", code, errOut.String())
	}
	var rep report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if len(rep.Drain) != len(drainVariants) || rep.Errors != 0 || rep.Meta.KeysLeft != 0 || rep.DrainConfig == nil || rep.DrainConfig.Tasks != 300 {
		t.Fatalf("report: %s", out.String())
	}
	for _, s := range rep.Drain {
		// asynq's own scripts: at least a dequeue and a done per task.
		if s.Ratio == nil || len(s.RatioRounds) != 2 || s.TasksPerSec <= 0 || s.ScriptsPerTask < 2 || s.RttsPerTask <= 0 {
			t.Errorf("%s: %s", s.Title, out.String())
		}
		if s.Variant == "plain" && *s.Ratio != 1 {
			t.Errorf("plain: ratio %v to itself", *s.Ratio)
		}
	}
}

// TestSmokeBatch checks the batch case's machine output: both variants
// create every task, the batch in one round trip per call, the Submits in
// one each, with the batch's ratios to the Submits'. (-ctx-timeouts: as in
// TestSmokeJSON, so that the shared client counts the round trips.)
func TestSmokeBatch(t *testing.T) {
	needRedisServer(t)
	var out, errOut bytes.Buffer
	cfg, err := parseFlags([]string{"-rounds", "2", "-warmup", "0", "-cases", "batch", "-batch-size", "100", "-batch-runs", "3",
		"-ctx-timeouts", "-json", "-q"}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	if code := run(context.Background(), cfg); code != 0 {
		t.Fatalf("exit status %d\nstderr:\n%s", code, errOut.String())
	}
	var rep report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if len(rep.Batch) != 2 || rep.Errors != 0 || rep.Meta.KeysLeft != 0 || rep.BatchConfig == nil || rep.BatchConfig.Size != 100 {
		t.Fatalf("report: %s", out.String())
	}
	// Round trips per task: one per call (a new pooled connection's set-up
	// adds its own, hence the slack).
	want := map[string]float64{"sequential": 1, "batch": 1.0 / 100}
	for _, s := range rep.Batch {
		if rtt := want[s.Variant]; s.Ratio == nil || len(s.RatioRounds) != 2 || s.RCPURatio == nil || s.TasksPerSec <= 0 || s.RttsPerTask < rtt || s.RttsPerTask > 2*rtt {
			t.Errorf("%s: %s", s.Title, out.String())
		}
		if s.Variant == "sequential" && (*s.Ratio != 1 || *s.RCPURatio != 1) {
			t.Errorf("sequential: ratios %v, %v to itself", *s.Ratio, *s.RCPURatio)
		}
	}
}

func deref(p *float64) any {
	if p == nil {
		return nil
	}
	return *p
}

// fakeRun is a timed run of one second with ops calls that cost Redis
// rcpu, or whose CPU reading failed when rcpu < 0.
func fakeRun(ops int64, rcpu time.Duration) *runResult {
	r := &runResult{ops: ops, elapsed: time.Second, h: new(hist), rcpu: rcpu, rcpuOK: rcpu >= 0}
	if rcpu < 0 {
		r.rcpu = 0 // as measure leaves it
	}
	return r
}

// TestRedisCPURatio: per round, Redis CPU per call over plain Enqueue's in
// that round; a round whose reading failed on either side is left out
// rather than counted as 0 or +Inf.
func TestRedisCPURatio(t *testing.T) {
	ms := time.Millisecond
	var plainCase, accepted *caseDef
	for _, cd := range allCases {
		switch cd.name {
		case "plain":
			plainCase = cd
		case "accepted":
			accepted = cd
		}
	}
	runs := map[int]map[string][]*runResult{1: {
		// 10 µs per call, but round 3's reading failed.
		"plain": {fakeRun(1000, 10*ms), fakeRun(1000, 10*ms), fakeRun(1000, -1), fakeRun(1000, 10*ms), fakeRun(1000, 10*ms)},
		// 20, 15, (plain failed), 30 µs per call, then its own reading failed.
		"accepted": {fakeRun(500, 10*ms), fakeRun(1000, 15*ms), fakeRun(1000, 12*ms), fakeRun(1000, 30*ms), fakeRun(1000, -1)},
	}}
	cfg := config{conc: []int{1}, duration: time.Second}
	rep := &report{Meta: meta{Rounds: 5}}
	rep.summarize(cfg, []*caseDef{plainCase, accepted}, &allRuns{throughput: runs})
	if len(rep.Throughput) != 2 {
		t.Fatalf("%d summaries", len(rep.Throughput))
	}
	near := func(p *float64, want float64) bool { return p != nil && math.Abs(*p-want) < 1e-9 }
	p, a := rep.Throughput[0], rep.Throughput[1]
	if !near(p.RCPURatio, 1) || len(p.RCPURatioRounds) != 4 {
		t.Errorf("plain: ratio %v, rounds %v", deref(p.RCPURatio), p.RCPURatioRounds)
	}
	if !near(a.RCPURatio, 2) || !near(a.RCPURatioMin, 1.5) || !near(a.RCPURatioMax, 3) || len(a.RCPURatioRounds) != 3 {
		t.Errorf("accepted: ratio %v (%v–%v), rounds %v", deref(a.RCPURatio), deref(a.RCPURatioMin), deref(a.RCPURatioMax), a.RCPURatioRounds)
	}
	// The throughput ratio still counts every round.
	if !near(a.Ratio, 1) || !near(a.RatioMin, 0.5) || len(a.RatioRounds) != 5 {
		t.Errorf("accepted: throughput ratio %v (min %v), rounds %v", deref(a.Ratio), deref(a.RatioMin), a.RatioRounds)
	}

	js, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var back struct {
		Throughput []map[string]any `json:"throughput"`
	}
	if err := json.Unmarshal(js, &back); err != nil {
		t.Fatal(err)
	}
	for f, want := range map[string]float64{"redis_cpu_ratio": 2, "redis_cpu_ratio_min": 1.5, "redis_cpu_ratio_max": 3} {
		if got, ok := back.Throughput[1][f].(float64); !ok || math.Abs(got-want) > 1e-9 {
			t.Errorf("JSON %s = %v, want %v:\n%s", f, back.Throughput[1][f], want, js)
		}
	}
	if rs, ok := back.Throughput[1]["redis_cpu_ratio_rounds"].([]any); !ok || len(rs) != 3 {
		t.Errorf("JSON redis_cpu_ratio_rounds = %v", back.Throughput[1]["redis_cpu_ratio_rounds"])
	}

	var out bytes.Buffer
	rep.writeTable(&out, cfg)
	for _, want := range []string{"rds ratio  (range)", "rds ratio: Redis main-thread CPU per call", "2.00  (1.50–3.00)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

func TestParseCPU(t *testing.T) {
	for _, c := range []struct {
		info string
		want time.Duration
		ok   bool
	}{
		{"# CPU\r\nused_cpu_sys:1.5\r\nused_cpu_user:2.5\r\nused_cpu_sys_main_thread:0.25\r\nused_cpu_user_main_thread:0.5\r\n", 750 * time.Millisecond, true},
		{"# CPU\r\nused_cpu_sys:1.5\r\nused_cpu_user:2.5\r\n", 4 * time.Second, true}, // before Redis 6.2: the whole process
		{"# CPU\r\n", 0, false},
	} {
		got, err := parseCPU(c.info)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseCPU(%q) = %v, %v; want %v (ok %v)", c.info, got, err, c.want, c.ok)
		}
	}
}

func TestFlags(t *testing.T) {
	var out bytes.Buffer
	for _, args := range [][]string{{"-cases", "nope"}, {"-c", "0"}, {"-rounds", "0"}, {"-e2e-mode", "sometimes"}, {"extra"}} {
		if _, err := parseFlags(args, &out, &out); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
	cfg, err := parseFlags([]string{"-cases", "e2e,plain", "-c", "64,1,64"}, &out, &out)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(cfg.cases, ",") != "plain,e2e" || len(cfg.conc) != 2 {
		t.Errorf("cases %v, conc %v", cfg.cases, cfg.conc)
	}
}
