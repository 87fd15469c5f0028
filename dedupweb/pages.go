package dedupweb

import (
	"context"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/lockview"
)

// base is what every page shows: where it is mounted and what it may do.
type base struct {
	Root         string
	Asynqmon     string
	Prefix       string
	Title        string
	AllowRelease bool
	Now          string
}

func (h *Handler) base(title string) base {
	return base{Root: h.opts.RootPath, Asynqmon: h.opts.AsynqmonRoot, Prefix: h.opts.Prefix, Title: title,
		AllowRelease: h.opts.AllowRelease, Now: h.now().UTC().Format("2006-01-02 15:04:05 UTC")}
}

// overviewView is the overview: locks by queue, type and state, and the
// counters of the last hour.
type overviewView struct {
	base
	States  []string
	Rows    []*lockview.Tally
	Totals  map[string]int
	Total   int
	Charts  []typeCharts
	Minutes int
}

// typeCharts are one task type's counters of the last hour.
type typeCharts struct {
	Type   string
	Series []series
}

// series is one counter of the last hour, with its chart.
type series struct {
	Name  string
	Total uint64
	Chart chart
}

// overviewMinutes is how far back the overview's counters go.
const overviewMinutes = 60

func (h *Handler) overview(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	rows, err := lockview.CountLocks(ctx, h.src, h.opts.Prefix, 500)
	if err != nil {
		return err
	}
	v := overviewView{base: h.base("Overview"), States: lockview.States, Rows: rows, Totals: map[string]int{}, Minutes: overviewMinutes}
	for _, t := range rows {
		for s, n := range t.ByState {
			v.Totals[s] += n
		}
		v.Total += t.Total
	}
	byType, err := lockview.ReadMinuteStats(ctx, h.rdb, h.opts.Prefix, h.now(), overviewMinutes)
	if err != nil {
		return err
	}
	types := make([]string, 0, len(byType))
	for t := range byType {
		types = append(types, t)
	}
	sort.Strings(types)
	for _, t := range types {
		v.Charts = append(v.Charts, chartsOf(t, byType[t]))
	}
	return h.render(w, http.StatusOK, "overview", v)
}

// counters are the overview's series: name and how to read it.
var counters = []struct {
	name string
	of   func(dedup.Stats) uint64
}{
	{"locked", func(s dedup.Stats) uint64 { return s.Locked }},
	{"duplicate", func(s dedup.Stats) uint64 { return s.Duplicates }},
	{"folds", func(s dedup.Stats) uint64 { return s.Replaced + s.Merged + s.Deferred }},
	{"busy", func(s dedup.Stats) uint64 { return s.Busy }},
	{"released", func(s dedup.Stats) uint64 { return s.Released }},
}

func chartsOf(typ string, ms []lockview.MinuteStats) typeCharts {
	tc := typeCharts{Type: typ}
	for _, c := range counters {
		vals := make([]uint64, len(ms))
		var total uint64
		for i, m := range ms {
			vals[i] = c.of(m.Stats)
			total += vals[i]
		}
		tc.Series = append(tc.Series, series{Name: c.name, Total: total, Chart: barChart(vals)})
	}
	return tc
}

// locksView is one page of the lock list.
type locksView struct {
	base
	Filter   lockview.Filter
	States   []string
	Locks    []*lockview.Info
	Next     string // the next page's URL, "" on the last
	Complete bool
	First    bool
}

func (h *Handler) locks(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	f := lockview.Filter{Queue: q.Get("queue"), Type: q.Get("type"), State: q.Get("state")}
	s, err := lockview.NewScanner(ctx, h.src, h.opts.Prefix, f, 200)
	if err != nil {
		return err
	}
	cursor := q.Get("cursor")
	start, err := s.DecodeCursor(cursor)
	if err != nil {
		return err
	}
	locks, next, done, err := s.Collect(ctx, start, h.opts.PageSize)
	if err != nil {
		return err
	}
	lockview.SortLocks(locks)
	v := locksView{base: h.base("Locks"), Filter: f, States: lockview.States, Locks: locks, Complete: done, First: cursor == ""}
	if !done {
		nq := url.Values{"cursor": {s.EncodeCursor(next)}}
		for k, val := range map[string]string{"queue": f.Queue, "type": f.Type, "state": f.State} {
			if val != "" {
				nq.Set(k, val)
			}
		}
		v.Next = h.opts.RootPath + "/locks?" + nq.Encode()
	}
	return h.render(w, http.StatusOK, "locks", v)
}

// lockView is one lock's page.
type lockView struct {
	base
	D            *lockview.Detail
	Created      string
	Age          string
	CooldownLeft string
	Payload      string
	ShowPayload  bool
}

func (h *Handler) lock(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	t, err := lockview.ByKey(h.opts.Prefix, r.URL.Query().Get("key"))
	if err != nil {
		return &httpError{http.StatusBadRequest, err.Error()}
	}
	return h.showLock(ctx, w, t)
}

// showLock renders the page of the lock t names.
func (h *Handler) showLock(ctx context.Context, w http.ResponseWriter, t *lockview.Target) error {
	l, err := lockview.ReadOne(ctx, h.src, h.opts.Prefix, t)
	if err != nil {
		return err
	}
	d, err := lockview.Describe(ctx, h.src, h.opts.Prefix, l, t)
	if err != nil {
		return err
	}
	now := h.now()
	v := lockView{base: h.base("Lock " + l.Key), D: d}
	if l.Created > 0 {
		c := time.Unix(l.Created, 0).UTC()
		v.Created, v.Age = c.Format(time.RFC3339), lockview.FmtDuration(now.Sub(c))
	}
	v.CooldownLeft = lockview.CooldownLeft(l, now)
	if h.opts.PayloadFormatter != nil && d.HolderTask.Exists {
		v.ShowPayload, v.Payload = true, h.opts.PayloadFormatter.FormatPayload(d.HolderTask.Type, d.HolderTask.Payload)
	}
	return h.render(w, http.StatusOK, "lock", v)
}

// searchView is the search page, with the last query and what went wrong,
// or the locks a key has in several queues.
type searchView struct {
	base
	Q     url.Values
	Error string
	Found []string // lock keys
}

// search finds a lock by lock key, by task ID, or by type and key (as
// dedupctl lookup), and shows it; a key with a lock in several queues
// lists them; without a query it shows the forms.
func (h *Handler) search(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	v := searchView{base: h.base("Search"), Q: q}
	var (
		keys []string
		err  error
	)
	switch {
	case strings.TrimSpace(q.Get("lock")) != "":
		keys, err = keyOf(lockview.ByKey(h.opts.Prefix, strings.TrimSpace(q.Get("lock"))))
	case strings.TrimSpace(q.Get("task")) != "":
		keys, err = keyOf(lockview.ByTask(ctx, h.src, h.opts.Prefix, strings.TrimSpace(q.Get("task")), strings.TrimSpace(q.Get("queue"))))
	case strings.TrimSpace(q.Get("type")) != "":
		keys, err = h.byKeySpec(ctx, q)
	default:
		return h.render(w, http.StatusOK, "search", v)
	}
	switch {
	case err != nil:
	case len(keys) > 1:
		v.Found = keys
		return h.render(w, http.StatusOK, "search", v)
	default:
		http.Redirect(w, r, h.opts.RootPath+"/lock?"+url.Values{"key": {keys[0]}}.Encode(), http.StatusSeeOther)
		return nil
	}
	v.Error = err.Error()
	status := statusOf(err)
	if status == http.StatusInternalServerError {
		status = http.StatusNotFound // no such lock, no such task
	}
	return h.render(w, status, "search", v)
}

// keyOf is the key of the lock t names, as a list of one.
func keyOf(t *lockview.Target, err error) ([]string, error) {
	if err != nil {
		return nil, err
	}
	return []string{t.Key}, nil
}

// byKeySpec finds the locks a task of the query's type and key would take:
// in the query's queue, else in every queue (as dedupctl lookup); at least
// one, else an error.
func (h *Handler) byKeySpec(ctx context.Context, q url.Values) ([]string, error) {
	spec := lockview.KeySpec{Type: strings.TrimSpace(q.Get("type")), Payload: strings.TrimSpace(q.Get("payload")),
		Fields: strings.TrimSpace(q.Get("fields")), Key: q.Get("key"), Shared: q.Get("shared") != "", Queue: strings.TrimSpace(q.Get("queue"))}
	for _, v := range q["field"] {
		for line := range strings.Lines(v) {
			if line = strings.TrimSpace(line); line != "" {
				spec.Field = append(spec.Field, line)
			}
		}
	}
	task, opts, err := spec.Task()
	if err != nil {
		return nil, err
	}
	found, err := lockview.FindKeyLocks(ctx, h.src, h.opts.Prefix, h.opts.HashKey, task, opts, spec.Queue)
	if err != nil {
		return nil, err
	}
	if err := found.Err(); err != nil {
		return nil, &httpError{http.StatusNotFound, err.Error()}
	}
	return found.Keys, nil
}

// doctorView is the doctor's report.
type doctorView struct {
	base
	R     *lockview.Report
	Grace string
}

func (h *Handler) grace(r *http.Request) (time.Duration, error) {
	g := r.FormValue("grace")
	if g == "" {
		return h.opts.DoctorGrace, nil
	}
	d, err := time.ParseDuration(g)
	if err != nil || d < 0 {
		return 0, lockview.Usagef("bad grace %q: want a duration such as 1m", g)
	}
	return d, nil
}

// diagnose runs the doctor with the request's grace, releasing nothing.
func (h *Handler) diagnose(ctx context.Context, r *http.Request) (*lockview.Report, time.Duration, error) {
	g, err := h.grace(r)
	if err != nil {
		return nil, 0, err
	}
	rep, err := lockview.Doctor(ctx, h.src, h.opts.Prefix, lockview.Filter{}, g, false)
	return rep, g, err
}

func (h *Handler) doctor(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	rep, g, err := h.diagnose(ctx, r)
	if err != nil {
		return err
	}
	return h.render(w, http.StatusOK, "doctor", doctorView{base: h.base("Doctor"), R: rep, Grace: g.String()})
}
