package lockview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/jsonkey"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// KeySpec says which key to find: a task type and the key choice an
// enqueue would make (the options of dedup.Lookup). Exactly one of Field,
// Payload and Key is given.
type KeySpec struct {
	Type    string
	Field   []string // PATH=VALUE pairs: the payload is made of them, keyed on the paths
	Payload string   // the whole payload, JSON
	Fields  string   // with Payload: comma-separated paths to key on
	Key     string   // an explicit key (dedup.Key)
	Shared  bool     // with Key: dedup.SharedKey
	Queue   string   // "" is "default"
}

// Task makes the task and the key options the spec describes; its errors
// are *UsageError.
func (f *KeySpec) Task() (*asynq.Task, []asynq.Option, error) {
	if strings.TrimSpace(f.Type) == "" {
		return nil, nil, Usagef("--type is required")
	}
	given := 0
	for _, set := range []bool{len(f.Field) > 0, f.Payload != "", f.Key != ""} {
		if set {
			given++
		}
	}
	switch {
	case given != 1:
		return nil, nil, Usagef("give one of --field, --payload or --key")
	case f.Fields != "" && f.Payload == "":
		return nil, nil, Usagef("--fields goes with --payload")
	case f.Shared && f.Key == "":
		return nil, nil, Usagef("--shared goes with --key")
	}
	queue := f.Queue
	if queue == "" {
		queue = "default"
	}
	opts := []asynq.Option{asynq.Queue(queue)}
	switch {
	case f.Key != "" && f.Shared:
		return asynq.NewTask(f.Type, nil), append(opts, dedup.SharedKey(f.Key)), nil
	case f.Key != "":
		return asynq.NewTask(f.Type, nil), append(opts, dedup.Key(f.Key)), nil
	case f.Payload != "" && f.Fields != "":
		paths := strings.Split(f.Fields, ",")
		return asynq.NewTask(f.Type, []byte(f.Payload)), append(opts, dedup.Fields(paths...)), CheckFields([]byte(f.Payload), paths)
	case f.Payload != "":
		return asynq.NewTask(f.Type, []byte(f.Payload)), opts, nil
	}
	payload, paths, err := PayloadOf(f.Field)
	if err == nil {
		err = CheckFields(payload, paths)
	}
	return asynq.NewTask(f.Type, payload), append(opts, dedup.Fields(paths...)), err
}

// KeyLocks are the locks of one key that FindKeyLocks found.
type KeyLocks struct {
	Searched []string // the queues looked in, sorted
	Keys     []string // the lock keys found, in the order of Searched
}

// Err says, when no lock was found, that the key is free in the queues
// searched; nil when one was.
func (k *KeyLocks) Err() error {
	switch {
	case len(k.Keys) > 0:
		return nil
	case len(k.Searched) == 1:
		return fmt.Errorf("no lock: the key is free in queue %s", Printable(k.Searched[0]))
	}
	names := make([]string, len(k.Searched))
	for i, q := range k.Searched {
		names[i] = Printable(q)
	}
	return fmt.Errorf("no lock: the key is free in every queue (%d searched: %s)", len(names), strings.Join(names, ", "))
}

// Printable is a name read from Redis (a type, a queue, an ID, a key) as
// one visible token: with a control character (a newline, a tab) it is
// quoted, so that it can neither forge lines nor columns.
func Printable(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

// FindKeyLocks finds, through Dedup.Lookup, the locks task would take with
// opts: in queue, or, for "", in each queue asynq knows, each queue that
// holds locks of prefix, and "default" (the key is the same in each queue,
// its lock the queue's own).
func FindKeyLocks(ctx context.Context, src Source, prefix string, hashKey []byte, task *asynq.Task, opts []asynq.Option, queue string) (*KeyLocks, error) {
	out := &KeyLocks{Searched: []string{queue}}
	if queue == "" {
		all, err := AsynqQueues(ctx, src)
		if err != nil {
			return nil, err
		}
		held, err := LockQueues(ctx, src, prefix)
		if err != nil {
			return nil, err
		}
		all = append(append(all, held...), "default")
		slices.Sort(all)
		out.Searched = slices.Compact(all)
	}
	d, err := lookupDedup(ctx, src.RDB, prefix, hashKey)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	for _, q := range out.Searched {
		key, err := lookupKey(ctx, d, task, append(slices.Clip(opts), asynq.Queue(q))) // the last asynq.Queue wins
		if err != nil {
			return nil, err
		}
		if key != "" {
			out.Keys = append(out.Keys, key)
		}
	}
	return out, nil
}

// lookupDedup is a Dedup to look keys up with: it takes no lock.
func lookupDedup(ctx context.Context, rdb redis.UniversalClient, prefix string, hashKey []byte) (*dedup.Dedup, error) {
	return dedup.New(ctx, rdb, dedup.Config{Prefix: prefix, HashKey: hashKey,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
}

// lookupKey is the key of the lock task would take with opts, through
// d.Lookup; "" when the key is free.
func lookupKey(ctx context.Context, d *dedup.Dedup, task *asynq.Task, opts []asynq.Option) (string, error) {
	kl, found, err := d.Lookup(ctx, task, opts...)
	if errors.Is(err, dedup.ErrInvalidPayload) || errors.Is(err, dedup.ErrInvalidOption) {
		return "", Usagef("%v", err) // what CheckFields cannot see (a number out of range)
	}
	if err != nil || !found {
		return "", err
	}
	return kl.Key, nil
}

// CheckFields refuses, before Redis is asked, paths that are not paths and
// a payload the key cannot be taken from (not JSON, a field missing).
func CheckFields(payload []byte, paths []string) error {
	fs, err := jsonkey.Compile(paths)
	if err != nil {
		return Usagef("%v", err)
	}
	var spans [jsonkey.MaxFields]jsonkey.Span
	if err := jsonkey.Select(payload, fs, &spans); err != nil {
		return Usagef("the payload: %v", err)
	}
	for i, p := range fs.Paths() {
		sp := spans[i]
		if sp.End == 0 {
			return Usagef("the payload has no field %q", p)
		}
		if _, err := jsonkey.AppendCanonical(nil, payload[sp.Start:sp.End]); err != nil {
			return Usagef("field %q: %v", p, err)
		}
	}
	return nil
}

// PayloadOf builds a JSON payload from PATH=VALUE pairs (dotted paths
// nest), and returns it with the paths in order. A VALUE that is JSON is
// taken as JSON, anything else as a string.
func PayloadOf(pairs []string) ([]byte, []string, error) {
	if len(pairs) > jsonkey.MaxFields {
		return nil, nil, Usagef("%d fields given, at most %d", len(pairs), jsonkey.MaxFields)
	}
	root := map[string]any{}
	paths := make([]string, 0, len(pairs))
	for _, p := range pairs {
		path, value, ok := strings.Cut(p, "=")
		if !ok || path == "" {
			return nil, nil, Usagef("--field %q: want PATH=VALUE", p)
		}
		// Bounded before the objects are made: a path of a million dots
		// would nest as many, and encoding them overflows the stack.
		if n := strings.Count(path, ".") + 1; n > jsonkey.MaxDepth {
			return nil, nil, Usagef("--field: a path of %d segments, at most %d", n, jsonkey.MaxDepth)
		}
		var v any = value
		if json.Valid([]byte(value)) {
			v = json.RawMessage(value)
		}
		if err := put(root, strings.Split(path, "."), v); err != nil {
			return nil, nil, Usagef("--field %q: %v", p, err)
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
