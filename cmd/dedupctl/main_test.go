package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
	"github.com/asynq-dedup/dedup/internal/store"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The end-to-end tests run the command (run, in process) against a real
// redis-server that TestMain starts on a free loopback port
// (internal/redistest). Without redis-server they skip, unless
// DEDUP_REQUIRE_REDIS is set: then they fail.

func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "dedupctl")) }

func freeAddr() (string, error) { return redistest.FreeAddr() }

func needRedis(t *testing.T) {
	t.Helper()
	redistest.NeedReal(t)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// result is one run of the command.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\n--- stdout\n%s--- stderr\n%s", r.code, r.stdout, r.stderr)
}

// runCmd runs the command in process with stdin (a string or an io.Reader).
func runCmd(stdin any, args ...string) result {
	var in io.Reader
	switch v := stdin.(type) {
	case string:
		in = strings.NewReader(v)
	case io.Reader:
		in = v
	}
	var out, errb bytes.Buffer
	code := run(args, in, &out, &errb)
	return result{stdout: out.String(), stderr: errb.String(), code: code}
}

// fixture is one test's private world on the shared Redis: its own key
// prefix and queues, a Dedup and a wrapped asynq client.
type fixture struct {
	t      *testing.T
	rdb    redis.UniversalClient
	d      *dedup.Dedup
	client *dedup.Client
	insp   *asynq.Inspector
	prefix string
	url    string
	qa, qb string
	flags  []string // global flags for runs: --url, --prefix (and --cluster)
	locks  sync.Map // task ID → the lock key its enqueue took, or was folded into
}

func newFixture(t *testing.T, cfg dedup.Config) *fixture {
	t.Helper()
	needRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: redistest.Addr(), PoolSize: 32})
	t.Cleanup(func() { _ = rdb.Close() })
	return newFixtureOn(t, rdb, "redis://"+redistest.Addr()+"/0", nil, cfg)
}

func newFixtureOn(t *testing.T, rdb redis.UniversalClient, url string, extra []string, cfg dedup.Config) *fixture {
	t.Helper()
	id := randHex(4)
	if cfg.Prefix == "" {
		cfg.Prefix = "ctl-" + id
	}
	cfg.Logger = quietLogger()
	d, err := dedup.New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatalf("dedup.New: %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	f := &fixture{t: t, rdb: rdb, d: d, client: d.WrapClient(asynq.NewClientFromRedisClient(rdb)),
		insp: asynq.NewInspectorFromRedisClient(rdb), prefix: cfg.Prefix, url: url,
		qa: "qa-" + id, qb: "qb-" + id}
	f.flags = append([]string{"--url", url, "--prefix", cfg.Prefix}, extra...)
	return f
}

// run runs the command with the fixture's global flags first.
func (f *fixture) run(stdin any, args ...string) result {
	return runCmd(stdin, append(append([]string{}, f.flags...), args...)...)
}

// ok runs the command and fails the test unless it exits 0.
func (f *fixture) ok(args ...string) result {
	f.t.Helper()
	r := f.run("", args...)
	if r.code != 0 {
		f.t.Fatalf("dedupctl %q: %v", args, r)
	}
	return r
}

// fail runs the command and fails the test unless it exits with code and
// says want on stderr.
func (f *fixture) fail(code int, want string, stdin any, args ...string) result {
	f.t.Helper()
	r := f.run(stdin, args...)
	if r.code != code || !strings.Contains(r.stderr, want) {
		f.t.Fatalf("dedupctl %q: want exit %d and %q on stderr, got %v", args, code, want, r)
	}
	return r
}

// enqueue enqueues a task keyed by its payload's user_id.
func (f *fixture) enqueue(queue, typ string, user int, opts ...asynq.Option) *asynq.TaskInfo {
	f.t.Helper()
	payload := fmt.Sprintf(`{"user_id":%d,"at":%q}`, user, randHex(4))
	opts = append([]asynq.Option{asynq.Queue(queue), dedup.Fields("user_id")}, opts...)
	res, err := f.client.Submit(context.Background(), asynq.NewTask(typ, []byte(payload)), opts...)
	if err != nil {
		f.t.Fatalf("enqueue %s %d in %s: %v", typ, user, queue, err)
	}
	f.locks.Store(res.Info.ID, store.NewKeys(f.prefix).Lock(res.Info.Queue, res.Fingerprint))
	return res.Info
}

// lockOf returns the lock key of a task: the one enqueue took for it
// (whatever became of the task since), else the one its asynq record names
// (asked once, while the task is there).
func (f *fixture) lockOf(info *asynq.TaskInfo) string {
	f.t.Helper()
	if lock, ok := f.locks.Load(info.ID); ok {
		return lock.(string)
	}
	lock, _, err := store.TaskLockOf(context.Background(), f.rdb, info.Queue, info.ID)
	if err != nil || lock == "" {
		f.t.Fatalf("task %s names no lock: %v", info.ID, err)
	}
	f.locks.Store(info.ID, lock)
	return lock
}

// orphaned enqueues a task of typ keyed on user_id through NewClient (the
// lock's value is its ID, stored with it), then makes it vanish as asynq
// never learns (a lost queue, DeleteAllPendingTasks): its lock is orphaned
// at once. (A task WrapClient enqueued and an operator deleted leaves a
// lock its producer might still be storing the task of: waiting, for a
// minute.)
func (f *fixture) orphaned(queue, typ string, user int, opts ...asynq.Option) *asynq.TaskInfo {
	f.t.Helper()
	info := f.enqueueDirect(queue, typ, user, opts...)
	f.vanish(info)
	return info
}

// enqueueDirect is enqueue through NewClient: the lock, its value the
// task's ID, is stored with the task, whose record names it.
func (f *fixture) enqueueDirect(queue, typ string, user int, opts ...asynq.Option) *asynq.TaskInfo {
	f.t.Helper()
	payload := fmt.Sprintf(`{"user_id":%d,"at":%q}`, user, randHex(4))
	opts = append([]asynq.Option{asynq.Queue(queue), dedup.Fields("user_id")}, opts...)
	res, err := f.d.NewClient().Submit(context.Background(), asynq.NewTask(typ, []byte(payload)), opts...)
	if err != nil {
		f.t.Fatalf("enqueue %s %d in %s: %v", typ, user, queue, err)
	}
	f.locks.Store(res.Info.ID, store.NewKeys(f.prefix).Lock(res.Info.Queue, res.Fingerprint))
	return res.Info
}

// vanish deletes a task's record and its entry in the pending list, as a
// lost queue does, without asynq's scripts (which release a lock the
// record names).
func (f *fixture) vanish(info *asynq.TaskInfo) {
	f.t.Helper()
	ctx := context.Background()
	if err := f.rdb.Del(ctx, store.TaskKey(info.Queue, info.ID)).Err(); err != nil {
		f.t.Fatal(err)
	}
	if err := f.rdb.LRem(ctx, store.PendingKey(info.Queue), 0, info.ID).Err(); err != nil {
		f.t.Fatal(err)
	}
}

// pastTheSecond waits until the lock WrapClient took for info is more
// than a second old: releasing what the doctor found (store.ReleaseStuck)
// leaves a lock taken before its task was stored alone for at least a
// second, whatever --grace says.
func (f *fixture) pastTheSecond(info *asynq.TaskInfo) {
	f.t.Helper()
	v, err := f.rdb.Get(context.Background(), f.lockOf(info)).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	if p := store.ParseValue(v); p.Kind == store.HoldWrap {
		time.Sleep(time.Until(p.At.Add(time.Second + 10*time.Millisecond)))
	}
}

func (f *fixture) exists(key string) bool {
	f.t.Helper()
	n, err := f.rdb.Exists(context.Background(), key).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	return n == 1
}

func decode[T any](t *testing.T, r result) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(strings.NewReader(r.stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("stdout is not one %T JSON document: %v\n%v", v, err, r)
	}
	if dec.More() {
		t.Fatalf("stdout holds more than one JSON document:\n%v", r)
	}
	return v
}

// setup enqueues three email:welcome locks in qa (one folded into twice with
// Replace) and two report:build locks in qb.
func (f *fixture) setup() (welcome []*asynq.TaskInfo, reports []*asynq.TaskInfo) {
	for u := 1; u <= 3; u++ {
		welcome = append(welcome, f.enqueue(f.qa, "email:welcome", u))
	}
	for range 2 {
		f.enqueue(f.qa, "email:welcome", 1, dedup.OnConflict(dedup.Replace))
	}
	for u := 1; u <= 2; u++ {
		reports = append(reports, f.enqueue(f.qb, "report:build", u))
	}
	return welcome, reports
}

// ---- unit tests ----

func TestNotLockKeyHints(t *testing.T) {
	fp := "0123456789abcdef"
	for key, want := range map[string]string{
		"other:{q}:u:" + fp:   `its prefix is "other": pass --prefix other`,
		"dedup:{q}:m:" + fp:   `is the mode record of lock "dedup:{q}:u:` + fp + `" (show that key)`,
		"asynq:{q}:pending":   `not a dedup lock key: "asynq:{q}:pending": it does not begin with "dedup:{" (want dedup:{<queue>}:u:<16 or 32 hex digits>)`,
		"dedup:{q}:u:nothex!": `not a dedup lock key: "dedup:{q}:u:nothex!": its fingerprint "nothex!" has 7 characters, not 16 or 32`,
		"dedup:{q}:l:" + fp:   `it has no "}:u:" before its fingerprint`, // the lease-based layout's lock hash
	} {
		if err := notLockKey("dedup", key); !strings.Contains(err.Error(), want) {
			t.Errorf("notLockKey(%q) = %q; want it to say %q", key, err, want)
		}
	}
}

func TestFmtDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		850 * time.Millisecond:                "850ms",
		12*time.Second + 400*time.Millisecond: "12s",
		4*time.Minute + 9*time.Second:         "4m09s",
		time.Hour + 5*time.Minute:             "1h05m",
		26 * time.Hour:                        "1d02h",
	} {
		if got := fmtDuration(d); got != want {
			t.Errorf("fmtDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "no command given"},
		{[]string{"frobnicate"}, `unknown command "frobnicate" (commands: list, show, lookup, release, doctor, stats, serve)`},
		{[]string{"show"}, "missing argument: KEY (or --task ID [--queue Q])"},
		{[]string{"release"}, "missing argument: KEY (or --task ID [--queue Q])"},
		{[]string{"show", "a", "b"}, `too many arguments: ["b"]`},
		{[]string{"list", "extra"}, `takes no arguments, got ["extra"]`},
		{[]string{"list", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"--bogus", "list"}, "flag provided but not defined: -bogus"},
		{[]string{"list", "--limit", "x"}, `invalid value "x" for flag -limit`},
		{[]string{"--prefix", "a{b", "list"}, `--prefix "a{b" contains a brace`},
		{[]string{"--timeout", "0s", "stats"}, "--timeout must be positive"},
		{[]string{"help", "nope"}, `unknown command "nope"`},
	} {
		r := runCmd("", c.args...)
		if r.code != exitUsage || !strings.Contains(r.stderr, c.want) || r.stdout != "" {
			t.Errorf("dedupctl %q: want exit 2 and %q on stderr only, got %v", c.args, c.want, r)
		}
	}
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}, {"help"}} {
		r := runCmd("", args...)
		if r.code != 0 || !strings.Contains(r.stdout, "Usage:\n  dedupctl [global flags] <command>") || !strings.Contains(r.stdout, "--cluster") {
			t.Errorf("dedupctl %q: %v", args, r)
		}
	}
	for _, c := range commands {
		for _, args := range [][]string{{c.name, "-h"}, {"help", c.name}} {
			r := runCmd("", args...)
			if r.code != 0 || !strings.Contains(r.stdout, "Usage: dedupctl [global flags] "+c.name) || !strings.Contains(r.stdout, "Global flags:") {
				t.Errorf("dedupctl %q: %v", args, r)
			}
		}
	}
	// The help shows built-in defaults, never a URL from the environment.
	t.Setenv(urlEnv, "redis://:hunter2@10.0.0.1:6379/0")
	if r := runCmd("", "-h"); strings.Contains(r.stdout, "hunter2") {
		t.Errorf("help shows the password from %s:\n%s", urlEnv, r.stdout)
	}
}

func TestMalformedURL(t *testing.T) {
	for _, c := range []struct {
		url     string
		cluster bool
		want    string
	}{
		{"127.0.0.1:6379", false, "bad --url"},
		{"http://127.0.0.1:6379", false, `scheme "http" is not redis, rediss or unix`},
		{"redis://127.0.0.1:notaport/0", false, `bad --url "redis://127.0.0.1:notaport/0"`},
		{"redis://127.0.0.1:6379/zero", false, "invalid database number"},
		{"redis://127.0.0.1:6379/0?frob=1", false, "unexpected option: frob"},
		{"redis://:s3cret@127.0.0.1:notaport/0", false, "xxxxx"},
		{"redis://127.0.0.1:7000,127.0.0.1:7001", false, "it lists 2 addresses; pass --cluster"},
		{"redis://127.0.0.1:7000,,127.0.0.1:7001", true, "empty address"},
		{"redis://127.0.0.1:7000/3", true, "a Redis Cluster has only database 0"},
		{"unix:///tmp/redis.sock", true, "--cluster needs a redis:// or rediss:// URL"},
		{"", false, "bad --url: empty"},
	} {
		args := []string{"--url", c.url}
		if c.cluster {
			args = append(args, "--cluster")
		}
		r := runCmd("", append(args, "list")...)
		if r.code != exitError || !strings.Contains(r.stderr, c.want) || strings.Contains(r.stderr, "s3cret") {
			t.Errorf("--url %q: want exit 1 and %q on stderr (no password), got %v", c.url, c.want, r)
		}
	}
}

func TestUnreachableRedis(t *testing.T) {
	addr := "127.0.0.1:1" // nothing listens on port 1 (a free port could be taken meanwhile by another package's redis-server)
	for _, cmd := range [][]string{{"list"}, {"stats"}, {"show", "dedup:{q}:u:0123456789abcdef"}, {"release", "--yes", "dedup:{q}:u:0123456789abcdef"}} {
		start := time.Now()
		r := runCmd("", append([]string{"--url", "redis://" + addr + "/0"}, cmd...)...)
		want := "cannot reach Redis at " + addr + ": dial tcp " + addr
		if r.code != exitError || !strings.Contains(r.stderr, want) || r.stdout != "" {
			t.Errorf("%q against a closed port: want exit 1 and %q, got %v", cmd, want, r)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("%q took %v to give up on a closed port", cmd, el)
		}
	}
	// The same through the cluster client.
	r := runCmd("", "--cluster", "--url", "redis://"+addr, "list")
	if r.code != exitError || !strings.Contains(r.stderr, "cannot reach Redis at cluster "+addr) {
		t.Errorf("--cluster against a closed port: %v", r)
	}
}

// ---- end to end ----

func TestListText(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, reports := f.setup()
	r := f.ok("list")
	lines := strings.Split(strings.TrimRight(r.stdout, "\n"), "\n")
	if len(lines) != 7 || !strings.HasPrefix(lines[0], "KEY") || lines[6] != "5 locks" {
		t.Fatalf("want a header, 5 rows and a count:\n%s", r.stdout)
	}
	for _, h := range []string{"TYPE", "HOLDER", "QUEUE", "STATE", "TTL", "FOLDS"} {
		if !strings.Contains(lines[0], h) {
			t.Errorf("header lacks %s: %q", h, lines[0])
		}
	}
	for i, info := range append(welcome, reports...) {
		row := ""
		for _, l := range lines {
			if strings.HasPrefix(l, f.lockOf(info)+" ") {
				row = l
			}
		}
		n := "0"
		if i == 0 {
			n = "2" // two Replace enqueues of user 1 folded into it
		}
		got := strings.Fields(row)
		if len(got) != 7 || got[0] != f.lockOf(info) || got[1] != info.Type || got[2] != info.ID || got[3] != info.Queue ||
			got[4] != "waiting" || !strings.HasPrefix(got[5], "59m") || got[6] != n {
			t.Errorf("row of %s (want folds %s): %q", info.ID, n, row)
		}
	}
}

func TestListJSON(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, reports := f.setup()
	out := decode[listOutput](t, f.ok("--json", "list"))
	if out.Count != 5 || len(out.Locks) != 5 || !out.Complete || out.NextCursor != "" || out.Prefix != f.prefix {
		t.Fatalf("want 5 locks, complete: %+v", out)
	}
	byKey := map[string]*lockInfo{}
	for _, l := range out.Locks {
		byKey[l.Key] = l
	}
	for i, info := range append(welcome, reports...) {
		l := byKey[f.lockOf(info)]
		if l == nil {
			t.Fatalf("lock of %s missing", info.ID)
		}
		wantN := int64(0)
		if i == 0 {
			wantN = 2 // two Replace enqueues of user 1 folded into it
		}
		if l.Holder != info.ID || l.Queue != info.Queue || l.Type != info.Type || l.State != "waiting" ||
			l.TaskState != "pending" || l.Folds != wantN || l.TTLms <= 59*60*1000 || l.TTLms > 3600*1000 ||
			l.Created == 0 || l.Fingerprint == "" || l.Fields != nil || l.FollowUp != "" {
			t.Errorf("lock of %s: %+v", info.ID, l)
		}
	}
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	f.setup()
	out := decode[listOutput](t, f.ok("list", "--type", "report:build", "--json"))
	if out.Count != 2 || out.Type != "report:build" {
		t.Fatalf("--type report:build: %+v", out)
	}
	for _, l := range out.Locks {
		if l.Type != "report:build" || l.Queue != f.qb {
			t.Errorf("--type report:build listed %+v", l)
		}
	}
	if out := decode[listOutput](t, f.ok("--json", "list", "--queue", f.qa)); out.Count != 3 {
		t.Errorf("--queue %s: %+v", f.qa, out)
	}
	if out := decode[listOutput](t, f.ok("--json", "list", "--queue", f.qa, "--type", "report:build")); out.Count != 0 || out.Locks == nil {
		t.Errorf("--queue qa --type report:build: %+v", out)
	}
	r := f.ok("list", "--type", "nope")
	if r.stdout != fmt.Sprintf("no locks of type nope held under prefix %q\n", f.prefix) {
		t.Errorf("empty listing: %q", r.stdout)
	}
}

// A queue name with braces and ":u:" in it still parses (from the end).
func TestListOddQueueName(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	q := "odd{" + f.qa + "}:u:x"
	info := f.enqueue(q, "email:welcome", 1)
	out := decode[listOutput](t, f.ok("--json", "list"))
	if out.Count != 1 || out.Locks[0].Queue != q || out.Locks[0].Holder != info.ID {
		t.Fatalf("lock in queue %q: %+v", q, out)
	}
	show := decode[showOutput](t, f.ok("--json", "show", out.Locks[0].Key))
	if show.HolderTask == nil || !show.HolderTask.Exists || show.HolderTask.State != "pending" {
		t.Errorf("show in queue %q: %+v", q, show.HolderTask)
	}
}

// 300 locks, listed 50 at most per call with tiny SCAN pages: following the
// cursors reaches every lock, and no call prints more than --limit.
func TestListPaging(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	want := map[string]bool{}
	for u := range 300 {
		want[f.lockOf(f.enqueue(f.qa, "sync:user", u))] = true
	}
	seen := map[string]int{}
	cursor, calls := "", 0
	for {
		args := []string{"--json", "list", "--limit", "50", "--count", "20"}
		if cursor != "" {
			args = append(args, "--cursor", cursor)
		}
		out := decode[listOutput](t, f.ok(args...))
		calls++
		if out.Count > 50 || out.Count != len(out.Locks) {
			t.Fatalf("call %d printed %d locks with --limit 50", calls, out.Count)
		}
		for _, l := range out.Locks {
			seen[l.Key]++
		}
		if out.Complete {
			if out.NextCursor != "" {
				t.Errorf("complete listing with a cursor %q", out.NextCursor)
			}
			break
		}
		if out.NextCursor == "" || out.NextCursor == cursor {
			t.Fatalf("incomplete listing without a new cursor: %+v", out)
		}
		cursor = out.NextCursor
		if calls > 100 {
			t.Fatal("paging does not end")
		}
	}
	if calls < 6 {
		t.Errorf("300 locks in %d calls of at most 50", calls)
	}
	for k := range want {
		if seen[k] == 0 {
			t.Errorf("paging never listed %s", k)
		}
	}
	for k, n := range seen {
		if !want[k] {
			t.Errorf("paging listed a foreign key %s", k)
		}
		if n > 1 {
			t.Logf("%s listed %d times (SCAN may repeat a key while Redis rehashes)", k, n)
		}
	}
	// Text mode says how to go on.
	r := f.ok("list", "--limit", "10")
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	last := lines[len(lines)-1]
	if want := fmt.Sprintf("%d locks shown; more may follow: add --cursor ", len(lines)-2); !strings.HasPrefix(last, want) || len(lines)-2 > 10 || len(lines)-2 < 1 {
		t.Errorf("text paging: want at most 10 rows and %q...:\n%s", want, r.stdout)
	}
	// --limit 0 lists everything in one call.
	if out := decode[listOutput](t, f.ok("--json", "list", "--limit", "0")); out.Count < 300 || !out.Complete {
		t.Errorf("--limit 0 listed %d (complete %v)", out.Count, out.Complete)
	}
	f.fail(exitUsage, "bad --cursor", "", "list", "--cursor", "nope")
	f.fail(exitUsage, "names a cluster master, but --cluster is not set", "", "list", "--cursor", "127.0.0.1:7000/12")
	f.fail(exitUsage, "--limit must be 0 (all) or positive", "", "list", "--limit", "-1")
	f.fail(exitUsage, "--count must be positive", "", "list", "--count", "0")
}

// startServer runs an asynq server with the middleware on queue whose
// handler blocks until the returned function is called.
func (f *fixture) startServer(queue string) (started <-chan string, finish func()) {
	f.t.Helper()
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{
		Concurrency:       1,
		Queues:            map[string]int{queue: 1},
		TaskCheckInterval: 20 * time.Millisecond,
		LogLevel:          asynq.FatalLevel,
		ShutdownTimeout:   5 * time.Second,
		IsFailure:         dedup.IsFailure,
	})
	ch := make(chan string, 10)
	release := make(chan struct{})
	h := asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ch <- id
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	})
	if err := srv.Start(f.d.Middleware()(h)); err != nil {
		f.t.Fatalf("asynq server: %v", err)
	}
	var once sync.Once
	finish = func() {
		once.Do(func() {
			close(release)
			srv.Shutdown()
		})
	}
	f.t.Cleanup(finish)
	return ch, finish
}

// waitRunning waits until the lock is running: its holder is active in
// asynq.
func (f *fixture) waitRunning(key string) {
	f.t.Helper()
	f.waitState(key, store.LockRunning)
}

// waitState waits until the lock at key is in state: asynq and the
// middleware write it after the handler starts or returns, which signals
// nothing.
func (f *fixture) waitState(key, state string) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ls, err := store.ReadLocks(context.Background(), f.rdb, store.NewKeys(f.prefix), []string{key})
		if err != nil {
			f.t.Fatal(err)
		}
		if len(ls) == 1 && ls[0].State() == state {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%s never became %s: %+v", key, state, ls)
		}
		time.Sleep(10 * time.Millisecond) // the server polls asynq; nothing to block on
	}
}

// One running lock (a real server with a blocking handler, RunningDefer so
// that a second enqueue owes a follow-up), one orphaned lock (its task
// deleted), one waiting: list, show and release say what each is.
func TestRunningOrphanedAndFollowUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
	}})
	running := f.enqueue(f.qb, "report:build", 1)
	orphan := f.orphaned(f.qa, "email:welcome", 2)
	waiting := f.enqueue(f.qa, "email:welcome", 3)
	started, finish := f.startServer(f.qb)
	select {
	case id := <-started:
		if id != running.ID {
			t.Fatalf("server ran %s, want %s", id, running.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never ran the task")
	}
	runKey := f.lockOf(running)
	f.waitRunning(runKey)
	follow := f.enqueue(f.qb, "report:build", 1) // folded into a follow-up
	if follow.ID == running.ID {
		t.Fatal("the second enqueue did not create a follow-up")
	}

	out := decode[listOutput](t, f.ok("--json", "list"))
	states := map[string]*lockInfo{}
	for _, l := range out.Locks {
		states[l.Holder] = l
	}
	if l := states[running.ID]; l == nil || l.State != "running" || l.TaskState != "active" || l.FollowUp != follow.ID || l.Folds != 1 {
		t.Errorf("running lock: %+v", l)
	}
	if l := states[orphan.ID]; l == nil || l.State != "orphaned" || l.TaskState != "missing" {
		t.Errorf("orphaned lock: %+v", l)
	}
	if l := states[waiting.ID]; l == nil || l.State != "waiting" {
		t.Errorf("waiting lock: %+v", l)
	}
	r := f.ok("list", "--queue", f.qb)
	if !strings.Contains(r.stdout, "FOLLOW-UP") || !strings.Contains(r.stdout, follow.ID) || !strings.Contains(r.stdout, "running") {
		t.Errorf("text list of the running lock:\n%s", r.stdout)
	}

	r = f.ok("show", runKey)
	for _, want := range []string{"state            running", "holder in asynq  active (retried 0/25)", "follow-up        " + follow.ID + ": scheduled (retried 0/25, runs in ",
		"while running    defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends",
		"mode record      " + store.ModeOf(runKey)} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show running lock lacks %q:\n%s", want, r.stdout)
		}
	}
	r = f.ok("show", f.lockOf(orphan))
	if !strings.Contains(r.stdout, "holder in asynq  missing (the lock is orphaned; it heals at the next enqueue)") || !strings.Contains(r.stdout, "state            orphaned") {
		t.Errorf("show orphaned lock:\n%s", r.stdout)
	}
	so := decode[showOutput](t, f.ok("--json", "show", f.lockOf(orphan)))
	if so.HolderTask.Exists || so.HolderTask.State != "missing" || so.State != "orphaned" {
		t.Errorf("show --json orphaned: %+v %+v", so.Info, so.HolderTask)
	}

	// --task of the follow-up finds the lock but does not release it.
	f.fail(exitError, "is its owed follow-up, not its holder", "", "release", "--yes", "--task", follow.ID, "--queue", f.qb)
	r = f.ok("release", "--yes", runKey)
	for _, want := range []string{"released " + runKey + " (type report:build, holder " + running.ID + ", running, ",
		"note: holder " + running.ID + " is running: its handler goes on without the lock",
		"note: follow-up task " + follow.ID + ", which carries the newest payload, is queued now"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("release of the running lock lacks %q:\n%s", want, r.stdout)
		}
	}
	if f.exists(runKey) {
		t.Error("the running lock is still there")
	}
	finish()
}

func TestShow(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[0])
	r := f.ok("show", key)
	for _, want := range []string{
		"key              " + key,
		"queue            " + f.qa,
		"type             email:welcome",
		"state            waiting",
		"holder           " + welcome[0].ID,
		"holder in asynq  pending (retried 0/25)",
		"folds            2",
		"TTL left         59m",
		"mode record      " + store.ModeOf(key),
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show lacks %q:\n%s", want, r.stdout)
		}
	}
	o := decode[showOutput](t, f.ok("--json", "show", key))
	if o.Key != key || o.Holder != welcome[0].ID || o.Fields["n"] != "2" ||
		!o.HolderTask.Exists || o.HolderTask.State != "pending" || o.HolderTask.MaxRetry != 25 || o.HolderTask.Type != "email:welcome" || o.PayloadVersion != "2" {
		t.Errorf("show --json: %+v / %+v", o.Info, o.HolderTask)
	}

	// By task ID: with its queue, and searching asynq's queues.
	for _, args := range [][]string{{"show", "--json", "--task", welcome[1].ID, "--queue", f.qa}, {"show", "--task", welcome[1].ID, "--json"}} {
		o := decode[showOutput](t, f.ok(args...))
		if o.Key != f.lockOf(welcome[1]) || o.TaskRole != "holder" || o.Task != welcome[1].ID {
			t.Errorf("%q: %+v", args, o)
		}
	}
	// The same work locked in another queue: the task ID still names one lock.
	other := f.enqueue(f.qb, "email:welcome", 2)
	if other.ID == welcome[1].ID || f.lockOf(other)[len(f.lockOf(other))-16:] != f.lockOf(welcome[1])[len(f.lockOf(welcome[1]))-16:] {
		t.Fatalf("want the same fingerprint in two queues: %s, %s", other.ID, welcome[1].ID)
	}
	for _, info := range []*asynq.TaskInfo{welcome[1], other} {
		if o := decode[showOutput](t, f.ok("--json", "show", "--task", info.ID)); o.Key != f.lockOf(info) {
			t.Errorf("show --task %s (same work in two queues): %s", info.ID, o.Key)
		}
	}
	// A caller-chosen task ID's record names its lock (its header).
	info := f.enqueue(f.qb, "email:welcome", 9, asynq.TaskID("welcome-9-"+f.qb))
	o = decode[showOutput](t, f.ok("--json", "show", "--task", info.ID, "--queue", f.qb))
	if o.Holder != info.ID || o.Key != f.lockOf(info) || o.TaskRole != "holder" {
		t.Errorf("show --task of a caller-chosen ID: %+v", o.Info)
	}
}

func TestShowBadInput(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[0])
	fp := key[len(key)-16:]
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"show", "hello"}, exitUsage, `not a dedup lock key: "hello"`},
		{[]string{"show", store.ModeOf(key)}, exitUsage, "is the mode record of lock \"" + key + "\" (show that key)"},
		{[]string{"show", "other:{" + f.qa + "}:u:" + fp}, exitUsage, `its prefix is "other": pass --prefix other`},
		{[]string{"show", store.NewKeys(f.prefix).Lock(f.qa, "ffffffffffffffff")}, exitError, "no such lock: " + store.NewKeys(f.prefix).Lock(f.qa, "ffffffffffffffff")},
		{[]string{"show", store.NewKeys(f.prefix).Lock(f.qb, fp)}, exitError, "no such lock"},
		{[]string{"show", "--task", "dd-ffffffffffffffff-0123456789abcdef0123", "--queue", f.qa}, exitError, "no such lock: task"},
		{[]string{"show", "--task", "nobody", "--queue", f.qa}, exitError, `no such lock: task "nobody" in queue ` + f.qa + " names no lock"},
		{[]string{"show", "--task", "x", key}, exitUsage, "give KEY or --task, not both"},
		{[]string{"show", "--queue", f.qa, key}, exitUsage, "--queue goes with --task"},
	}
	// A key of the right shape that is not a string (as the lease-based
	// layout's lock hashes were).
	hashKey := store.NewKeys(f.prefix).Lock(f.qa, "eeeeeeeeeeeeeeee")
	if err := f.rdb.HSet(context.Background(), hashKey, "id", "x").Err(); err != nil {
		t.Fatal(err)
	}
	cases = append(cases, struct {
		args []string
		code int
		want string
	}{[]string{"show", hashKey}, exitError, "not a dedup lock: " + hashKey + " is a hash"})
	for _, c := range cases {
		r := f.run("", c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, c.want) || r.stdout != "" {
			t.Errorf("%q: want exit %d and %q, got %v", c.args, c.code, c.want, r)
		}
	}
}

// A KEY that is not a lock key is bad input ("2 usage error"): show and
// release refuse it with exit 2 and say what is wrong with it, on a live
// Redis and with Redis down (before Redis is asked, as lookup's bad input).
func TestAMalformedKeyIsAUsageErrorThatSaysWhatIsWrongEvenWithRedisDown(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[0])
	fp := key[len(key)-16:]
	keys := store.NewKeys(f.prefix)
	for _, c := range []struct{ key, want string }{
		{"hello", `not a dedup lock key: "hello": it does not begin with "` + f.prefix + `:{"`},
		{"asynq:{" + f.qa + "}:pending", `it does not begin with "` + f.prefix + `:{"`},
		{f.prefix + ":{" + f.qa + "}:l:" + fp, `it has no "}:u:" before its fingerprint`},
		{keys.Lock("", fp), "its queue is empty"},
		{key + "0", `its fingerprint "` + fp + `0" has 17 characters, not 16 or 32`},
		{keys.Lock(f.qa, "0123456789ABCDEF"), `its fingerprint "0123456789ABCDEF" is not lower-case hex`},
		{store.ModeOf(key), `is the mode record of lock "` + key + `" (show that key)`},
		{"other:{" + f.qa + "}:u:" + fp, `its prefix is "other": pass --prefix other`},
	} {
		for _, args := range [][]string{{"show", c.key}, {"release", "--yes", c.key}} {
			if r := f.run("", args...); r.code != exitUsage || !strings.Contains(r.stderr, c.want) || r.stdout != "" {
				t.Errorf("%q: want exit %d and %q, got %v", args, exitUsage, c.want, r)
			}
			down := append([]string{"--url", "redis://127.0.0.1:1/0", "--prefix", f.prefix}, args...)
			if r := runCmd("", down...); r.code != exitUsage || !strings.Contains(r.stderr, c.want) {
				t.Errorf("%q with Redis down: want exit %d and %q, got %v", args, exitUsage, c.want, r)
			}
		}
	}
	if !f.exists(key) {
		t.Fatal("a refused release released a lock")
	}
}

func TestReleaseYes(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[2])
	r := f.ok("release", key, "--yes")
	want := "released " + key + " (type email:welcome, holder " + welcome[2].ID + ", waiting, 59m"
	if !strings.HasPrefix(r.stdout, want) || !strings.Contains(r.stdout, "note: holder "+welcome[2].ID+" is still pending in asynq") || r.stderr != "" {
		t.Errorf("release --yes: want %q, got %v", want, r)
	}
	if f.exists(key) {
		t.Fatal("lock still there")
	}
	// The key is free: the same work enqueues again as a new task.
	again := f.enqueue(f.qa, "email:welcome", 3)
	if again.ID == welcome[2].ID {
		t.Error("enqueue after release returned the old task")
	}
	f.fail(exitUsage, "not a dedup lock key", "", "release", "--yes", f.lockOf(welcome[1])+"0") // 17 digits
	f.fail(exitError, "no such lock: "+store.NewKeys(f.prefix).Lock(f.qa, "ffffffffffffffff"), "", "release", "--yes", store.NewKeys(f.prefix).Lock(f.qa, "ffffffffffffffff"))
	f.fail(exitUsage, "not a dedup lock key", "", "release", "--yes", "asynq:{"+f.qa+"}:pending")

	// JSON, by caller-chosen task ID: the holder, which still runs, still
	// names its key in its record, and is marked to check it first.
	info := f.enqueue(f.qb, "report:build", 5, asynq.TaskID("report-5-"+f.qb))
	o := decode[releaseOutput](t, f.ok("--json", "release", "--yes", "--task", info.ID, "--queue", f.qb))
	if !o.Released || o.Holder != info.ID || o.State != "waiting" || o.TaskState != "pending" || len(o.Notes) != 1 {
		t.Errorf("release --json: %+v", o)
	}
	if lock, _, err := store.TaskLockOf(context.Background(), f.rdb, f.qb, info.ID); err != nil || lock != f.lockOf(info) {
		t.Errorf("the released holder names lock %q (%v), want %s: it could not find its key", lock, err, f.lockOf(info))
	}
	msg, _ := f.rdb.HGet(context.Background(), store.TaskKey(f.qb, info.ID), "msg").Result()
	if lost := store.MessageHeaders([]byte(msg))[store.HeaderLost]; lost != store.LostReleased {
		t.Errorf("the released holder is marked %q, want %q: it would not check its key first", lost, store.LostReleased)
	}
}

func TestReleasePrompt(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[1])
	for _, answer := range []string{"n\n", "\n", "nope\n", "maybe"} {
		r := f.fail(exitError, "not released: not confirmed", answer, "release", key)
		if !strings.Contains(r.stderr, "Release this lock? [y/N] ") || !strings.Contains(r.stderr, "holder "+welcome[1].ID+" (pending in asynq)") {
			t.Errorf("prompt for %q:\n%s", answer, r.stderr)
		}
		if !f.exists(key) {
			t.Fatalf("answer %q released the lock", answer)
		}
	}
	f.fail(exitError, "not released: no answer on stdin; pass --yes", "", "release", key)
	if !f.exists(key) {
		t.Fatal("no answer released the lock")
	}
	r := f.run("y\n", "release", key)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "released "+key) {
		t.Fatalf("answer y: %v", r)
	}
	if f.exists(key) {
		t.Fatal("answer y left the lock")
	}
	key = f.lockOf(welcome[2])
	if r := f.run("YES", "--json", "release", key); r.code != 0 || !decode[releaseOutput](t, r).Released {
		t.Fatalf("answer YES, --json: %v", r)
	}
}

// With stdin a pipe (no terminal) and no --yes, release refuses.
func TestReleaseNoTerminal(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	welcome, _ := f.setup()
	key := f.lockOf(welcome[0])
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	_, _ = pw.WriteString("y\n")
	pw.Close()
	f.fail(exitError, "not released: stdin is not a terminal, so nobody can confirm; pass --yes", pr, "release", key)
	if !f.exists(key) {
		t.Fatal("released without a terminal")
	}
}

// The delete is holder-checked: a lock that changed hands after it was read
// is left alone.
func TestReleaseOwnerSafe(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{"email:welcome": {Fields: []string{"user_id"}, MaxPending: 100}}})
	welcome, _ := f.setup()
	ctx := context.Background()
	key := f.lockOf(welcome[0])
	fp := key[len(key)-16:]
	wk := store.NewKeys(f.prefix).Wait(f.qa, "email:welcome")
	stale := &store.Release{Lock: key, Queue: f.qa, Type: "email:welcome", How: store.ReleaseHolder, Holder: "stale"}
	res, err := store.ReleaseKey(ctx, f.rdb, stale)
	if err != nil || res.Released || res.Holder != welcome[0].ID {
		t.Fatalf("release with a stale holder: %+v, %v", res, err)
	}
	if !f.exists(key) {
		t.Fatal("a stale holder's release deleted the lock")
	}
	// The lock is counted in its type's waiting set (MaxPending); releasing
	// takes it out.
	if s, err := f.rdb.ZScore(ctx, wk, fp).Result(); err != nil || s == 0 {
		t.Fatalf("lock not in the waiting set %s: %v", wk, err)
	}
	o := decode[showOutput](t, f.ok("--json", "show", key))
	if o.WaitingSet != wk {
		t.Errorf("show: waiting set %q, want %q", o.WaitingSet, wk)
	}
	f.ok("release", "--yes", key)
	if err := f.rdb.ZScore(ctx, wk, fp).Err(); err != redis.Nil {
		t.Errorf("released lock still in the waiting set: %v", err)
	}
	// --task of a task that is not the holder refuses.
	if err := f.rdb.SetArgs(ctx, f.lockOf(welcome[1]), "someone-else", redis.SetArgs{KeepTTL: true}).Err(); err != nil {
		t.Fatal(err)
	}
	f.fail(exitError, "not released: task "+welcome[1].ID+" does not hold it", "", "release", "--yes", "--task", welcome[1].ID, "--queue", f.qa)
	if !f.exists(f.lockOf(welcome[1])) {
		t.Fatal("released a lock its --task does not hold")
	}
}

func TestStats(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	f.setup()
	// Two duplicates, rejected.
	for range 2 {
		_, err := f.client.Enqueue(asynq.NewTask("report:build", []byte(`{"user_id":1}`)), asynq.Queue(f.qb), dedup.Fields("user_id"))
		if err == nil {
			t.Fatal("duplicate accepted")
		}
	}
	if err := f.d.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	o := decode[statsOutput](t, f.ok("--json", "stats"))
	if o.Types["email:welcome"]["locked"] != 3 || o.Types["email:welcome"]["replaced"] != 2 ||
		o.Types["report:build"]["locked"] != 2 || o.Types["report:build"]["duplicate"] != 2 ||
		o.Totals["locked"] != 5 || o.Note != "" {
		t.Errorf("stats counters: %+v", o)
	}
	if o.Locks.Total != 5 || o.Locks.ByState["waiting"] != 5 {
		t.Errorf("stats locks: %+v", o.Locks)
	}
	if len(o.Top) != 1 || o.Top[0].Folds != 2 || o.Top[0].Type != "email:welcome" || o.Top[0].Queue != f.qa {
		t.Errorf("top folded: %+v", o.Top)
	}
	r := f.ok("stats")
	for _, want := range []string{
		fmt.Sprintf("Counters flushed to Redis under prefix %q", f.prefix),
		"EVENT", "email:welcome", "report:build", "TOTAL",
		"Live locks: 5 (5 waiting)",
		"\n\nTop folded keys:\nKEY",
		o.Top[0].Key,
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("stats text lacks %q:\n%s", want, r.stdout)
		}
	}
}

// stats prints in text every counter that --json prints, with the same
// values: a row per event, a column per type and their total.
func TestStatsTextShowsEveryCounterOfTheJSON(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	f.setup()
	if _, err := f.client.Enqueue(asynq.NewTask("report:build", []byte(`{"user_id":1}`)), asynq.Queue(f.qb), dedup.Fields("user_id")); err == nil {
		t.Fatal("duplicate accepted")
	}
	if err := f.d.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	o := decode[statsOutput](t, f.ok("--json", "stats"))
	text := f.ok("stats").stdout
	for _, e := range slices.Sorted(maps.Keys(o.Totals)) {
		if !regexp.MustCompile(`(?m)(^|\s)` + regexp.QuoteMeta(e) + `(\s|$)`).MatchString(strings.ToLower(text)) {
			t.Errorf("the text lacks the counter %s, which --json prints", e)
		}
	}
	got := map[string]map[string]uint64{} // column (a type, or TOTAL) → event → count
	var columns []string
	var events []string
	_, table, _ := strings.Cut(text, "since the first flush):\n")
	table, _, _ = strings.Cut(table, "\n\n")
	for i, line := range strings.Split(table, "\n") {
		cells := strings.Fields(line)
		if i == 0 {
			if len(cells) == 0 || cells[0] != "EVENT" {
				t.Fatalf("the counters' table has no header:\n%s", text)
			}
			columns = cells[1:]
			continue
		}
		if len(cells) != len(columns)+1 {
			t.Fatalf("row %q has %d cells, want %d:\n%s", line, len(cells), len(columns)+1, text)
		}
		events = append(events, cells[0])
		for j, c := range columns {
			n, err := strconv.ParseUint(cells[j+1], 10, 64)
			if err != nil {
				t.Fatalf("row %q: %v", line, err)
			}
			if got[c] == nil {
				got[c] = map[string]uint64{}
			}
			got[c][cells[0]] = n
		}
	}
	want := maps.Clone(o.Types)
	want["TOTAL"] = o.Totals
	if !slices.Equal(columns, []string{"email:welcome", "report:build", "TOTAL"}) || !reflect.DeepEqual(got, want) {
		t.Errorf("the text's counters differ from the JSON's:\ntext %v\njson %v\n%s", got, want, text)
	}
	if !slices.Equal(events, lockview.EventNames()) {
		t.Errorf("the text's rows are %v, want every event in lockview.EventNames order %v", events, lockview.EventNames())
	}
}

func TestStatsEmpty(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	r := f.ok("stats")
	want := noCounters + "\n\nLive locks: none\nTop folded keys: no live lock has folds\n"
	if r.stdout != want {
		t.Errorf("stats with nothing:\n%q\nwant\n%q", r.stdout, want)
	}
	o := decode[statsOutput](t, f.ok("stats", "--json"))
	if o.Note != noCounters || len(o.Types) != 0 || o.Locks.Total != 0 || o.Top == nil {
		t.Errorf("stats --json with nothing: %+v", o)
	}
}

// The URL may come from the environment.
func TestURLFromEnv(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	f.enqueue(f.qa, "email:welcome", 1)
	t.Setenv(urlEnv, f.url)
	r := runCmd("", "--prefix", f.prefix, "list")
	if r.code != 0 || !strings.Contains(r.stdout, "1 lock\n") {
		t.Errorf("URL from %s: %v", urlEnv, r)
	}
}

// An attempt that fails with retries left: the lock is held for the retry
// and listed as retry-wait.
func TestRetryWait(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	info := f.enqueue(f.qa, "email:welcome", 1)
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{
		Concurrency:       1,
		Queues:            map[string]int{f.qa: 1},
		TaskCheckInterval: 20 * time.Millisecond,
		LogLevel:          asynq.FatalLevel,
		IsFailure:         dedup.IsFailure,
		RetryDelayFunc:    func(int, error, *asynq.Task) time.Duration { return time.Hour },
	})
	failed := make(chan struct{}, 1)
	h := asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		select {
		case failed <- struct{}{}:
		default:
		}
		return fmt.Errorf("smtp: 421 try again later")
	})
	if err := srv.Start(f.d.Middleware()(h)); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	<-failed
	deadline := time.Now().Add(10 * time.Second)
	for {
		ti, err := f.insp.GetTaskInfo(f.qa, info.ID)
		if err == nil && ti.State == asynq.TaskStateRetry {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("task never reached retry: %v %v", ti, err)
		}
		time.Sleep(10 * time.Millisecond) // asynq moves it after the handler returns
	}
	out := decode[listOutput](t, f.ok("--json", "list"))
	if out.Count != 1 || out.Locks[0].State != "retry-wait" || out.Locks[0].TaskState != "retry" {
		t.Fatalf("failed attempt: %+v", out.Locks)
	}
	r := f.ok("show", f.lockOf(info))
	if !strings.Contains(r.stdout, "holder in asynq  retry (retried 1/25, runs in 59m") || !strings.Contains(r.stdout, "last error: smtp: 421 try again later") {
		t.Errorf("show of a lock waiting for a retry:\n%s", r.stdout)
	}
}

// A lock kept after its task succeeded (Rule.Cooldown): list and show say
// cooling, not orphaned, though the holder is gone from asynq.
func TestCoolingLock(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour}}})
	info := f.enqueue(f.qa, "digest:weekly", 1)
	started, finish := f.startServer(f.qa)
	<-started
	finish()
	key := f.lockOf(info)
	var l *lockInfo
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		out := decode[listOutput](t, f.ok("--json", "list", "--queue", f.qa))
		if len(out.Locks) == 1 && out.Locks[0].State == "cooling" {
			l = out.Locks[0]
			break
		}
	}
	if l == nil || l.Holder != info.ID || l.TTLms <= 0 {
		t.Fatalf("list: cooling lock of %s not found: %+v", info.ID, l)
	}
	r := f.ok("show", key)
	if !strings.Contains(r.stdout, "state            cooling") || !strings.Contains(r.stdout, "it succeeded; the key cools down") {
		t.Errorf("show cooling lock:\n%s", r.stdout)
	}
}

// lockKeys lists the keys of every lock under the fixture's prefix.
func (f *fixture) lockKeys() []string {
	f.t.Helper()
	ks, err := f.rdb.Keys(context.Background(), store.NewKeys(f.prefix).LockPattern("")).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	return ks
}

// taskState names a task's asynq state ("gone" when asynq has no record).
func (f *fixture) taskState(queue, id string) string {
	ti, err := f.insp.GetTaskInfo(queue, id)
	if err != nil {
		return "gone"
	}
	return ti.State.String()
}
