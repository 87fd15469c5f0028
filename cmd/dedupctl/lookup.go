package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/hibiken/asynq"
)

// lookupFlags say which key to find: a task type and the key choice an
// enqueue would make (the options of dedup.Lookup).
type lookupFlags struct {
	typ, payload, fields, key, queue, hashKeyEnv string
	shared                                       bool
	field                                        fieldFlags
}

// fieldFlags collects repeated --field PATH=VALUE flags.
type fieldFlags []string

func (f *fieldFlags) String() string     { return strings.Join(*f, " ") }
func (f *fieldFlags) Set(v string) error { *f = append(*f, v); return nil }

func lookupCommand() *command {
	return &command{
		name:     "lookup",
		synopsis: "--type T (--field PATH=VALUE ... | --payload JSON [--fields a,b] | --key K [--shared]) [--queue Q]",
		summary:  "the lock a task of type T with that key would take, found by its key (as Dedup.Lookup)",
		help: `Finds a lock by what it is about: the task type and the key an enqueue of
that task would choose, as Dedup.Lookup does, and shows it as show does.
Exit status 1 with "no lock" when the key is free.

  --field PATH=VALUE   keys on these JSON paths (dedup.Fields), with the payload
                       made of them: a VALUE that is JSON (42, true, "42", {...})
                       is taken as JSON, anything else as a string
  --payload JSON       keys on the whole payload, or with --fields a,b on those
                       paths of it
  --key K              an explicit key (dedup.Key); with --shared dedup.SharedKey

Give the application's Config.HashKey, if it sets one, through an
environment variable named by --hash-key-env.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			f := &lookupFlags{}
			fs.StringVar(&f.typ, "type", "", "task `type`")
			fs.Var(&f.field, "field", "a key field, `PATH=VALUE` (repeatable)")
			fs.StringVar(&f.payload, "payload", "", "the task's payload, `JSON`")
			fs.StringVar(&f.fields, "fields", "", "with --payload: comma-separated `paths` to key on")
			fs.StringVar(&f.key, "key", "", "an explicit `key`")
			fs.BoolVar(&f.shared, "shared", false, "with --key: a key shared across types (dedup.SharedKey)")
			fs.StringVar(&f.queue, "queue", "default", "the task's `queue`")
			fs.StringVar(&f.hashKeyEnv, "hash-key-env", "", "environment variable `NAME` holding Config.HashKey")
			return func(a *app, _ []string) error { return runLookup(a, f) }
		},
	}
}

func runLookup(a *app, f *lookupFlags) error {
	task, opts, err := f.task()
	if err != nil {
		return err
	}
	var hashKey []byte
	if f.hashKeyEnv != "" {
		if hashKey = []byte(os.Getenv(f.hashKeyEnv)); len(hashKey) == 0 {
			return usagef("--hash-key-env: $%s is empty or unset", f.hashKeyEnv)
		}
	}
	return a.withConn(func(ctx context.Context, c *conn) error {
		key, err := lockKey(ctx, c, a.g.prefix, hashKey, task, opts)
		if err != nil {
			return err
		}
		if key == "" {
			return errors.New("no lock: the key is free")
		}
		t := &target{key: key}
		l, err := readOne(ctx, c, a.g.prefix, t)
		if err != nil {
			return err
		}
		out, err := describe(ctx, c, a.g.prefix, l, t)
		if err != nil {
			return err
		}
		if a.g.json {
			return writeJSON(a.stdout, out)
		}
		printShow(a.stdout, out, time.Now())
		return nil
	})
}

// lockKey finds, through Dedup.Lookup, the lock key task would take with
// opts; "" when the key is free.
func lockKey(ctx context.Context, c *conn, prefix string, hashKey []byte, task *asynq.Task, opts []asynq.Option) (string, error) {
	d, err := dedup.New(ctx, c.rdb, dedup.Config{Prefix: prefix, HashKey: hashKey, ConnectAttempts: 1,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return "", err
	}
	defer d.Close()
	kl, found, err := d.Lookup(ctx, task, opts...)
	if errors.Is(err, dedup.ErrInvalidPayload) || errors.Is(err, dedup.ErrInvalidOption) {
		return "", usagef("%v", err) // what checkFields cannot see (a number out of range)
	}
	if err != nil || !found {
		return "", err
	}
	return kl.Key, nil
}

// task makes the task and the key options the flags describe.
func (f *lookupFlags) task() (*asynq.Task, []asynq.Option, error) {
	if strings.TrimSpace(f.typ) == "" {
		return nil, nil, usagef("--type is required")
	}
	given := 0
	for _, set := range []bool{len(f.field) > 0, f.payload != "", f.key != ""} {
		if set {
			given++
		}
	}
	switch {
	case given != 1:
		return nil, nil, usagef("give one of --field, --payload or --key")
	case f.fields != "" && f.payload == "":
		return nil, nil, usagef("--fields goes with --payload")
	case f.shared && f.key == "":
		return nil, nil, usagef("--shared goes with --key")
	}
	opts := []asynq.Option{asynq.Queue(f.queue)}
	switch {
	case f.key != "" && f.shared:
		return asynq.NewTask(f.typ, nil), append(opts, dedup.SharedKey(f.key)), nil
	case f.key != "":
		return asynq.NewTask(f.typ, nil), append(opts, dedup.Key(f.key)), nil
	case f.payload != "" && f.fields != "":
		paths := strings.Split(f.fields, ",")
		return asynq.NewTask(f.typ, []byte(f.payload)), append(opts, dedup.Fields(paths...)), checkFields([]byte(f.payload), paths)
	case f.payload != "":
		return asynq.NewTask(f.typ, []byte(f.payload)), opts, nil
	}
	payload, paths, err := payloadOf(f.field)
	if err == nil {
		err = checkFields(payload, paths)
	}
	return asynq.NewTask(f.typ, payload), append(opts, dedup.Fields(paths...)), err
}

// checkFields refuses, before Redis is asked, paths that are not paths and
// a payload the key cannot be taken from (not JSON, a field missing).
func checkFields(payload []byte, paths []string) error {
	fs, err := jsonkey.Compile(paths)
	if err != nil {
		return usagef("%v", err)
	}
	var spans [jsonkey.MaxFields]jsonkey.Span
	if err := jsonkey.Select(payload, fs, &spans); err != nil {
		return usagef("the payload: %v", err)
	}
	for i, p := range fs.Paths() {
		sp := spans[i]
		if sp.End == 0 {
			return usagef("the payload has no field %q", p)
		}
		if _, err := jsonkey.AppendCanonical(nil, payload[sp.Start:sp.End]); err != nil {
			return usagef("field %q: %v", p, err)
		}
	}
	return nil
}

// payloadOf builds a JSON payload from PATH=VALUE pairs (dotted paths
// nest), and returns it with the paths in order.
func payloadOf(pairs []string) ([]byte, []string, error) {
	root := map[string]any{}
	paths := make([]string, 0, len(pairs))
	for _, p := range pairs {
		path, value, ok := strings.Cut(p, "=")
		if !ok || path == "" {
			return nil, nil, usagef("--field %q: want PATH=VALUE", p)
		}
		var v any = value
		if json.Valid([]byte(value)) {
			v = json.RawMessage(value)
		}
		if err := put(root, strings.Split(path, "."), v); err != nil {
			return nil, nil, usagef("--field %q: %v", p, err)
		}
		paths = append(paths, path)
	}
	b, err := json.Marshal(root)
	return b, paths, err
}

// put sets the member at path in m, making the objects on the way.
func put(m map[string]any, path []string, v any) error {
	for _, name := range path[:len(path)-1] {
		next, ok := m[name].(map[string]any)
		if !ok {
			if _, taken := m[name]; taken {
				return fmt.Errorf("%s is a value, not an object", name)
			}
			next = map[string]any{}
			m[name] = next
		}
		m = next
	}
	last := path[len(path)-1]
	if _, taken := m[last]; taken {
		return fmt.Errorf("%s given twice, or as an object and a value", last)
	}
	m[last] = v
	return nil
}
