package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// The tests run the service in-process on a free loopback port and drive it
// over HTTP, against the redis-server TestMain starts (internal/redistest),
// or a miniredis of their own where redis-server is not installed. On the
// redis-server, which this test binary started for itself, each test takes
// the next of databases 1-15 and flushes it, so what a test left behind (a
// cooling key, say) never meets another.
func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "service")) }

var tests atomic.Int32 // tests started, for the next database

// svc is a running service and what a test drives it with.
type svc struct {
	t    *testing.T
	base string           // http://127.0.0.1:port
	insp *asynq.Inspector // pauses the queue: nothing runs while a test sets up
	logs *syncBuffer
	stop func() // cancels run and checks that it shut down cleanly
}

// start runs the service on a Redis database of its own; see startOn.
func start(t *testing.T, tweak func(*options)) *svc {
	t.Helper()
	return startOn(t, newDB(t), tweak)
}

// newDB returns the URL of an empty database: the next of the
// redis-server's, flushed, or a miniredis of the test's own.
func newDB(t *testing.T) string {
	t.Helper()
	redisAddr, db := redistest.Addr(), 0
	if redisAddr != "" {
		db = 1 + int(tests.Add(1)-1)%15
	} else {
		redisAddr = miniredis.RunT(t).Addr()
	}
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr, DB: db})
	defer rdb.Close()
	if err := rdb.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("redis://%s/%d", redisAddr, db)
}

// startOn runs the service on the Redis at redisURL with test-sized
// options, adjusted by tweak, and waits until it answers /metrics (its
// Scheduler runs by then). The cleanup stops it and fails the test if run
// returned an error or anything was logged at WARN or above.
func startOn(t *testing.T, redisURL string, tweak func(*options)) *svc {
	t.Helper()
	addr, err := redistest.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	s := &svc{t: t, base: "http://" + addr, insp: asynq.NewInspectorFromRedisClient(rdb), logs: &syncBuffer{}}

	o := defaultOptions()
	o.Listen, o.RedisURL = addr, redisURL
	o.PollInterval, o.PurgeEvery = 20*time.Millisecond, "@yearly" // no purge during a test unless it asks
	o.Logger = slog.New(slog.NewTextHandler(s.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if tweak != nil {
		tweak(&o)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, o) }()
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			cancel()
			if err := redistest.WaitFor(t, done, "run to return"); err != nil {
				t.Errorf("run: %v", err)
			}
			http.DefaultClient.CloseIdleConnections()
			if bad := s.logs.warnings(); len(bad) > 0 {
				t.Errorf("logged at WARN or above:\n%s", strings.Join(bad, "\n"))
			}
			if t.Failed() {
				t.Logf("service log:\n%s", s.logs.String())
			}
		})
	}
	t.Cleanup(s.stop)
	redistest.Eventually(t, "the service answers /metrics", func() bool {
		select {
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("run returned before serving: %v", err)
		default:
		}
		resp, err := http.Get(s.base + "/metrics")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return s
}

// reply is an HTTP answer with its JSON body decoded.
type reply struct {
	status int
	header http.Header
	body   map[string]any
	raw    string
}

func (s *svc) do(method, path, body string) reply {
	s.t.Helper()
	req, err := http.NewRequest(method, s.base+path, strings.NewReader(body))
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	r := reply{status: resp.StatusCode, header: resp.Header, raw: string(raw)}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		if err := json.Unmarshal(raw, &r.body); err != nil {
			s.t.Fatalf("%s %s: body %q: %v", method, path, raw, err)
		}
	}
	return r
}

// want fails the test unless r has the status.
func (r reply) want(t *testing.T, status int, what string) reply {
	t.Helper()
	if r.status != status {
		t.Fatalf("%s: status %d, want %d; body %s", what, r.status, status, r.raw)
	}
	return r
}

func (r reply) str(key string) string { s, _ := r.body[key].(string); return s }

// metric returns the value of the /metrics sample whose line starts with
// name{labels} (labels in Prometheus's order, by name), 0 when absent.
func (s *svc) metric(series string) float64 {
	s.t.Helper()
	for line := range strings.Lines(s.do("GET", "/metrics", "").want(s.t, http.StatusOK, "GET /metrics").raw) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				s.t.Fatalf("metric %s: %v", series, err)
			}
			return f
		}
	}
	return 0
}

// runs is how many tasks of type typ dedup's middleware saw run.
func (s *svc) runs(typ string) float64 {
	return s.metric(`dedup_events_total{event="processed",type="` + typ + `"}`)
}

// waitRuns polls /metrics until typ's tasks have run n times.
func (s *svc) waitRuns(typ string, n float64) {
	s.t.Helper()
	redistest.Eventually(s.t, typ+" ran", func() bool { return s.runs(typ) >= n })
	if got := s.runs(typ); got != n {
		s.t.Fatalf("%s ran %v times, want %v", typ, got, n)
	}
}

func (s *svc) pause() {
	if err := s.insp.PauseQueue("default"); err != nil {
		s.t.Fatal(err)
	}
}

func (s *svc) unpause() {
	if err := s.insp.UnpauseQueue("default"); err != nil {
		s.t.Fatal(err)
	}
}

// idle checks that the queue holds no task that could still run.
func (s *svc) idle() {
	s.t.Helper()
	q, err := s.insp.GetQueueInfo("default")
	if err != nil {
		s.t.Fatal(err)
	}
	if q.Pending+q.Scheduled+q.Active+q.Retry != 0 {
		s.t.Fatalf("queue not idle: %d pending, %d scheduled, %d active, %d retry", q.Pending, q.Scheduled, q.Active, q.Retry)
	}
}

func TestWelcomeDuplicateIsRefusedNamingItsHolder(t *testing.T) {
	s := start(t, nil)
	s.pause() // the first email must still wait when the second request comes
	first := s.do("POST", "/welcome?user=42", "").want(t, http.StatusAccepted, "first welcome")
	id := first.str("task_id")
	if id == "" || first.str("outcome") != "created" {
		t.Fatalf("first welcome: %s", first.raw)
	}
	dup := s.do("POST", "/welcome?user=42", "").want(t, http.StatusConflict, "second welcome for the user")
	if dup.str("holder") != id {
		t.Fatalf("holder %q, want the first task %q", dup.str("holder"), id)
	}
	other := s.do("POST", "/welcome?user=43", "").want(t, http.StatusAccepted, "welcome for another user")
	if other.str("task_id") == id {
		t.Fatalf("another user's welcome got the first user's task %s", id)
	}
}

func TestReportIsRefusedWhileQueuedAndThrottledAfterItRan(t *testing.T) {
	s := start(t, nil)
	s.pause()
	id := s.do("POST", "/report?tenant=7", "").want(t, http.StatusAccepted, "first report").str("task_id")
	if h := s.do("POST", "/report?tenant=7", "").want(t, http.StatusConflict, "report while queued").str("holder"); h != id {
		t.Fatalf("holder %q, want %q", h, id)
	}
	s.unpause()
	s.waitRuns(typeReport, 1)
	// The handler has returned; until dedup's middleware has marked the key
	// cooling the task still runs, and a request meets it as running (409).
	var r reply
	redistest.Eventually(t, "the report's key cools down", func() bool {
		r = s.do("POST", "/report?tenant=7", "")
		return r.status != http.StatusConflict
	})
	r.want(t, http.StatusTooManyRequests, "report after it ran")
	secs, err := strconv.Atoi(r.header.Get("Retry-After"))
	if err != nil || secs < 1 || secs > 3600 {
		t.Fatalf("Retry-After %q, want whole seconds in [1, 3600]", r.header.Get("Retry-After"))
	}
	if r.str("holder") != id {
		t.Fatalf("holder %q, want the report that ran, %q", r.str("holder"), id)
	}
	s.do("POST", "/report?tenant=8", "").want(t, http.StatusAccepted, "another tenant's report")
}

func TestProfileUpdatesWhileQueuedRunOnceWithTheLast(t *testing.T) {
	s := start(t, nil)
	s.pause() // "while nothing runs"
	bodies := []string{`{"name":"A"}`, `{"name":"Ad"}`, `{"name":"Ada","v":3}`}
	var id string
	for i, b := range bodies {
		r := s.do("PUT", "/profile/42", b).want(t, http.StatusAccepted, "PUT profile")
		want := map[bool]string{true: "created", false: "replaced"}[i == 0]
		if r.str("outcome") != want || r.body["folded"] != (i > 0) || (i > 0 && r.str("task_id") != id) {
			t.Fatalf("PUT %d: %s, want outcome %s into task %s", i+1, r.raw, want, id)
		}
		id = r.str("task_id")
	}
	s.do("GET", "/profile/42/synced", "").want(t, http.StatusNotFound, "synced profile before the sync")
	s.unpause()
	s.waitRuns(typeProfile, 1)
	got := s.do("GET", "/profile/42/synced", "").want(t, http.StatusOK, "synced profile")
	if got.str("name") != "Ada" || got.body["v"] != 3.0 {
		t.Fatalf("synced profile %s, want the last PUT %s", got.raw, bodies[2])
	}
	s.idle()
}

func TestReindexBurstRunsOnce(t *testing.T) {
	s := start(t, nil)
	var id string
	for i := range 5 {
		r := s.do("POST", "/reindex?user=42", "").want(t, http.StatusAccepted, "POST reindex")
		if folded := r.body["folded"] == true; folded != (i > 0) || (i > 0 && r.str("task_id") != id) {
			t.Fatalf("reindex %d: %s; want folded=%v into task %s", i+1, r.raw, i > 0, id)
		}
		id = r.str("task_id")
	}
	if n := s.runs(typeReindex); n != 0 {
		t.Fatalf("reindex ran %v times during the burst", n)
	}
	s.waitRuns(typeReindex, 1)
	s.idle()
	if n := s.runs(typeReindex); n != 1 {
		t.Fatalf("reindex ran %v times, want 1", n)
	}
}

func TestMetricsServeDedupCounters(t *testing.T) {
	s := start(t, nil)
	s.pause()
	s.do("POST", "/welcome?user=1", "").want(t, http.StatusAccepted, "welcome")
	s.do("POST", "/welcome?user=1", "").want(t, http.StatusConflict, "duplicate welcome")
	for _, series := range []string{
		`dedup_events_total{event="locked",type="email:welcome"}`,
		`dedup_events_total{event="duplicate",type="email:welcome"}`,
	} {
		if v := s.metric(series); v != 1 {
			t.Errorf("%s = %v, want 1", series, v)
		}
	}
}

// Two replicas of the service, each with its own Redis client, Dedup,
// asynq server and Scheduler (as two processes would), share one Redis and
// schedule the same purge every second: each firing runs once, and the
// other replica's enqueue of it is refused. The replicas' logs tell the
// test each purge they ran, with its firing.
func TestTwoReplicasRunEachScheduledFiringOnce(t *testing.T) {
	redisURL := newDB(t)
	ran := make(chan purgeRun, 64)
	replicas := make([]*svc, 2)
	for i := range replicas {
		replicas[i] = startOn(t, redisURL, func(o *options) {
			o.PurgeEvery = "@every 1s"
			o.Logger = slog.New(purgeRuns{o.Logger.Handler(), i, ran})
		})
	}
	both := time.Now()            // both Schedulers run: each enqueues every later firing
	runs := map[time.Time][]int{} // firing → the replicas that ran it
	var firings []time.Time       // after both, in the order their first run came
	// A firing's second run would come within a poll interval of its first;
	// the next firing's run is the signal that it did not.
	for len(firings) < 4 {
		r := redistest.WaitFor(t, ran, "a purge to run")
		if !r.firing.After(both) {
			continue
		}
		if _, seen := runs[r.firing]; !seen {
			firings = append(firings, r.firing)
		}
		runs[r.firing] = append(runs[r.firing], r.replica)
	}
	for _, f := range firings[:3] {
		if n := len(runs[f]); n != 1 {
			t.Errorf("firing %s ran %d times (replicas %v), want once", f.Format(time.TimeOnly), n, runs[f])
		}
	}
	if f := firings; !f[1].Equal(f[0].Add(time.Second)) || !f[2].Equal(f[1].Add(time.Second)) {
		t.Errorf("firings %v, want one a second", f)
	}
	// Each of those firings was enqueued by one replica and refused to the other.
	var refused float64
	for _, s := range replicas {
		refused += s.metric(`dedup_events_total{event="duplicate",type="` + typePurge + `"}`)
	}
	if refused < 3 {
		t.Errorf("%v enqueues of a firing refused to the other replica, want at least 3 (one per firing)", refused)
	}
}

// purgeRun is one purge a replica ran: the firing it was enqueued for.
type purgeRun struct {
	replica int
	firing  time.Time
}

// purgeRuns is a slog.Handler that passes every record on to Handler and
// sends each purge the replica ran ("task done" with a firing) to ran.
type purgeRuns struct {
	slog.Handler
	replica int
	ran     chan<- purgeRun
}

// Handle sends the firing of a purge the replica ran, then passes r on.
func (h purgeRuns) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "task done" {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "firing" {
				select {
				case h.ran <- purgeRun{h.replica, a.Value.Time()}:
				default: // the test has what it needs
				}
			}
			return true
		})
	}
	return h.Handler.Handle(ctx, r)
}

// WithAttrs keeps the handler a purgeRuns.
func (h purgeRuns) WithAttrs(as []slog.Attr) slog.Handler {
	return purgeRuns{h.Handler.WithAttrs(as), h.replica, h.ran}
}

// WithGroup keeps the handler a purgeRuns.
func (h purgeRuns) WithGroup(name string) slog.Handler {
	return purgeRuns{h.Handler.WithGroup(name), h.replica, h.ran}
}

// Run on the embedded miniredis (no REDIS_URL), as `go run` does.
func TestCancelShutsDownCleanly(t *testing.T) {
	// A cleanup registered first runs last, after start's own (its Redis
	// client and miniredis).
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	s := start(t, func(o *options) { o.RedisURL = "" })
	s.do("PUT", "/profile/42", `{"name":"Ada"}`).want(t, http.StatusAccepted, "PUT profile")
	s.waitRuns(typeProfile, 1)
	s.do("POST", "/welcome?user=42", "").want(t, http.StatusAccepted, "welcome")
	s.stop() // run returned nil, logged nothing at WARN or above
	if t.Failed() {
		return
	}
	// HTTP first, then the Scheduler, then the asynq server (dedup and Redis
	// close silently after it).
	log, at := s.logs.String(), -1
	for _, step := range []string{`msg="shutting down"`, `msg="dedup: scheduler stopped"`, `msg="Starting graceful shutdown"`, `msg=Exiting`} {
		i := strings.Index(log, step)
		if i <= at {
			t.Fatalf("log lacks %s after the step before it:\n%s", step, log)
		}
		at = i
	}
	if _, err := http.Get(s.base + "/metrics"); err == nil {
		t.Errorf("the HTTP server still answers after shutdown")
	}
}

// syncBuffer is a bytes.Buffer safe for the logger's writes while a test
// reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// warnings returns the log lines at level WARN or ERROR.
func (b *syncBuffer) warnings() []string {
	var out []string
	for line := range strings.Lines(b.String()) {
		if strings.Contains(line, " level=WARN ") || strings.Contains(line, " level=ERROR ") {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}
