package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

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
Without --queue it looks in every queue asynq knows or that holds locks
(and default), says in which it found a lock, and shows each. Exit status 1 with "no lock" when
the key is free; with --json it prints so too, with state "free".

  --field PATH=VALUE   keys on these JSON paths (dedup.Fields), with the payload
                       made of them: a VALUE that is JSON (42, true, "42", {...})
                       is taken as JSON, anything else as a string
  --payload JSON       keys on the whole payload, or with --fields a,b on those
                       paths of it
  --key K              an explicit key (dedup.Key); with --shared dedup.SharedKey

Give the application's Config.HashKey, if it sets one, through an
environment variable named by --hash-key-env.`,
		bind: func(fs *flag.FlagSet) func(*app, []string) error {
			f := &lockview.KeySpec{}
			var field fieldFlags
			var hashKeyEnv string
			fs.StringVar(&f.Type, "type", "", "task `type`")
			fs.Var(&field, "field", "a key field, `PATH=VALUE` (repeatable)")
			fs.StringVar(&f.Payload, "payload", "", "the task's payload, `JSON`")
			fs.StringVar(&f.Fields, "fields", "", "with --payload: comma-separated `paths` to key on")
			fs.StringVar(&f.Key, "key", "", "an explicit `key`")
			fs.BoolVar(&f.Shared, "shared", false, "with --key: a key shared across types (dedup.SharedKey)")
			fs.StringVar(&f.Queue, "queue", "", "only the task's `queue` (default: every queue asynq knows or that holds locks)")
			fs.StringVar(&hashKeyEnv, "hash-key-env", "", "environment variable `NAME` holding Config.HashKey")
			return func(a *app, _ []string) error {
				f.Field = []string(field)
				return runLookup(a, f, hashKeyEnv)
			}
		},
	}
}

func runLookup(a *app, f *lockview.KeySpec, hashKeyEnv string) error {
	task, opts, err := f.Task()
	if err != nil {
		return err
	}
	var hashKey []byte
	if hashKeyEnv != "" {
		if hashKey = []byte(os.Getenv(hashKeyEnv)); len(hashKey) == 0 {
			return usagef("--hash-key-env: $%s is empty or unset", hashKeyEnv)
		}
	}
	return a.withConn(func(ctx context.Context, c *conn) error {
		found, err := lockview.FindKeyLocks(ctx, c.src(), a.g.prefix, hashKey, task, opts, f.Queue)
		if err != nil {
			return err
		}
		if err := found.Err(); err != nil {
			return a.printFree(found, f.Queue != "", err)
		}
		out := lookupOutput{Searched: found.Searched}
		for _, key := range found.Keys {
			t := &lockview.Target{Key: key}
			l, err := lockview.ReadOne(ctx, c.src(), a.g.prefix, t)
			if err != nil {
				return err
			}
			d, err := lockview.Describe(ctx, c.src(), a.g.prefix, l, t)
			if err != nil {
				return err
			}
			out.Locks = append(out.Locks, d)
		}
		return printLookup(a, out, f.Queue != "")
	})
}

// lookupOutput is what lookup found without --queue: the queues it
// searched and the key's lock in each queue that holds one; for a key
// free in all of them, no locks and State "free".
type lookupOutput struct {
	Searched []string      `json:"searched_queues"`
	Locks    []*showOutput `json:"locks"`
	State    string        `json:"state,omitempty"` // "free" when no queue holds a lock of the key
}

// freeOutput is lookup --json --queue's answer for a key free in that
// queue, in the field names of show --json.
type freeOutput struct {
	Queue string `json:"queue"`
	State string `json:"state"` // "free"
}

// printFree says, with --json, that the key is free where lookup searched
// (as text, err says so on stderr), and returns err, the key being free.
func (a *app) printFree(found *lockview.KeyLocks, oneQueue bool, err error) error {
	if !a.g.json {
		return err
	}
	var out any = lookupOutput{Searched: found.Searched, Locks: []*showOutput{}, State: "free"}
	if oneQueue {
		out = freeOutput{Queue: found.Searched[0], State: "free"}
	}
	if werr := writeJSON(a.stdout, out); werr != nil {
		return werr
	}
	return err
}

// printLookup prints the locks found. With --queue (one queue) it prints
// the lock as show does; else first where it found them.
func printLookup(a *app, out lookupOutput, oneQueue bool) error {
	switch {
	case oneQueue && a.g.json:
		return writeJSON(a.stdout, out.Locks[0])
	case a.g.json:
		return writeJSON(a.stdout, out)
	case !oneQueue:
		queues := make([]string, len(out.Locks))
		for i, l := range out.Locks {
			queues[i] = text(l.Queue)
		}
		fmt.Fprintf(a.stdout, "found in %d of %d queues searched: %s\n", len(out.Locks), len(out.Searched), strings.Join(queues, ", "))
	}
	now := time.Now()
	for i, l := range out.Locks {
		if !oneQueue || i > 0 {
			fmt.Fprintln(a.stdout)
		}
		printShow(a.stdout, l, now)
	}
	return nil
}
