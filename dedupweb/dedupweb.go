// Package dedupweb is a lock browser for github.com/asynq-dedup/dedup: an
// http.Handler to mount next to asynqmon. It shows the held locks per queue
// and type with their states, the per-minute counters of the last hour
// (written by Dedup.StartFlusher), one lock in full with its holder task's
// state in asynq, and the locks whose holder cannot run (the doctor). Locks
// can be searched by type and key fields, by task ID or by key.
//
// It is read-only unless Options.AllowRelease is set; then it also
// releases one lock, or what the doctor found, holder-checked, by POST only,
// with a CSRF token and a confirmation page, through Options.Authorize.
// Every name read from Redis is escaped by html/template; payloads are
// shown only through Options.PayloadFormatter. The pages need no
// JavaScript and nothing from the network: their CSS and SVG charts are
// drawn by the server.
package dedupweb

import (
	"context"
	"crypto/rand"
	"errors"
	"log/slog"
	"net/http"
	"path"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
	"github.com/redis/go-redis/v9"
)

// PayloadFormatter turns a task's payload into text to show on a lock
// page, as asynqmon's PayloadFormatter does. It may redact; what it
// returns is escaped.
type PayloadFormatter interface {
	FormatPayload(taskType string, payload []byte) string
}

// PayloadFormatterFunc is a function that is a PayloadFormatter.
type PayloadFormatterFunc func(taskType string, payload []byte) string

// FormatPayload calls f.
func (f PayloadFormatterFunc) FormatPayload(taskType string, payload []byte) string {
	return f(taskType, payload)
}

// Options configure the handler. The zero value is a read-only browser of
// the locks under the default prefix, mounted at the root.
type Options struct {
	// RootPath is the path the handler is mounted at, such as "/dedup"
	// (no trailing slash); its links start with it. Default "": the root.
	// Mount it with the same path: mux.Handle("/dedup/", h).
	RootPath string

	// Prefix is the deployment's Config.Prefix. Default "" means
	// "dedup", the library's default.
	Prefix string

	// AllowRelease enables the actions: releasing one lock and releasing
	// what the doctor found, by POST with a CSRF token after a
	// confirmation page. Default false: read-only, no action is offered
	// and every POST is refused with 403.
	AllowRelease bool

	// Authorize, when set, is called before every action (the
	// confirmation page and the POST); a non-nil error refuses it with 403
	// and its message. Default nil: with AllowRelease, whoever reaches the
	// handler may act, so guard it (the handler is usually mounted behind
	// the same authentication as asynqmon).
	Authorize func(*http.Request) error

	// AuthorizePages makes every page, not only the actions, pass
	// Authorize. Default false.
	AuthorizePages bool

	// AsynqmonRoot is the URL (or path) asynqmon is served at, such as
	// "/monitoring"; task IDs and queues then link to its pages
	// (<root>/queues/<queue>/tasks/<id>). Default "": no links.
	AsynqmonRoot string

	// PayloadFormatter shows the holder task's payload on a lock page.
	// Default nil: payloads are never shown (they may hold personal data).
	PayloadFormatter PayloadFormatter

	// HashKey is the deployment's Config.HashKey, needed to find a lock by
	// its key fields when the application sets one. Default nil.
	HashKey []byte

	// Logger receives a record of every action: who (remote address and
	// basic-auth user), what, and the result. Default nil means
	// slog.Default().
	Logger *slog.Logger

	// PageSize is how many locks a page of the list shows at most.
	// Default 0 means 50.
	PageSize int

	// DoctorGrace leaves orphans younger than it alone, as dedupctl
	// doctor --grace (the library's heal grace, 1 minute). Default 0 means
	// one minute.
	DoctorGrace time.Duration

	// Timeout bounds the Redis work of one request. Default 0 means 10 s.
	Timeout time.Duration
}

// Handler serves the lock browser. Create it with New.
type Handler struct {
	rdb    redis.UniversalClient
	src    lockview.Source
	opts   Options
	log    *slog.Logger
	secret []byte // CSRF key, random per handler
	mux    *http.ServeMux
	now    func() time.Time
}

// New returns the lock browser of the locks rdb holds (a *redis.Client or
// a *redis.ClusterClient: lists SCAN every master). It reads Redis only
// while it serves a request; it does not own rdb.
func New(rdb redis.UniversalClient, opts Options) *Handler {
	if opts.Prefix == "" {
		opts.Prefix = "dedup"
	}
	opts.RootPath = strings.TrimRight(opts.RootPath, "/")
	opts.AsynqmonRoot = strings.TrimRight(opts.AsynqmonRoot, "/")
	if opts.PageSize <= 0 {
		opts.PageSize = 50
	}
	if opts.DoctorGrace <= 0 {
		opts.DoctorGrace = time.Minute
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	h := &Handler{rdb: rdb, src: lockview.NewSource(rdb), opts: opts, log: opts.Logger, now: time.Now}
	if h.log == nil {
		h.log = slog.Default()
	}
	h.secret = make([]byte, 32)
	_, _ = rand.Read(h.secret) // crypto/rand never fails on supported platforms
	h.routes()
	return h
}

func (h *Handler) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /{$}", h.page(h.overview))
	m.HandleFunc("GET /locks", h.page(h.locks))
	m.HandleFunc("GET /lock", h.page(h.lock))
	m.HandleFunc("GET /search", h.page(h.search))
	m.HandleFunc("GET /doctor", h.page(h.doctor))
	m.HandleFunc("GET /release", h.action(h.confirmRelease))
	m.HandleFunc("POST /release", h.action(h.postRelease))
	m.HandleFunc("GET /doctor/fix", h.action(h.confirmFix))
	m.HandleFunc("POST /doctor/fix", h.action(h.postFix))
	m.HandleFunc("POST /", h.readOnlyPost)
	h.mux = m
}

// cleanPath is p cleaned as ServeMux cleans it: rooted, without . and ..
// segments or repeated slashes, keeping a trailing slash.
func cleanPath(p string) string {
	c := path.Clean("/" + p)
	if strings.HasSuffix(p, "/") && c != "/" {
		c += "/"
	}
	return c
}

// ServeHTTP serves the pages under Options.RootPath.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.opts.RootPath != "" {
		rest, ok := strings.CutPrefix(r.URL.Path, h.opts.RootPath)
		if !ok || (rest != "" && rest[0] != '/') {
			http.NotFound(w, r)
			return
		}
		if rest == "" {
			http.Redirect(w, r, h.opts.RootPath+"/", http.StatusMovedPermanently)
			return
		}
		r2 := r.Clone(r.Context())
		r2.URL.Path, r2.URL.RawPath = rest, ""
		r = r2
	}
	// A path that is not clean is redirected here, under RootPath: the
	// inner mux would redirect it without RootPath.
	if clean := cleanPath(r.URL.Path); clean != r.URL.Path {
		u := *r.URL
		u.Path, u.RawPath = h.opts.RootPath+clean, ""
		http.Redirect(w, r, u.RequestURI(), http.StatusMovedPermanently)
		return
	}
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("X-Frame-Options", "DENY")
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	w.Header().Set("Referrer-Policy", "same-origin")
	h.mux.ServeHTTP(w, r)
}

// page wraps a read-only page: Authorize when AuthorizePages, a bounded
// context, and errors rendered as a page.
func (h *Handler) page(fn func(ctx context.Context, w http.ResponseWriter, r *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if h.opts.AuthorizePages && h.opts.Authorize != nil {
			if err := h.opts.Authorize(r); err != nil {
				h.fail(w, r, http.StatusForbidden, "not authorized: "+err.Error())
				return
			}
		}
		h.bounded(w, r, fn)
	}
}

// bounded runs fn with the request's context bounded by Timeout, and
// renders its error as a page.
func (h *Handler) bounded(w http.ResponseWriter, r *http.Request, fn func(ctx context.Context, w http.ResponseWriter, r *http.Request) error) {
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.Timeout)
	defer cancel()
	if err := fn(ctx, w, r); err != nil {
		h.fail(w, r, statusOf(err), err.Error())
	}
}

// action wraps an action: refused unless AllowRelease and Authorize let
// it through.
func (h *Handler) action(fn func(ctx context.Context, w http.ResponseWriter, r *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !h.opts.AllowRelease {
			h.refuseReadOnly(w, r)
			return
		}
		if h.opts.Authorize != nil {
			if err := h.opts.Authorize(r); err != nil {
				h.logAction(r, "refused", slog.String("reason", "not authorized: "+err.Error()))
				h.fail(w, r, http.StatusForbidden, "not authorized: "+err.Error())
				return
			}
		}
		h.bounded(w, r, fn)
	}
}

// refuseReadOnly answers an action of a read-only handler.
func (h *Handler) refuseReadOnly(w http.ResponseWriter, r *http.Request) {
	h.logAction(r, "refused", slog.String("reason", "read-only"))
	h.fail(w, r, http.StatusForbidden, "read-only: this lock browser releases nothing (Options.AllowRelease is off)")
}

// readOnlyPost answers a POST to anything but an action.
func (h *Handler) readOnlyPost(w http.ResponseWriter, r *http.Request) {
	if !h.opts.AllowRelease {
		h.refuseReadOnly(w, r)
		return
	}
	w.Header().Set("Allow", "GET, HEAD")
	h.fail(w, r, http.StatusMethodNotAllowed, "method not allowed: pages are read with GET")
}

// httpError is an error with the status to answer it with.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func statusOf(err error) int {
	var he *httpError
	var ue *lockview.UsageError
	switch {
	case errors.As(err, &he):
		return he.status
	case errors.As(err, &ue):
		return http.StatusBadRequest
	case errors.Is(err, lockview.ErrNoLock):
		return http.StatusNotFound
	}
	return http.StatusInternalServerError
}

// logAction records an action: who, what, the result.
func (h *Handler) logAction(r *http.Request, result string, attrs ...slog.Attr) {
	user, _, _ := r.BasicAuth()
	base := []slog.Attr{slog.String("remote_addr", r.RemoteAddr), slog.String("user", user),
		slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("result", result)}
	level := slog.LevelInfo
	if result != "released" && result != "confirm" {
		level = slog.LevelWarn
	}
	h.log.LogAttrs(context.Background(), level, "dedupweb: action", append(base, attrs...)...)
}
