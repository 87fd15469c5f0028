package dedup

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"go.uber.org/goleak"
)

// lineSink collects the lines a slog handler writes (one Write per record)
// and signals each one.
type lineSink struct {
	mu    sync.Mutex
	lines [][]byte
	ch    chan struct{}
}

func newLineSink() *lineSink { return &lineSink{ch: make(chan struct{}, 10000)} }

func (s *lineSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	s.lines = append(s.lines, bytes.Clone(p))
	s.mu.Unlock()
	select {
	case s.ch <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (s *lineSink) json() *slog.Logger { return slog.New(slog.NewJSONHandler(s, nil)) }

func (s *lineSink) text() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return string(bytes.Join(s.lines, nil))
}

// records parses the JSON lines logged so far.
func (s *lineSink) records(t *testing.T) []reportRecord {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]reportRecord, 0, len(s.lines))
	for _, l := range s.lines {
		var r reportRecord
		if err := json.Unmarshal(l, &r); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		out = append(out, r)
	}
	return out
}

type reportRecord struct {
	Level      string            `json:"level"`
	Msg        string            `json:"msg"`
	Type       string            `json:"type"`
	Attempts   uint64            `json:"attempts"`
	Locked     uint64            `json:"locked"`
	Replaced   uint64            `json:"replaced"`
	Merged     uint64            `json:"merged"`
	Deferred   uint64            `json:"deferred"`
	Duplicates uint64            `json:"duplicates"`
	Ratio      float64           `json:"ratio"`
	Keys       int               `json:"keys"`
	Evicted    uint64            `json:"evicted"`
	Top        []json.RawMessage `json:"top"`
}

func (r reportRecord) top(t *testing.T) []hotKeyReport {
	t.Helper()
	out := make([]hotKeyReport, len(r.Top))
	for i, raw := range r.Top {
		if err := json.Unmarshal(raw, &out[i]); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func (s *lineSink) wait(t *testing.T, n int) {
	t.Helper()
	for range n {
		waitFor(t, s.ch, "a log record")
	}
}

func fp(i int) string { return fmt.Sprintf("%016x", i) }

// reportNow reports the running reporter's window now.
func (d *Dedup) reportNowForTest(t *testing.T) {
	t.Helper()
	r := d.stats.rep.Load()
	if r == nil {
		t.Fatal("no reporter running")
	}
	r.reportNow()
}

func TestReportTopKeysAndRatio(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	sink := newLineSink()
	tick := make(chan time.Time)
	if err := d.startReporter(ReportConfig{TopK: 2, Logger: sink.json()}, tick, nil); err != nil {
		t.Fatal(err)
	}
	countN(d, "t", evLocked, 3)
	countN(d, "t", evReplaced, 4)
	countN(d, "t", evMerged, 1)
	countN(d, "t", evDeferred, 1)
	countN(d, "t", evDuplicate, 1)
	countN(d, "t", evReleased, 9) // not an enqueue: not in the ratio
	for i, n := range []int{2, 3, 1} {
		for range n {
			d.noteFold("t", fp(i), "alice@example.com")
		}
	}
	countN(d, "u", evLocked, 2)
	tick <- time.Now()
	sink.wait(t, 2)

	recs := sink.records(t)
	if len(recs) != 2 || recs[0].Type != "t" || recs[1].Type != "u" {
		t.Fatalf("records %+v", recs)
	}
	r := recs[0]
	if r.Msg != "dedup: fold report" || r.Level != "INFO" {
		t.Fatalf("record %+v", r)
	}
	if r.Attempts != 10 || r.Locked != 3 || r.Replaced != 4 || r.Merged != 1 || r.Deferred != 1 || r.Duplicates != 1 || r.Ratio != 0.6 || r.Keys != 3 {
		t.Fatalf("counts %+v", r)
	}
	want := []hotKeyReport{{Fingerprint: fp(1), Count: 3}, {Fingerprint: fp(0), Count: 2}}
	if got := r.top(t); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("top %+v, want %+v", got, want)
	}
	if strings.Contains(sink.text(), "alice") {
		t.Fatal("explicit key logged without ExplicitKeys")
	}
	if u := recs[1]; u.Attempts != 2 || u.Ratio != 0 || len(u.Top) != 0 {
		t.Fatalf("type u: %+v", u)
	}

	// A window with nothing in it logs nothing; the next one only its own.
	// (Reported synchronously: a tick only says the loop took it, not that
	// its report is done.)
	d.reportNowForTest(t)
	countN(d, "u", evReplaced, 1)
	d.noteFold("u", fp(7), "")
	d.reportNowForTest(t)
	recs = sink.records(t)
	if len(recs) != 3 {
		t.Fatalf("%d records, want 3: %s", len(recs), sink.text())
	}
	if u := recs[2]; u.Type != "u" || u.Attempts != 1 || u.Ratio != 1 || len(u.top(t)) != 1 || u.top(t)[0] != (hotKeyReport{Fingerprint: fp(7), Count: 1}) {
		t.Fatalf("second window %+v", u)
	}
}

func TestReportExplicitKeysOnlyWhenOptedIn(t *testing.T) {
	for _, opt := range []bool{false, true} {
		t.Run(fmt.Sprint("ExplicitKeys=", opt), func(t *testing.T) {
			d := diagDedup(t, newRDB(t), uniq(t))
			sink := newLineSink()
			if err := d.StartReporter(ReportConfig{Window: time.Hour, ExplicitKeys: opt, Logger: sink.json(), Level: slog.LevelWarn}); err != nil {
				t.Fatal(err)
			}
			d.noteFold("t", fp(1), "alice@example.com")
			d.noteFold("t", fp(1), "alice@example.com")
			d.noteFold("t", fp(2), "") // a fields key: nothing to show
			if e := d.stats.rep.Load().win.idx[hotKey{"t", fp(1)}]; (e.key != "") != opt {
				t.Fatalf("key kept in memory: %q", e.key)
			}
			d.reportNowForTest(t)
			recs := sink.records(t)
			if len(recs) != 1 || recs[0].Level != "WARN" {
				t.Fatalf("records %s", sink.text())
			}
			top := recs[0].top(t)
			want := []hotKeyReport{{Fingerprint: fp(1), Count: 2}, {Fingerprint: fp(2), Count: 1}}
			if opt {
				want[0].Key = "alice@example.com"
			}
			if fmt.Sprint(top) != fmt.Sprint(want) {
				t.Fatalf("top %+v, want %+v", top, want)
			}
		})
	}
}

// With no reporter nothing is logged, kept or allocated.
func TestReportOffLogsNothing(t *testing.T) {
	sink := newLineSink()
	d, err := New(context.Background(), newRDB(t), Config{Prefix: uniq(t), Logger: sink.json()})
	if err != nil {
		t.Fatal(err)
	}
	countN(d, "t", evReplaced, 5)
	if n := testing.AllocsPerRun(1000, func() { d.noteFold("t", "0123456789abcdef", "k") }); n != 0 {
		t.Fatalf("noteFold allocates %v times with the reporter off", n)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if out := sink.text(); strings.Contains(out, "report") {
		t.Fatalf("logged without a reporter: %s", out)
	}
}

// Close logs the last, partial window and stops the goroutine; the ticker
// path logs too.
func TestReporterTicksAndCloseReportsLastWindow(t *testing.T) {
	rdb := newRDB(t) // before the leak check: the fallback miniredis outlives it
	defer goleak.VerifyNone(t, leakOpts()...)
	sink := newLineSink()
	d, err := New(context.Background(), rdb, Config{Prefix: uniq(t), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.StartReporter(ReportConfig{Window: time.Millisecond, Logger: sink.json()}); err != nil {
		t.Fatal(err)
	}
	countN(d, "t", evReplaced, 1)
	sink.wait(t, 1) // a real ticker's report
	// Restart with a window too long to tick: only Close reports.
	if err := d.StartReporter(ReportConfig{Window: time.Hour, Logger: sink.json()}); err != nil {
		t.Fatal(err)
	}
	before := len(sink.records(t))
	countN(d, "t", evLocked, 1)
	d.noteFold("t", fp(3), "")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	recs := sink.records(t)
	if len(recs) != before+1 {
		t.Fatalf("%d records after Close, want %d: %s", len(recs), before+1, sink.text())
	}
	if last := recs[len(recs)-1]; last.Attempts != 1 || last.Locked != 1 || len(last.Top) != 1 {
		t.Fatalf("last window %+v", last)
	}
	if d.stats.rep.Load() != nil {
		t.Fatal("reporter still installed after Close")
	}
	if err := d.StartReporter(ReportConfig{}); !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("StartReporter after Close: %v", err)
	}
}

func TestStartReporterRejectsNegative(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	for _, c := range []ReportConfig{{Window: -1}, {TopK: -1}, {MaxKeys: -1}} {
		if err := d.StartReporter(c); !errors.Is(err, ErrInvalidOption) {
			t.Fatalf("%+v: %v", c, err)
		}
	}
}

// Memory stays within MaxKeys; a hot key that comes late still tops the
// list, its count an upper bound within the overcount.
func TestReportBoundedKeys(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	sink := newLineSink()
	if err := d.StartReporter(ReportConfig{Window: time.Hour, MaxKeys: 4, TopK: 2, Logger: sink.json()}); err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		d.noteFold("t", fp(1000+i), "")
	}
	for range 20 {
		d.noteFold("t", fp(1), "")
	}
	for range 10 {
		d.noteFold("t", fp(2), "")
	}
	if w := d.stats.rep.Load().win; len(w.h) != 4 || len(w.idx) != 4 {
		t.Fatalf("tracking %d/%d keys, bound 4", len(w.h), len(w.idx))
	}
	d.reportNowForTest(t)
	recs := sink.records(t)
	if len(recs) != 1 {
		t.Fatalf("records: %s", sink.text())
	}
	top := recs[0].top(t)
	if len(top) != 2 || top[0].Fingerprint != fp(1) || top[1].Fingerprint != fp(2) {
		t.Fatalf("top %+v", top)
	}
	for i, want := range []uint64{20, 10} {
		if k := top[i]; k.Count < want || k.Count-k.Overcount > want {
			t.Fatalf("key %s: count %d overcount %d, true count %d", k.Fingerprint, k.Count, k.Overcount, want)
		}
	}
	if recs[0].Evicted == 0 || recs[0].Keys != 4 {
		t.Fatalf("record %+v", recs[0])
	}
}

// Concurrent notes across window swaps are each counted exactly once.
func TestReportConcurrentNotesCountedOnce(t *testing.T) {
	d := diagDedup(t, newRDB(t), uniq(t))
	sink := newLineSink()
	if err := d.StartReporter(ReportConfig{Window: time.Hour, TopK: 100, Logger: sink.json()}); err != nil {
		t.Fatal(err)
	}
	const workers, each = 8, 500
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				d.noteFold(fmt.Sprint("t", w%2), fp(i%50), "")
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	reports := 0
	for running := true; running; reports++ {
		select {
		case <-done:
			running = false
		default:
		}
		d.reportNowForTest(t)
	}
	var total uint64
	for _, r := range sink.records(t) {
		for _, k := range r.top(t) {
			total += k.Count
		}
	}
	if total != workers*each {
		t.Fatalf("counted %d folds over %d reports, want %d", total, reports, workers*each)
	}
}

// Through the client: a Replace is reported with the lock's fingerprint,
// and the explicit key with ExplicitKeys.
func TestReportThroughReplace(t *testing.T) {
	h := newHarness(t, Config{})
	sink := newLineSink()
	if err := h.d.StartReporter(ReportConfig{Window: time.Hour, ExplicitKeys: true, Logger: sink.json()}); err != nil {
		t.Fatal(err)
	}
	task := asynq.NewTask("report:replace", []byte("v1"))
	first := h.enqueue(task, Key("acct-42"), OnConflict(Replace))
	h.enqueue(asynq.NewTask("report:replace", []byte("v2")), Key("acct-42"), OnConflict(Replace))
	h.enqueue(asynq.NewTask("report:replace", []byte("v3")), Key("acct-42"), OnConflict(Replace))
	h.d.reportNowForTest(t)
	recs := sink.records(t)
	if len(recs) != 1 {
		t.Fatalf("records: %s", sink.text())
	}
	r := recs[0]
	fpHex := fpOfLock(taskLock(t, h.rdb, h.queue, first.ID))
	want := []hotKeyReport{{Fingerprint: fpHex, Key: "acct-42", Count: 2}}
	if r.Locked != 1 || r.Replaced != 2 || r.Attempts != 3 || fmt.Sprint(r.top(t)) != fmt.Sprint(want) {
		t.Fatalf("record %+v top %+v, want top %+v", r, r.top(t), want)
	}
	if strings.Contains(sink.text(), "v2") || strings.Contains(sink.text(), "v3") {
		t.Fatal("payload in the report")
	}
}

func TestHotKeysText(t *testing.T) {
	hk := hotKeys{{Fingerprint: "aa", Count: 3}, {Fingerprint: "bb", Key: "k", Count: 2, Overcount: 1}}
	if got, want := hk.String(), `aa=3 bb("k")=2(≤+1)`; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
	var b bytes.Buffer
	slog.New(slog.NewTextHandler(&b, nil)).Info("m", slog.Any("top", hk))
	if !strings.Contains(b.String(), `top="aa=3 bb(\"k\")=2(≤+1)"`) {
		t.Fatalf("text handler: %s", b.String())
	}
}
