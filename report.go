package dedup

import (
	"cmp"
	"container/heap"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// Defaults of ReportConfig.
const (
	defaultReportWindow  = time.Minute
	defaultReportTopK    = 10
	defaultReportMaxKeys = 10000
)

// ReportConfig configures the hot-key report (Dedup.StartReporter). The zero
// value is ready to use.
type ReportConfig struct {
	// Window is how often the report is logged; each report covers the
	// window since the previous one. Default 1 minute.
	Window time.Duration

	// TopK is how many of the most folded keys each type's report lists.
	// Default 10.
	TopK int

	// MaxKeys bounds the distinct keys counted in one window, all types
	// together (about 150 bytes each). Past it the least counted key makes
	// room for the new one (the Space-Saving algorithm): a key that makes up
	// more than 1/MaxKeys of the window's folds is never dropped, and a
	// listed count may be too high by at most the "overcount" logged beside
	// it. Default 10,000.
	MaxKeys int

	// ExplicitKeys logs the explicit key (dedup.Key, dedup.SharedKey,
	// Rule.Key, Rule.KeyFunc) of a listed key beside its fingerprint. Keys
	// may hold personal data: without this option they are neither logged
	// nor kept in memory. Default false: fingerprints only. Payload contents
	// are never logged either way.
	ExplicitKeys bool

	// Logger receives the report. Default Config.Logger.
	Logger *slog.Logger

	// Level is the level the report is logged at. Default slog.LevelInfo.
	Level slog.Level
}

// StartReporter starts logging, every cfg.Window, one record per task type
// that had enqueues in the window: the enqueue attempts that reached a lock,
// how many of them were replaced (Replace), merged (Merge), deferred
// (Defer) or rejected as duplicates, the fold ratio
//
//	(replaced + merged + deferred) / (locked + replaced + merged + deferred + duplicates)
//
// and the type's most folded keys of the window, by fingerprint (16 hex
// digits, the lock key's last part) and count. For example, with
// slog.NewJSONHandler:
//
//	{"level":"INFO","msg":"dedup: fold report","type":"email:digest","window":"1m0s",
//	 "attempts":120,"locked":20,"replaced":95,"merged":0,"deferred":0,"duplicates":5,
//	 "ratio":0.7917,"keys":20,"top":[{"fingerprint":"9f2c…","count":40},…]}
//
// "keys" is the number of the type's keys counted in the window; "evicted",
// logged only when MaxKeys was reached, how many keys (all types together)
// made room for others. Explicit keys are logged only with
// ReportConfig.ExplicitKeys, payloads never.
//
// The reporter is off until started; while it is off, folds cost nothing
// to track. Calling StartReporter again logs the window so far and starts
// anew with cfg. Close logs the last, partial window and stops it. It fails
// with ErrInvalidOption for a negative setting or after Close.
func (d *Dedup) StartReporter(cfg ReportConfig) error {
	if cfg.Window < 0 || cfg.TopK < 0 || cfg.MaxKeys < 0 {
		return errorf("%w: ReportConfig has a negative setting", ErrInvalidOption)
	}
	if cfg.Window == 0 {
		cfg.Window = defaultReportWindow
	}
	t := time.NewTicker(cfg.Window)
	if err := d.startReporter(cfg, t.C, t.Stop); err != nil {
		t.Stop()
		return err
	}
	return nil
}

// startReporter starts a reporter that reports on every tick (tests drive
// the ticks).
func (d *Dedup) startReporter(cfg ReportConfig, tick <-chan time.Time, stopTick func()) error {
	if cfg.TopK == 0 {
		cfg.TopK = defaultReportTopK
	}
	if cfg.MaxKeys == 0 {
		cfg.MaxKeys = defaultReportMaxKeys
	}
	if cfg.Logger == nil {
		cfg.Logger = d.log
	}
	m := &d.stats
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errorf("%w: StartReporter called after Close", ErrInvalidOption)
	}
	if m.repLoop != nil {
		_ = m.repLoop.stop() // logs the window so far
	}
	r := &reporter{d: d, cfg: cfg, base: d.typeCounts()}
	r.win = r.newWindow()
	m.rep.Store(r)
	m.repLoop = startLoop(tick, stopTick, r.reportNow, func() error { r.reportNow(); return nil })
	return nil
}

// noteFold records that an enqueue was folded into the task holding a
// key (Replace, Merge or Defer), for the hot-key report. key is the explicit
// key when the call used one, else "". It is cheap and safe for concurrent
// use; with no reporter running it returns at once.
func (d *Dedup) noteFold(typ, fpHex, key string) {
	if r := d.stats.rep.Load(); r != nil {
		r.note(typ, fpHex, key)
	}
}

// reporter tracks the most folded keys of the current window.
type reporter struct {
	d   *Dedup
	cfg ReportConfig

	mu   sync.Mutex
	win  *window
	base map[string]counts // counts per type at the start of the window
}

type hotKey struct{ typ, fp string }

// hotEntry is one tracked key. n counts its folds in the window, over of
// them at most may belong to keys it displaced (Space-Saving).
type hotEntry struct {
	k    hotKey
	key  string // explicit key, only with ReportConfig.ExplicitKeys
	n    uint64
	over uint64
	i    int // index in the heap
}

// window is a Space-Saving summary: at most max entries, in a min-heap by
// count, so the least counted one is replaced when a new key comes.
type window struct {
	start   time.Time
	idx     map[hotKey]*hotEntry
	h       entryHeap
	max     int
	evicted uint64 // entries replaced because the window was full
}

func (r *reporter) newWindow() *window {
	return &window{start: time.Now(), idx: make(map[hotKey]*hotEntry), max: r.cfg.MaxKeys}
}

func (r *reporter) note(typ, fp, key string) {
	if !r.cfg.ExplicitKeys {
		key = ""
	}
	k := hotKey{typ, fp}
	r.mu.Lock()
	defer r.mu.Unlock()
	w := r.win
	if e, ok := w.idx[k]; ok {
		e.n++
		if e.key == "" {
			e.key = key
		}
		heap.Fix(&w.h, e.i)
		return
	}
	if len(w.h) < w.max {
		e := &hotEntry{k: k, key: key, n: 1}
		w.idx[k] = e
		heap.Push(&w.h, e)
		return
	}
	e := w.h[0] // the least counted key makes room
	delete(w.idx, e.k)
	w.evicted++
	e.k, e.key, e.over = k, key, e.n
	e.n++
	w.idx[k] = e
	heap.Fix(&w.h, 0)
}

// hotKeyReport is one listed key in a report.
type hotKeyReport struct {
	Fingerprint string `json:"fingerprint"`
	Key         string `json:"key,omitempty"`
	Count       uint64 `json:"count"`
	Overcount   uint64 `json:"overcount,omitempty"`
}

// hotKeys formats as a JSON array with slog.JSONHandler and as
// "fp=count fp=count" with slog.TextHandler.
type hotKeys []hotKeyReport

func (hk hotKeys) String() string {
	var b strings.Builder
	for i, k := range hk {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(k.Fingerprint)
		if k.Key != "" {
			fmt.Fprintf(&b, "(%q)", k.Key)
		}
		fmt.Fprintf(&b, "=%d", k.Count)
		if k.Overcount > 0 {
			fmt.Fprintf(&b, "(≤+%d)", k.Overcount)
		}
	}
	return b.String()
}

// reportNow logs the current window and starts the next one.
func (r *reporter) reportNow() {
	now := time.Now()
	cur := r.d.typeCounts()
	r.mu.Lock()
	w, base := r.win, r.base
	r.win, r.base = r.newWindow(), cur
	r.mu.Unlock()

	ctx := context.Background()
	if !r.cfg.Logger.Enabled(ctx, r.cfg.Level) {
		return
	}
	byType := map[string][]*hotEntry{}
	for _, e := range w.h {
		byType[e.k.typ] = append(byType[e.k.typ], e)
	}
	for _, typ := range reportTypes(cur, byType) {
		if attrs := r.typeReport(typ, cur[typ], base[typ], byType[typ], w, now); attrs != nil {
			r.cfg.Logger.LogAttrs(ctx, r.cfg.Level, "dedup: fold report", attrs...)
		}
	}
}

// reportTypes are the types with counts or hot keys, sorted.
func reportTypes(cur map[string]counts, byType map[string][]*hotEntry) []string {
	types := make([]string, 0, len(cur))
	for typ := range cur {
		types = append(types, typ)
	}
	for typ := range byType {
		if _, ok := cur[typ]; !ok {
			types = append(types, typ)
		}
	}
	slices.Sort(types)
	return types
}

// typeReport is one type's record of window w, or nil when the type had no
// enqueues in it.
func (r *reporter) typeReport(typ string, c, b counts, es []*hotEntry, w *window, now time.Time) []slog.Attr {
	delta := func(e event) uint64 { return c[e] - b[e] }
	folded := delta(evReplaced) + delta(evMerged) + delta(evDeferred)
	attempts := folded + delta(evLocked) + delta(evDuplicate)
	if attempts == 0 && len(es) == 0 {
		return nil
	}
	ratio := 0.0
	if attempts > 0 {
		ratio = float64(folded) / float64(attempts)
	}
	attrs := []slog.Attr{
		slog.String("type", typ),
		slog.String("window", now.Sub(w.start).Round(time.Millisecond).String()),
		slog.Uint64("attempts", attempts),
		slog.Uint64("locked", delta(evLocked)),
		slog.Uint64("replaced", delta(evReplaced)),
		slog.Uint64("merged", delta(evMerged)),
		slog.Uint64("deferred", delta(evDeferred)),
		slog.Uint64("duplicates", delta(evDuplicate)),
		slog.Float64("ratio", float64(int64(ratio*10000+0.5))/10000),
		slog.Int("keys", len(es)),
		slog.Any("top", r.top(es)),
	}
	if w.evicted > 0 {
		attrs = append(attrs, slog.Uint64("evicted", w.evicted))
	}
	return attrs
}

// top lists the most folded of a type's keys, most first.
func (r *reporter) top(es []*hotEntry) hotKeys {
	slices.SortFunc(es, func(a, b *hotEntry) int {
		if c := cmp.Compare(b.n, a.n); c != 0 {
			return c
		}
		return strings.Compare(a.k.fp, b.k.fp)
	})
	top := make(hotKeys, 0, min(len(es), r.cfg.TopK))
	for _, e := range es[:min(len(es), r.cfg.TopK)] {
		top = append(top, hotKeyReport{Fingerprint: e.k.fp, Key: e.key, Count: e.n, Overcount: e.over})
	}
	return top
}

// entryHeap is a min-heap of entries by count.
type entryHeap []*hotEntry

func (h entryHeap) Len() int           { return len(h) }
func (h entryHeap) Less(i, j int) bool { return h[i].n < h[j].n }
func (h entryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].i, h[j].i = i, j
}
func (h *entryHeap) Push(x any) {
	e := x.(*hotEntry)
	e.i = len(*h)
	*h = append(*h, e)
}
func (h *entryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
