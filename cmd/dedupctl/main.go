// Command dedupctl browses and manages the locks of
// github.com/asynq-dedup/dedup in Redis: it lists the held locks, shows one
// in full with its holder task's state in asynq, force-releases a lock, and
// prints the counters the processes flushed (Dedup.StartFlusher).
//
//	dedupctl [global flags] <command> [flags] [args]
//
// Run "dedupctl -h" for the commands and flags. It reads Redis with SCAN
// (never KEYS), on every master of a Redis Cluster with --cluster.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
	"github.com/asynq-dedup/dedup/internal/store"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// Exit statuses.
const (
	exitOK      = 0
	exitError   = 1 // Redis unreachable, bad URL, no such lock, refused release, ...
	exitUsage   = 2 // unknown command or flag, missing or extra argument, a KEY that is not a lock key
	defaultURL  = "redis://127.0.0.1:6379/0"
	urlEnv      = "DEDUP_REDIS_URL"
	dialTimeout = 2 * time.Second
)

// usageError is a command line the tool cannot make sense of (exit 2).
type usageError = lockview.UsageError

func usagef(format string, args ...any) error { return lockview.Usagef(format, args...) }

// globals are the flags every command accepts, before or after its name.
type globals struct {
	url     string
	cluster bool
	prefix  string
	json    bool
	timeout time.Duration
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.url, "url", g.url, "Redis `URL`: redis://[user:password@]host:port/db, rediss:// for TLS, unix:///path;\nwith --cluster its host part may list seeds: redis://h1:7000,h2:7000;\nthe default comes from env "+urlEnv+" when set")
	fs.BoolVar(&g.cluster, "cluster", g.cluster, "Redis Cluster: --url's hosts are seeds; SCAN runs on every master")
	fs.StringVar(&g.prefix, "prefix", g.prefix, "key `prefix` of the dedup.Config (Config.Prefix)")
	fs.BoolVar(&g.json, "json", g.json, "print one JSON document instead of text")
	fs.DurationVar(&g.timeout, "timeout", g.timeout, "bound on the Redis work of the command")
}

// app is one invocation.
type app struct {
	g      globals
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
}

// command is one subcommand.
type command struct {
	name     string
	synopsis string // after "dedupctl [global flags] <name> "
	summary  string
	help     string
	// bind defines the command's own flags on fs and returns the function
	// that runs it with their values.
	bind    func(fs *flag.FlagSet) func(a *app, args []string) error
	maxArgs int // positional arguments it takes at most
}

var commands []*command // filled by init, in help order

func init() {
	commands = []*command{listCommand(), showCommand(), lookupCommand(), releaseCommand(), doctorCommand(), statsCommand(), serveCommand()}
}

func lookup(name string) *command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return nil
}

// lockKeyForm shows the form of a lock key, in the library's own layout.
var lockKeyForm = store.NewKeys("<prefix>").Lock("<queue>", "<fingerprint>")

// sampleTaskID is a task ID the wrapper would choose for the sample lock.
const sampleTaskID = "dd-5d1e0c8b2f3a4b6c-0123456789abcdef0123"

const topHelp = `dedupctl browses and manages the locks of github.com/asynq-dedup/dedup in Redis.

Usage:
  dedupctl [global flags] <command> [flags] [args]

Commands:
%s
Global flags (also accepted after the command):
%s
Locks are the Redis strings %s, whose value names
the task holding the key; a key whose policy keeps state beside the lock has
a mode record too (…:m:<fingerprint>). Every command reads Redis with SCAN,
never KEYS; with --cluster on every master.

Examples:
  dedupctl list --type email:welcome
  dedupctl --url redis://10.0.0.5:6379/0 --json list --limit 0
  dedupctl --cluster --url redis://10.0.0.1:7000,10.0.0.2:7000 stats
  dedupctl show '%[4]s'
  dedupctl show --task %[5]s --queue critical
  dedupctl release --yes '%[4]s'

Exit status: 0 done, 1 error (Redis unreachable, bad --url, no such lock,
release refused or declined), 2 usage error (a bad flag or argument, a KEY
that is not a lock key).
Run "dedupctl <command> -h" for a command's flags.
`

func (a *app) topUsage(w io.Writer) {
	var cmds strings.Builder
	for _, c := range commands {
		fmt.Fprintf(&cmds, "  %-8s %s\n", c.name, c.summary)
	}
	sample := store.NewKeys("dedup").Lock("critical", "5d1e0c8b2f3a4b6c")
	fmt.Fprintf(w, topHelp, cmds.String(), globalDefaults(), lockKeyForm, sample, sampleTaskID)
}

func (a *app) commandUsage(w io.Writer, c *command) {
	fmt.Fprintf(w, "Usage: dedupctl [global flags] %s %s\n\n%s\n", c.name, c.synopsis, c.help)
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	c.bind(fs)
	if own := flagDefaults(fs); own != "" {
		fmt.Fprintf(w, "\nFlags:\n%s", own)
	}
	fmt.Fprintf(w, "\nGlobal flags:\n%s", globalDefaults())
}

// globalDefaults documents the global flags with their built-in defaults
// (never the values in use, which may hold a password).
func globalDefaults() string {
	fs := flag.NewFlagSet("dedupctl", flag.ContinueOnError)
	g := defaultGlobals()
	g.register(fs)
	return flagDefaults(fs)
}

// flagDefaults is flag.PrintDefaults with GNU-style "--name".
func flagDefaults(fs *flag.FlagSet) string {
	var b strings.Builder
	fs.VisitAll(func(f *flag.Flag) {
		name, usage := flag.UnquoteUsage(f)
		fmt.Fprintf(&b, "  --%s", f.Name)
		if name != "" {
			fmt.Fprintf(&b, " %s", name)
		}
		b.WriteString("\n    \t")
		b.WriteString(strings.ReplaceAll(usage, "\n", "\n    \t"))
		switch {
		case f.DefValue == "" || f.DefValue == "false" || f.DefValue == "0":
		case fmt.Sprintf("%T", f.Value) == "*flag.stringValue":
			fmt.Fprintf(&b, " (default %q)", f.DefValue)
		default:
			fmt.Fprintf(&b, " (default %s)", f.DefValue)
		}
		b.WriteString("\n")
	})
	return b.String()
}

func defaultGlobals() globals {
	return globals{url: defaultURL, prefix: "dedup", timeout: 30 * time.Second}
}

// run is main without the process: it returns the exit status.
func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := newApp(stdin, stdout, stderr)
	line, status, ok := a.parseGlobals(args)
	if !ok {
		return status
	}
	name, rest := line[0], line[1:]
	if name == "help" {
		return a.help(rest)
	}
	c := lookup(name)
	if c == nil {
		fmt.Fprintf(a.stderr, "dedupctl: unknown command %q (commands: %s)\nRun \"dedupctl -h\" for usage.\n", name, commandNames())
		return exitUsage
	}
	return a.runCommand(c, rest)
}

// newApp starts from the built-in globals; $DEDUP_REDIS_URL only moves the
// default, so --url still wins.
func newApp(stdin io.Reader, stdout, stderr io.Writer) *app {
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr, g: defaultGlobals()}
	if v := os.Getenv(urlEnv); v != "" {
		a.g.url = v
	}
	return a
}

// quietFlagSet returns a flag set that prints nothing: the usage and
// the errors are printed by dedupctl, in its own form.
func quietFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parseGlobals parses the global flags before the command and returns the
// command line from the command's name on. When there is no command to run
// (-h, a bad flag, no command) it has said so, and ok is false with the
// exit status.
func (a *app) parseGlobals(args []string) (line []string, status int, ok bool) {
	top := quietFlagSet("dedupctl")
	a.g.register(top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			a.topUsage(a.stdout)
			return nil, exitOK, false
		}
		fmt.Fprintf(a.stderr, "dedupctl: %v\nRun \"dedupctl -h\" for usage.\n", err)
		return nil, exitUsage, false
	}
	if top.NArg() == 0 {
		fmt.Fprintln(a.stderr, "dedupctl: no command given")
		a.topUsage(a.stderr)
		return nil, exitUsage, false
	}
	return top.Args(), exitOK, true
}

// help runs "dedupctl help [command]"; arguments after the command are
// ignored.
func (a *app) help(args []string) int {
	if len(args) == 0 {
		a.topUsage(a.stdout)
		return exitOK
	}
	c := lookup(args[0])
	if c == nil {
		fmt.Fprintf(a.stderr, "dedupctl help: unknown command %q (commands: %s)\n", args[0], commandNames())
		return exitUsage
	}
	a.commandUsage(a.stdout, c)
	return exitOK
}

// runCommand parses c's command line, runs c and returns the exit status.
func (a *app) runCommand(c *command, args []string) int {
	exec, pos, err := a.parseCommand(c, args)
	if errors.Is(err, flag.ErrHelp) {
		a.commandUsage(a.stdout, c)
		return exitOK
	}
	if err != nil {
		return a.usageFailed(c, err)
	}
	if err := exec(a, pos); err != nil {
		var ue *usageError
		if errors.As(err, &ue) {
			return a.usageFailed(c, err)
		}
		fmt.Fprintf(a.stderr, "dedupctl %s: %v\n", c.name, err)
		return exitError
	}
	return exitOK
}

// parseCommand parses c's own flags and the global ones, which may come
// before, between or after its arguments, and checks them all. It returns
// the function that runs c and c's positional arguments.
func (a *app) parseCommand(c *command, args []string) (func(*app, []string) error, []string, error) {
	fs := quietFlagSet(c.name)
	exec := c.bind(fs)
	a.g.register(fs)
	pos, err := parseInterleaved(fs, args)
	if err == nil {
		err = checkArgs(c, pos)
	}
	if err == nil {
		err = a.checkGlobals()
	}
	return exec, pos, err
}

// usageFailed reports a command line c cannot run and points to its help.
func (a *app) usageFailed(c *command, err error) int {
	fmt.Fprintf(a.stderr, "dedupctl %s: %v\nRun \"dedupctl %s -h\" for usage.\n", c.name, err, c.name)
	return exitUsage
}

func commandNames() string {
	names := make([]string, len(commands))
	for i, c := range commands {
		names[i] = c.name
	}
	return strings.Join(names, ", ")
}

// parseInterleaved parses flags placed before, between and after the
// positional arguments ("release KEY --yes"); "--" ends the flags.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func checkArgs(c *command, pos []string) error {
	switch {
	case len(pos) > c.maxArgs && c.maxArgs == 0:
		return usagef("takes no arguments, got %q", pos)
	case len(pos) > c.maxArgs:
		return usagef("too many arguments: %q", pos[c.maxArgs:])
	}
	return nil
}

func (a *app) checkGlobals() error {
	if a.g.prefix == "" {
		return usagef("--prefix is empty")
	}
	if strings.ContainsAny(a.g.prefix, "{}") {
		return usagef("--prefix %q contains a brace: dedup prefixes cannot", a.g.prefix)
	}
	if a.g.timeout <= 0 {
		return usagef("--timeout must be positive, got %v", a.g.timeout)
	}
	return nil
}

// ctx returns a context bounded by --timeout.
func (a *app) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), a.g.timeout)
}

// withConn runs fn with a connection, under the command's timeout.
func (a *app) withConn(fn func(ctx context.Context, c *conn) error) error {
	ctx, cancel := a.ctx()
	defer cancel()
	c, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer c.close()
	c.within(ctx)
	return fn(ctx, c)
}

// withLock runs fn with the lock that args and s select.
func (a *app) withLock(args []string, s selector, fn func(ctx context.Context, c *conn, t *lockview.Target, l *lockInfo) error) error {
	key, err := a.byKey(args, s)
	if err != nil {
		return err
	}
	return a.withConn(func(ctx context.Context, c *conn) error {
		t, err := a.resolve(ctx, c, key, s)
		if err != nil {
			return err
		}
		l, err := lockview.ReadOne(ctx, c.src(), a.g.prefix, t)
		if err != nil {
			return err
		}
		return fn(ctx, c, t, l)
	})
}

// connect parses --url and checks that Redis answers.
func (a *app) connect(ctx context.Context) (*conn, error) {
	c, err := dial(a.g.url, a.g.cluster, a.g.timeout)
	if err != nil {
		return nil, err
	}
	if err := c.ping(ctx); err != nil {
		_ = c.close()
		return nil, err
	}
	return c, nil
}
