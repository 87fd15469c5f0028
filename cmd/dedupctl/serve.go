package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/asynq-dedup/dedup/dedupweb"
)

type serveFlags struct {
	listen       string
	root         string
	asynqmon     string
	allowRelease bool
	grace        time.Duration
}

func serveCommand() *command {
	return &command{
		name:     "serve",
		synopsis: "[--listen ADDR] [--allow-release] [--root PATH] [--asynqmon URL]",
		summary:  "serve the lock browser (package dedupweb) over HTTP; read-only unless --allow-release",
		help: `Serves the web lock browser of package dedupweb: the locks by queue, type
and state, the counters of the last hour, each lock in full, search, and the
doctor. It is read-only unless --allow-release: then a lock page offers a
holder-checked release, and the doctor page a release of what it found, each
by POST with a CSRF token after a confirmation page.

It has no authentication of its own: keep --listen on a loopback address (the
default) or put it behind a proxy that authenticates. --timeout bounds the
Redis work of each request. It runs until interrupted (SIGINT, SIGTERM).`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			o := &serveFlags{}
			fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "`address` to listen on")
			fs.StringVar(&o.root, "root", "", "URL `path` to serve under, such as /dedup")
			fs.StringVar(&o.asynqmon, "asynqmon", "", "asynqmon's root `URL`, to link tasks to it")
			fs.BoolVar(&o.allowRelease, "allow-release", false, "allow releasing locks from the pages")
			fs.DurationVar(&o.grace, "grace", time.Minute, "the doctor leaves orphans younger than this alone (the library's heal grace, 1 minute)")
			return func(a *app, _ []string) error { return runServe(a, o) }
		},
	}
}

func runServe(a *app, o *serveFlags) error {
	ctx, cancel := a.ctx()
	c, err := a.connect(ctx)
	cancel()
	if err != nil {
		return err
	}
	defer c.close()
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	h := dedupweb.New(c.rdb, dedupweb.Options{RootPath: o.root, Prefix: a.g.prefix, AllowRelease: o.allowRelease,
		AsynqmonRoot: o.asynqmon, DoctorGrace: o.grace, Timeout: a.g.timeout,
		Logger: slog.New(slog.NewTextHandler(a.stderr, nil))})
	mode := "read-only"
	if o.allowRelease {
		mode = "releases allowed"
	}
	fmt.Fprintf(a.stdout, "dedupctl serve: http://%s%s/ (%s, prefix %q)\n", ln.Addr(), o.root, mode, a.g.prefix)
	return serve(ln, h)
}

// serve serves h on ln until SIGINT or SIGTERM, then shuts down.
func serve(ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(stop)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-stop:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
