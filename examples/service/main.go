// Command service is a small HTTP service, meant to be copied, that enqueues asynq tasks through
// dedup; an asynq server runs them behind dedup's middleware, and dedup's Scheduler enqueues a
// periodic task once per firing however many replicas run; SIGINT or SIGTERM stops it cleanly.
//
//	POST /welcome?user=42    Reject: 202, or 409 naming the task that holds the key
//	POST /reindex?user=42    Debounce: a burst runs once, 2 s after it ends
//	POST /report?tenant=7    Cooldown: 409 while it waits or runs, then 429 with Retry-After
//	PUT  /profile/42         Replace + RunningDefer: the latest JSON body wins
//	GET  /profile/42/synced  the profile the last sync saw
//	GET  /metrics            dedup's counters (Prometheus); dedupctl stats reads their flushes
//	every minute             sessions:purge, run once per firing across replicas (dedup.Scheduler)
//
//	go run ./examples/service                                    # on an embedded Redis (miniredis)
//	REDIS_URL=redis://127.0.0.1:6379/0 go run ./examples/service  # on your Redis
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupprom"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
)

const (
	typeWelcome = "email:welcome"
	typeReindex = "search:reindex"
	typeReport  = "report:hourly"
	typeProfile = "profile:sync"
	typePurge   = "sessions:purge"
)

// options configures run; main takes defaultOptions, -listen and REDIS_URL.
type options struct {
	Listen       string        // HTTP address
	RedisURL     string        // redis://host:port/db; "" starts an embedded miniredis
	PurgeEvery   string        // the Scheduler's cron spec for sessions:purge
	PollInterval time.Duration // how often asynq looks for new tasks and for due ones
	Logger       *slog.Logger
}

func defaultOptions() options {
	return options{Listen: "127.0.0.1:8080", PurgeEvery: "@every 1m", PollInterval: time.Second,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))}
}

func main() {
	o := defaultOptions()
	flag.StringVar(&o.Listen, "listen", o.Listen, "HTTP listen `address`")
	flag.Parse()
	o.RedisURL = os.Getenv("REDIS_URL")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		o.Logger.Error("service failed", "err", err)
		os.Exit(1)
	}
}

// rules is the dedup policy. With OptIn, a type without a rule is not deduplicated.
var rules = map[string]dedup.Rule{
	// A sign-up retried while its email waits or is being sent is refused.
	typeWelcome: {Fields: []string{"user_id"}},
	// Each request of a burst replaces the payload and pushes the run back 2 s.
	typeReindex: {Fields: []string{"user_id"}, OnConflict: dedup.Replace, Debounce: 2 * time.Second},
	// One report per tenant an hour, counted from its enqueue: 409 while it waits or runs, then 429.
	typeReport: {Fields: []string{"tenant_id"}, Cooldown: time.Hour},
	// Latest wins; updates during a sync wait in one follow-up sync.
	typeProfile: {Fields: []string{"user_id"}, OnConflict: dedup.Replace, OnRunning: dedup.RunningDefer},
}

// run serves until ctx ends, then shuts down; it fails if it cannot start or serve.
func run(ctx context.Context, o options) error {
	if o.RedisURL == "" {
		mr, err := miniredis.Run()
		if err != nil {
			return fmt.Errorf("embedded Redis: %w", err)
		}
		defer mr.Close() // deferred calls run in reverse order: this one last
		o.RedisURL = "redis://" + mr.Addr()
	}
	opt, err := redis.ParseURL(o.RedisURL)
	if err != nil {
		return fmt.Errorf("REDIS_URL (want redis://host:port/db): %w", err)
	}
	opt.ContextTimeoutEnabled = true // dedup then bounds its lock calls on the caller's goroutine
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	return serve(ctx, o, rdb)
}

// serve runs the service on rdb. Its deferred calls stop what it starts, in reverse.
func serve(ctx context.Context, o options, rdb *redis.Client) error {
	ln, err := net.Listen("tcp", o.Listen) // before the workers start: fail early
	if err != nil {
		return err
	}
	defer ln.Close() // on an early return; serving closes it otherwise
	d, err := dedup.New(ctx, rdb, dedup.Config{OptIn: true, Rules: rules, Logger: o.Logger})
	if err != nil {
		return err // "dedup: ..."
	}
	defer d.Close()                      // after srv.Shutdown: until then it renews running handlers' locks
	_ = d.StartFlusher(10 * time.Second) // counters to Redis for dedupctl stats (fails only after Close)
	s := &service{log: o.Logger, client: d.NewClient()}
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		IsFailure:                dedup.IsFailure, // a task deferred by dedup's guard uses up no retry
		TaskCheckInterval:        o.PollInterval,
		DelayedTaskCheckInterval: o.PollInterval, // else a debounced run may start up to 5 s late
		Logger:                   asynqLogger{o.Logger},
	})
	if err := srv.Start(s.tasks(d)); err != nil {
		return fmt.Errorf("asynq server: %w", err)
	}
	defer srv.Shutdown() // waits for running handlers
	sch, err := startScheduler(d, o.PurgeEvery)
	if err != nil {
		return err
	}
	defer sch.Shutdown() // before d.Close: it enqueues through d
	return serveHTTP(ctx, o.Logger, ln, s.routes(d))
}

// startScheduler enqueues a purge on the cron spec. Every replica runs the
// same entry; dedup's Scheduler keys each firing itself (the type needs no
// rule), so one replica enqueues it and the others are refused. asynq's own
// Scheduler would enqueue each firing once per replica.
func startScheduler(d *dedup.Dedup, spec string) (*dedup.Scheduler, error) {
	sch := dedup.NewScheduler(d, nil) // nil: UTC, clocks up to a minute apart (MaxSkew)
	if _, err := sch.Register(spec, asynq.NewTask(typePurge, nil)); err != nil {
		return nil, fmt.Errorf("schedule %q: %w", spec, err) // dedup.ErrInvalidOption
	}
	if err := sch.Start(); err != nil {
		return nil, err
	}
	return sch, nil
}

// serveHTTP serves h until ctx ends, then stops taking requests and waits
// for those in flight, whose enqueues need dedup and Redis still open.
func serveHTTP(ctx context.Context, log *slog.Logger, ln net.Listener, h http.Handler) error {
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := hs.Shutdown(sctx)
	<-served // http.ErrServerClosed, as soon as Shutdown closes the listener
	return err
}

// service holds what the HTTP handlers and the task handlers share.
type service struct {
	log    *slog.Logger
	client *dedup.Client
	synced sync.Map // user ID (decimal) → the json.RawMessage profile its last sync saw
}

// payload is every task's JSON body. The rules key on user_id or tenant_id.
type payload struct {
	UserID   int64           `json:"user_id,omitempty"`
	TenantID int64           `json:"tenant_id,omitempty"`
	Profile  json.RawMessage `json:"profile,omitempty"`
}

func (s *service) routes(d *dedup.Dedup) http.Handler {
	reg := prometheus.NewRegistry() // not the global one: run may be called twice in a process
	reg.MustRegister(dedupprom.NewCollector(d))
	mux := http.NewServeMux()
	mux.HandleFunc("POST /welcome", s.enqueue(typeWelcome, "user"))
	mux.HandleFunc("POST /reindex", s.enqueue(typeReindex, "user"))
	mux.HandleFunc("POST /report", s.enqueue(typeReport, "tenant"))
	mux.HandleFunc("PUT /profile/{user}", s.enqueue(typeProfile, "user"))
	mux.HandleFunc("GET /profile/{user}/synced", func(w http.ResponseWriter, r *http.Request) {
		if profile, ok := s.synced.Load(r.PathValue("user")); ok {
			writeJSON(w, http.StatusOK, profile)
		} else {
			http.Error(w, "not synced yet", http.StatusNotFound)
		}
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// payloadOf reads a task's payload from r: the positive ID in the path or
// query parameter param ("user" or "tenant"), and the JSON body of a PUT.
func payloadOf(r *http.Request, param string) (payload, error) {
	id, err := strconv.ParseInt(cmp.Or(r.PathValue(param), r.URL.Query().Get(param)), 10, 64)
	if err != nil || id <= 0 {
		return payload{}, fmt.Errorf("want a positive decimal %s ID", param)
	}
	p := payload{UserID: id}
	if param == "tenant" {
		p = payload{TenantID: id}
	}
	if r.Method == http.MethodPut {
		p.Profile, err = io.ReadAll(io.LimitReader(r.Body, 64<<10))
		if err != nil || !json.Valid(p.Profile) {
			return p, errors.New("want a JSON body (at most 64 KiB)")
		}
	}
	return p, nil
}

// enqueue returns a handler enqueueing a typ task for the ID in param: 202 with
// the task carrying the payload, 409 naming the key's holder, 429 if it cools.
func (s *service) enqueue(typ, param string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p, err := payloadOf(r, param)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body, _ := json.Marshal(p) // cannot fail: Profile is valid JSON
		// A hang-up must not cut an enqueue off mid-way; LockTimeout bounds it.
		res, err := s.client.Submit(context.WithoutCancel(r.Context()), asynq.NewTask(typ, body))
		var dup *dedup.DuplicateTaskError
		switch {
		case errors.As(err, &dup) && dup.CoolingDown:
			// Whole seconds, rounded up, at least 1: told 0, a client retries at once.
			w.Header().Set("Retry-After", strconv.Itoa(max(1, int((dup.FreeIn+time.Second-1)/time.Second))))
			writeJSON(w, http.StatusTooManyRequests, map[string]string{"holder": dup.Holder})
		case errors.As(err, &dup):
			writeJSON(w, http.StatusConflict, map[string]string{"holder": dup.Holder})
		case err != nil:
			s.log.ErrorContext(r.Context(), "enqueue failed", "type", typ, "err", err)
			http.Error(w, "could not enqueue", http.StatusServiceUnavailable)
		default:
			writeJSON(w, http.StatusAccepted, map[string]any{
				"task_id": res.TaskID, "outcome": res.Outcome.String(), "folded": res.Outcome != dedup.Created})
		}
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // fails only when the client has gone
}

// tasks is the asynq mux: every handler runs behind dedup's middleware.
func (s *service) tasks(d *dedup.Dedup) *asynq.ServeMux {
	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc(typeWelcome, s.done)
	mux.HandleFunc(typeReindex, s.done)
	mux.HandleFunc(typeReport, s.done)
	mux.HandleFunc(typeProfile, s.syncProfile)
	mux.HandleFunc(typePurge, s.done)
	return mux
}

// done logs a finished task, and the firing a scheduled one was enqueued
// for. As a handler it stands for the email, reindex, report and purge.
func (s *service) done(ctx context.Context, t *asynq.Task) error {
	id, _ := asynq.GetTaskID(ctx)
	attrs := []any{"type", t.Type(), "task_id", id}
	if _, at, ok := dedup.SchedulerFiring(t); ok {
		attrs = append(attrs, "firing", at)
	}
	s.log.InfoContext(ctx, "task done", attrs...)
	return nil
}

// syncProfile stands for pushing a profile elsewhere; GET .../synced shows it.
func (s *service) syncProfile(ctx context.Context, t *asynq.Task) error {
	var p payload
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		return fmt.Errorf("%w: %v", asynq.SkipRetry, err) // a retry cannot fix the payload
	}
	s.synced.Store(strconv.FormatInt(p.UserID, 10), p.Profile)
	return s.done(ctx, t)
}

// asynqLogger sends asynq's logs to slog, so the service has one log stream.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)); os.Exit(1) }
