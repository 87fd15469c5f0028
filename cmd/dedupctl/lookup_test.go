package main

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// An on-call engineer goes from "user 42" to the lock: by fields, by the
// whole payload with fields chosen from it, and by an explicit key; a key
// with modes (here a fail hold, MaxPending) shows how it was chosen
// (field names, never values), from its mode record.
func TestLookupFindsTheLockByTypeAndKey(t *testing.T) {
	f := newFixture(t, dedup.Config{OptIn: true, Rules: map[string]dedup.Rule{
		"email:welcome": {Fields: []string{"user_id", "tenant.id"}, OnFailure: dedup.FailHold, FailHoldFor: time.Hour},
		"report:build":  {Key: "nightly", MaxPending: 10},
	}})
	ctx := context.Background()
	welcome, err := f.client.EnqueueContext(ctx, asynq.NewTask("email:welcome",
		[]byte(`{"user_id":42,"tenant":{"id":"t7"},"trace":"x"}`)), asynq.Queue(f.qa))
	if err != nil {
		t.Fatal(err)
	}
	report, err := f.client.EnqueueContext(ctx, asynq.NewTask("report:build", []byte("any")), asynq.Queue(f.qb))
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"lookup", "--type", "email:welcome", "--field", "user_id=42", "--field", "tenant.id=t7", "--queue", f.qa},
		{"lookup", "--type", "email:welcome", "--field", "tenant.id=\"t7\"", "--field", "user_id=42.0", "--queue", f.qa},
		{"lookup", "--type", "email:welcome", "--payload", `{"user_id":42,"tenant":{"id":"t7"},"trace":"y"}`, "--fields", "user_id,tenant.id", "--queue", f.qa},
	} {
		r := f.ok(args...)
		for _, want := range []string{"holder           " + welcome.ID, "type             email:welcome", "keyed on         fields tenant.id, user_id", "state            waiting"} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("%q: no %q in\n%s", args, want, r.stdout)
			}
		}
		if strings.Contains(r.stdout, "t7") {
			t.Errorf("%q: a key's value is shown:\n%s", args, r.stdout)
		}
	}
	r := f.ok("--json", "lookup", "--type", "report:build", "--key", "nightly", "--queue", f.qb)
	var out showOutput
	if err := json.Unmarshal([]byte(r.stdout), &out); err != nil {
		t.Fatalf("--json: %v\n%s", err, r.stdout)
	}
	if out.Holder != report.ID || out.KeyedOn != "key (explicit)" || out.Type != "report:build" {
		t.Errorf("--json: holder %q keyed on %q type %q, want %s, key (explicit), report:build", out.Holder, out.KeyedOn, out.Type, report.ID)
	}
	f.fail(exitError, "no lock: the key is free", "", "lookup", "--type", "email:welcome", "--field", "user_id=43", "--field", "tenant.id=t7", "--queue", f.qa)
	f.fail(exitError, "no lock: the key is free", "", "lookup", "--type", "email:welcome", "--field", "user_id=\"42\"", "--field", "tenant.id=t7", "--queue", f.qa)
}

// Without --queue, lookup looks in every queue asynq knows: it finds a lock
// held in a queue other than default, says in which queues it found the
// key's locks, shows each, and says where it looked when the key is free.
func TestLookupWithoutQueueFindsTheLockInAnyQueue(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	a := f.enqueue(f.qa, "email:welcome", 42)
	lookup := []string{"lookup", "--type", "email:welcome", "--field", "user_id=42"}
	r := f.ok(lookup...)
	for _, want := range []string{"found in 1 of ", " queues searched: " + f.qa + "\n\nkey ",
		"queue            " + f.qa + "\n", "holder           " + a.ID + "\n"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("lookup of a lock in queue %s lacks %q:\n%s", f.qa, want, r.stdout)
		}
	}
	// The same key in a second queue is a lock of its own: both are shown.
	b := f.enqueue(f.qb, "email:welcome", 42)
	r = f.ok(lookup...)
	if want := "found in 2 of "; !strings.Contains(r.stdout, want) || !strings.Contains(r.stdout, " queues searched: "+f.qa+", "+f.qb+"\n") {
		t.Errorf("lookup of the key's locks in %s and %s:\n%s", f.qa, f.qb, r.stdout)
	}
	for _, id := range []string{a.ID, b.ID} {
		if !strings.Contains(r.stdout, "holder           "+id+"\n") {
			t.Errorf("lookup lacks the lock owned by %s:\n%s", id, r.stdout)
		}
	}
	o := decode[lookupOutput](t, f.ok(append([]string{"--json"}, lookup...)...))
	if len(o.Locks) != 2 || o.Locks[0].Queue != f.qa || o.Locks[0].Holder != a.ID || o.Locks[1].Queue != f.qb || o.Locks[1].Holder != b.ID {
		t.Errorf("lookup --json: %+v", o.Locks)
	}
	for _, q := range []string{f.qa, f.qb, "default"} {
		if !slices.Contains(o.Searched, q) {
			t.Errorf("lookup --json: searched %v, not %s", o.Searched, q)
		}
	}
	// --queue narrows the search to that queue, and prints the lock as show does.
	r = f.ok(append(lookup, "--queue", f.qb)...)
	if !strings.HasPrefix(r.stdout, "key ") || !strings.Contains(r.stdout, "holder           "+b.ID+"\n") || strings.Contains(r.stdout, a.ID) {
		t.Errorf("lookup --queue %s:\n%s", f.qb, r.stdout)
	}
	r = f.fail(exitError, "no lock: the key is free in every queue (", "", "lookup", "--type", "email:welcome", "--field", "user_id=43")
	if !strings.Contains(r.stderr, f.qa) || !strings.Contains(r.stderr, "default") {
		t.Errorf("a free key's lookup does not say where it looked: %s", r.stderr)
	}
	f.fail(exitError, "no lock: the key is free in queue "+f.qa, "", "lookup", "--type", "email:welcome", "--field", "user_id=43", "--queue", f.qa)
	// A queue asynq no longer lists (removed while a lock of it stayed: a
	// fail hold, a cooldown) is searched too: it holds a lock.
	if err := f.rdb.SRem(context.Background(), "asynq:queues", f.qb).Err(); err != nil {
		t.Fatal(err)
	}
	if r = f.ok(lookup...); !strings.Contains(r.stdout, "holder           "+b.ID+"\n") {
		t.Errorf("lookup misses the lock of queue %s, which asynq no longer lists:\n%s", f.qb, r.stdout)
	}
}

// lookup --json of a free key prints what it found, in the field names of
// a held key's JSON: with --queue, the queue and the state "free" (the
// word the text output uses, "no lock: the key is free"); without, the
// queues searched, no locks and the state "free". The exit status and the
// message on stderr stay those of the text output (1, "no lock").
func TestLookupJSONOfAFreeKeySaysItIsFree(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	f.enqueue(f.qa, "email:welcome", 42)
	free := []string{"--json", "lookup", "--type", "email:welcome", "--field", "user_id=43"}
	r := f.fail(exitError, "no lock: the key is free in queue "+f.qa, "", append(free, "--queue", f.qa)...)
	var one map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &one); err != nil {
		t.Fatalf("lookup --json --queue of a free key: %v\n%v", err, r)
	}
	if want := map[string]any{"queue": f.qa, "state": "free"}; !reflect.DeepEqual(one, want) {
		t.Errorf("lookup --json --queue of a free key: %v, want %v", one, want)
	}
	r = f.fail(exitError, "no lock: the key is free in every queue (", "", free...)
	all := decode[lookupOutput](t, r)
	if all.State != "free" || all.Locks == nil || len(all.Locks) != 0 || !slices.Contains(all.Searched, f.qa) || !slices.Contains(all.Searched, "default") {
		t.Errorf("lookup --json of a free key: %+v, want state free, locks [], the queues searched\n%v", all, r)
	}
	// A held key's JSON has no state "free": without --queue, no state at all.
	held := f.ok("--json", "lookup", "--type", "email:welcome", "--field", "user_id=42")
	if o := decode[lookupOutput](t, held); o.State != "" || len(o.Locks) != 1 {
		t.Errorf("lookup --json of a held key: %+v", o)
	}
}

// A plain lock (a key whose policy acts only at enqueue) has no mode
// record: lookup and show say so, print no key form, and say what asynq
// says of its holder: its state, and its type from its record.
func TestShowOfAPlainLockSaysItsHoldersStateFromAsynq(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info := f.enqueue(f.qa, "email:plain", 42)
	want := []string{"type             email:plain", "keyed on         -", "state            waiting",
		"holder           " + info.ID, "holder in asynq  pending (retried 0/25)",
		"mode record      none: a plain lock, whose state is its holder's in asynq"}
	for _, args := range [][]string{{"show", f.lockOf(info)}, {"lookup", "--type", "email:plain", "--field", "user_id=42", "--queue", f.qa}} {
		r := f.ok(args...)
		for _, w := range want {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("%s lacks %q:\n%s", args[0], w, r.stdout)
			}
		}
		if strings.Contains(r.stdout, "\nfields ") {
			t.Errorf("%s prints mode record fields of a plain lock:\n%s", args[0], r.stdout)
		}
	}
	o := decode[showOutput](t, f.ok("--json", "show", f.lockOf(info)))
	if o.Type != "email:plain" || o.KeyedOn != "" || o.ModeKey != "" || o.Fields != nil || o.HolderTask.State != "pending" || o.TaskState != "pending" {
		t.Errorf("show --json of a plain lock: %+v / %+v", o.Info, o.HolderTask)
	}
	// Its holder runs, then fails with retries left: the lock's state is the
	// holder's, read from asynq each time.
	srv := asynq.NewServerFromRedisClient(f.rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{f.qa: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, IsFailure: dedup.IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
	if err := srv.Start(f.d.Middleware()(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return errors.New("later") }))); err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	f.waitState(f.lockOf(info), "retry-wait")
	r := f.ok("show", f.lockOf(info))
	if !strings.Contains(r.stdout, "state            retry-wait") || !strings.Contains(r.stdout, "holder in asynq  retry (retried 1/25, runs in ") {
		t.Errorf("show of a plain lock whose holder waits for its retry:\n%s", r.stdout)
	}
}

// show and lookup print a key's policies in words only: what it does while
// its task runs, a cooldown, a fail hold, a period's window, the waiting
// set; never the mode record's codes (its fields are --json's).
func TestShowPrintsPoliciesInWordsOnly(t *testing.T) {
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build":  {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
		"report:live":   {Fields: []string{"user_id"}, OnRunning: dedup.RunningAllow},
		"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour},
		"crm:sync":      {Fields: []string{"user_id"}, OnFailure: dedup.FailHoldUntilReleased, MaxPending: 3},
		"stats:daily":   {Fields: []string{"user_id"}, Period: 24 * time.Hour},
	}})
	for typ, want := range map[string][]string{
		"report:build":  {"while running    defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends\n"},
		"report:live":   {"while running    allow: the key frees when its task starts, so a duplicate enqueued while it runs is a new task\n"},
		"digest:weekly": {"cooldown left    59m"},
		"crm:sync":      {"on failure       hold until released\n", "waiting set      "},
		"stats:daily":   {"window           "},
	} {
		info := f.enqueue(f.qa, typ, 1)
		o := decode[showOutput](t, f.ok("--json", "show", f.lockOf(info)))
		if len(o.Fields) == 0 {
			t.Fatalf("%s: the lock has no mode record to print", typ)
		}
		cmds := [][]string{{"show", f.lockOf(info)}, {"lookup", "--type", typ, "--field", "user_id=1", "--queue", f.qa}}
		if typ == "stats:daily" {
			cmds = cmds[:1] // a period key is the window's too: dedupctl, which knows no rule, cannot build it
		}
		for _, args := range cmds {
			r := f.ok(args...)
			for _, w := range want {
				if !strings.Contains(r.stdout, w) {
					t.Errorf("%s of %s lacks %q:\n%s", args[0], typ, w, r.stdout)
				}
			}
			for k, v := range o.Fields {
				if strings.Contains(r.stdout, k+"="+v) {
					t.Errorf("%s of %s prints the mode record's field %s=%s:\n%s", args[0], typ, k, v, r.stdout)
				}
			}
			if regexp.MustCompile(`running policy|\([ad]\)|\nfields `).MatchString(r.stdout) {
				t.Errorf("%s of %s prints a policy's code:\n%s", args[0], typ, r.stdout)
			}
		}
	}
}

// Bad lookups are refused with a reason, before Redis is asked.
func TestLookupRefusesBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"lookup", "--field", "a=1"}, "--type is required"},
		{[]string{"lookup", "--type", "t"}, "give one of --field, --payload or --key"},
		{[]string{"lookup", "--type", "t", "--key", "k", "--field", "a=1"}, "give one of"},
		{[]string{"lookup", "--type", "t", "--fields", "a", "--key", "k"}, "--fields goes with --payload"},
		{[]string{"lookup", "--type", "t", "--field", "a"}, "want PATH=VALUE"},
		{[]string{"lookup", "--type", "t", "--field", "a=1", "--field", "a.b=2"}, "is a value, not an object"},
		{[]string{"lookup", "--type", "t", "--key", "k", "--hash-key-env", "DEDUPCTL_TEST_UNSET"}, "is empty or unset"},
	} {
		r := runCmd("", append([]string{"--url", "redis://127.0.0.1:1/0"}, tc.args...)...)
		if r.code != exitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%q: want exit %d and %q, got %v", tc.args, exitUsage, tc.want, r)
		}
	}
}

// A key with modes keeps its type in its mode record: list --type finds
// its lock once its holder is gone, and lookup names its type and key form.
// A plain lock's type goes with its holder's record: list shows it without
// one.
func TestListByTypeFindsAnOrphanWhoseKeyHasModes(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info := f.orphaned(f.qa, "email:gone", 1, dedup.OnFailure(dedup.FailHold, time.Hour), dedup.TTL(time.Hour))
	plain := f.orphaned(f.qa, "email:gone", 2)
	r := f.ok("list", "--type", "email:gone")
	if !strings.Contains(r.stdout, info.ID) || !strings.Contains(r.stdout, "orphaned") || strings.Contains(r.stdout, plain.ID) {
		t.Fatalf("list --type shows not just the orphan of %s:\n%s", info.ID, r.stdout)
	}
	r = f.ok("lookup", "--type", "email:gone", "--field", "user_id=1", "--queue", f.qa)
	if !strings.Contains(r.stdout, "type             email:gone") || !strings.Contains(r.stdout, "keyed on         fields user_id") {
		t.Fatalf("lookup of the orphan:\n%s", r.stdout)
	}
	o := decode[showOutput](t, f.ok("--json", "show", f.lockOf(plain)))
	if o.Type != "" || o.State != "orphaned" || o.Holder != plain.ID {
		t.Errorf("show of the plain orphan: %+v", o.Info)
	}
}

// lookup.go, operations.md: "bad input → exit 2 with a reason" (exit
// status: "2 usage error"); "Bad lookups are refused with a reason, before
// Redis is asked" (TestLookupRefusesBadInput). So too for input only the
// library's key code rejects: a --payload that is not JSON with --fields, an
// empty path in --fields, a --field path with an empty segment, a number
// whose exponent the canonical form refuses, a --fields path missing from
// --payload. Each is exit 2, on a live Redis and with Redis down (where the
// operator is told what is wrong, not that Redis is unreachable).
func TestLookupBadKeyInputIsAUsageErrorEvenWithRedisDown(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	for _, args := range [][]string{
		{"lookup", "--type", "t", "--payload", "not json", "--fields", "a"},
		{"lookup", "--type", "t", "--payload", `{"a":1,"b":2}`, "--fields", "a,,b"},
		{"lookup", "--type", "t", "--field", "a..b=1"},
		{"lookup", "--type", "t", "--field", "n=1e99999999999"},
		{"lookup", "--type", "t", "--payload", `{"b":1}`, "--fields", "a"},
	} {
		if r := f.run("", args...); r.code != exitUsage {
			t.Errorf("%q on a live Redis: want exit %d (usage), got %v", args, exitUsage, r)
		}
		if r := runCmd("", append([]string{"--url", "redis://127.0.0.1:1/0"}, args...)...); r.code != exitUsage || strings.Contains(r.stderr, "cannot reach Redis") {
			t.Errorf("%q with Redis down: want exit %d with the reason, got %v", args, exitUsage, r)
		}
	}
}

// lookup "finds exactly the lock Dedup.Lookup would (same fingerprint as
// the enqueue), VALUE parsed as JSON when valid else a string"; keys.md's
// canonical JSON. Numbers spelt 1 / 1.0 / 1e0 / 10e-1, strings with
// escapes, nested objects and arrays given in another member order, --field
// flags in another order than the enqueue's paths all find it; a big
// integer one off, a number given as a string and another queue do not;
// with Config.HashKey it is found only with the key. (The key has a mode, a
// fail hold, so that its mode record keeps the key form "keyed on"
// prints: a plain lock keeps none.)
func TestLookupFindsTheLockFromAnyCanonicalSpelling(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	payload := `{"n":1,"s":"é/","o":{"b":[1,2.0],"a":null},"big":9007199254740993,"deep":{"x":{"y":"z"}}}`
	info, err := f.client.EnqueueContext(ctx, asynq.NewTask("a11:canon", []byte(payload)), asynq.Queue(f.qa),
		dedup.Fields("n", "s", "o", "big", "deep.x.y"), dedup.OnFailure(dedup.FailHold, time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	found := [][]string{
		{"--field", "n=1.0", "--field", `s="\u00e9\/"`, "--field", `o={"a":null,"b":[1e0,2]}`, "--field", "big=9007199254740993", "--field", "deep.x.y=z"},
		{"--field", "deep.x.y=\"z\"", "--field", "big=9007199254740993", "--field", `o={"b":[10e-1,20e-1],"a":null}`, "--field", "s=é/", "--field", "n=1e0"},
		{"--payload", `{"deep":{"x":{"y":"z"}},"big":9007199254740993,"o":{"a":null,"b":[1,2]},"s":"\u00e9/","n":100e-2,"extra":true}`, "--fields", "s,n,o,big,deep.x.y"},
	}
	for _, args := range found {
		r := f.ok(append([]string{"lookup", "--type", "a11:canon", "--queue", f.qa}, args...)...)
		if !strings.Contains(r.stdout, "holder           "+info.ID) || !strings.Contains(r.stdout, "keyed on         fields big, deep.x.y, n, o, s") {
			t.Errorf("%q:\n%s", args, r.stdout)
		}
		if strings.Contains(r.stdout, "9007199254740993") || strings.Contains(r.stdout, "é") {
			t.Errorf("%q: a key value is shown:\n%s", args, r.stdout)
		}
	}
	for _, args := range [][]string{
		{"--queue", f.qa, "--field", "n=1", "--field", `s="é/"`, "--field", `o={"a":null,"b":[1,2]}`, "--field", "big=9007199254740992", "--field", "deep.x.y=z"},
		{"--queue", f.qa, "--field", "n=\"1\"", "--field", `s="é/"`, "--field", `o={"a":null,"b":[1,2]}`, "--field", "big=9007199254740993", "--field", "deep.x.y=z"},
		{"--queue", f.qb, "--field", "n=1", "--field", `s="é/"`, "--field", `o={"a":null,"b":[1,2]}`, "--field", "big=9007199254740993", "--field", "deep.x.y=z"},
	} {
		f.fail(exitError, "no lock: the key is free", "", append([]string{"lookup", "--type", "a11:canon"}, args...)...)
	}

	// Config.HashKey: found only with it.
	hk := newFixture(t, dedup.Config{HashKey: []byte("a11-secret-key-material")})
	hinfo, err := hk.client.EnqueueContext(ctx, asynq.NewTask("a11:keyed", []byte(`{"u":"x y"}`)), asynq.Queue(hk.qa), dedup.Fields("u"))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("A11_HASH_KEY", "a11-secret-key-material")
	r := hk.ok("lookup", "--hash-key-env", "A11_HASH_KEY", "--type", "a11:keyed", "--field", "u=x y", "--queue", hk.qa)
	if !strings.Contains(r.stdout, hinfo.ID) {
		t.Errorf("with the hash key:\n%s", r.stdout)
	}
	hk.fail(exitError, "no lock", "", "lookup", "--type", "a11:keyed", "--field", "u=x y", "--queue", hk.qa)
}

// show prints one lock "in full", one row per item; the lock keeps its task
// type verbatim. Under the default Config every type is deduplicated, so any
// service that can enqueue into asynq chooses the type a lock records: a
// type holding a newline and rows of its own (a holder, a state) cannot
// forge lines of show's and list's output that an operator (or a script
// reading it) would take for the lock's; --json keeps it whole.
func TestShowAndListKeepAHostileTypeOnItsOwnRow(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	typ := "a11:x\nholder           dd-0000000000000000-forgedforgedforged00\nstate            waiting"
	info, err := f.client.Enqueue(asynq.NewTask(typ, []byte("p")), asynq.Queue(f.qa))
	if err != nil {
		t.Fatal(err)
	}
	r := f.ok("show", f.lockOf(info))
	if n := strings.Count(r.stdout, "\nholder  "); n != 1 || strings.Contains(r.stdout, "forged") && !strings.Contains(r.stdout, `\n`) {
		t.Errorf("show prints %d holder rows (a type forged one):\n%s", n, r.stdout)
	}
	r = f.ok("list", "--type", typ)
	if strings.Count(r.stdout, "\n") != 3 { // header, one row, "1 lock"
		t.Errorf("list --type prints %d lines for one lock:\n%s", strings.Count(r.stdout, "\n"), r.stdout)
	}
	// The type is still findable, whole, with --json.
	if out := decode[showOutput](t, f.ok("--json", "show", f.lockOf(info))); out.Type != typ {
		t.Errorf("--json type %q", out.Type)
	}
}

// "show/lookup print keyed on … and never a key's value"; "list --type T
// finds a lock whose holder's asynq record is gone" (a key with modes: its
// mode record keeps the type; a plain lock's type goes with its holder's
// record). A per-call Fields overriding a rule's Key, on a type with a comma
// and 1 KB of name, its holder gone: list --type and lookup find it and say
// fields, and the rule's explicit key never shows.
func TestLookupOfAnOverriddenRuleNamesItsFieldsNeverItsKey(t *testing.T) {
	typ := "a11:a,b<script>" + strings.Repeat("t", 1024)
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{typ: {Key: "secret-rule-key", OnFailure: dedup.FailHold, FailHoldFor: time.Hour}}})
	info, err := f.d.NewClient().Enqueue(asynq.NewTask(typ, []byte(`{"tenant":{"id":"secret-tenant"}}`)), asynq.Queue(f.qa), dedup.Fields("tenant.id"))
	if err != nil {
		t.Fatal(err)
	}
	f.lockOf(info) // (read while its record names it)
	f.vanish(info)
	r := f.ok("list", "--type", typ)
	if !strings.Contains(r.stdout, info.ID) || !strings.Contains(r.stdout, "orphaned") {
		t.Errorf("list --type:\n%s", r.stdout)
	}
	r = f.ok("lookup", "--type", typ, "--field", "tenant.id=secret-tenant", "--queue", f.qa)
	if !strings.Contains(r.stdout, "keyed on         fields tenant.id") || !strings.Contains(r.stdout, info.ID) {
		t.Errorf("lookup:\n%s", r.stdout)
	}
	if strings.Contains(r.stdout, "secret") {
		t.Errorf("a key value shown:\n%s", r.stdout)
	}
	f.fail(exitError, "no lock", "", "lookup", "--type", typ, "--key", "secret-rule-key", "--queue", f.qa)
}
