package main

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// An on-call engineer goes from "user 42" to the lock: by fields, by the
// whole payload with fields chosen from it, and by an explicit key; a key
// with modes (here a failure hold, MaxPending) shows how it was chosen
// (field names, never values), from its mode record.
func TestLookupFindsTheLockByTypeAndKey(t *testing.T) {
	f := newFixture(t, dedup.Config{OptIn: true, Rules: map[string]dedup.Rule{
		"email:welcome": {Fields: []string{"user_id", "tenant.id"}, OnFailure: dedup.FailHold, FailureHold: time.Hour},
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
		for _, want := range []string{"owner            " + welcome.ID, "type             email:welcome", "keyed on         fields tenant.id, user_id", "state            waiting"} {
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
	if out.Owner != report.ID || out.KeyedOn != "key (explicit)" || out.Type != "report:build" {
		t.Errorf("--json: owner %q keyed on %q type %q, want %s, key (explicit), report:build", out.Owner, out.KeyedOn, out.Type, report.ID)
	}
	f.fail(exitError, "no lock: the key is free", "", "lookup", "--type", "email:welcome", "--field", "user_id=43", "--field", "tenant.id=t7", "--queue", f.qa)
	f.fail(exitError, "no lock: the key is free", "", "lookup", "--type", "email:welcome", "--field", "user_id=\"42\"", "--field", "tenant.id=t7", "--queue", f.qa)
}

// A plain lock (a key whose policy acts only at enqueue) has no mode
// record: lookup and show say so, print no key form, and say what asynq
// says of its holder: its state, and its type from its record.
func TestShowOfAPlainLockSaysItsHoldersStateFromAsynq(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info := f.enqueue(f.qa, "email:plain", 42)
	want := []string{"type             email:plain", "keyed on         -", "state            waiting",
		"owner            " + info.ID, "owner in asynq   pending (retried 0/25)",
		"mode record      none: a plain lock, whose state is its owner's in asynq"}
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
	if o.Type != "email:plain" || o.KeyedOn != "" || o.ModeKey != "" || o.Fields != nil || o.OwnerTask.State != "pending" || o.TaskState != "pending" {
		t.Errorf("show --json of a plain lock: %+v / %+v", o.Info, o.OwnerTask)
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
	if !strings.Contains(r.stdout, "state            retry-wait") || !strings.Contains(r.stdout, "owner in asynq   retry (retried 1/25, runs in ") {
		t.Errorf("show of a plain lock whose holder waits for its retry:\n%s", r.stdout)
	}
}

// show and lookup say a key's running policy in words, never the mode
// record's code for it.
func TestShowSaysTheRunningPolicyInWords(t *testing.T) {
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
		"report:live":  {Fields: []string{"user_id"}, OnRunning: dedup.RunningAllow},
	}})
	for typ, want := range map[string]string{
		"report:build": "running policy   defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends\n",
		"report:live":  "running policy   allow: the key frees when its task starts, so a duplicate enqueued while it runs is a new task\n",
	} {
		info := f.enqueue(f.qa, typ, 1)
		for _, args := range [][]string{{"show", f.lockOf(info)}, {"lookup", "--type", typ, "--field", "user_id=1", "--queue", f.qa}} {
			r := f.ok(args...)
			if !strings.Contains(r.stdout, want) {
				t.Errorf("%s of %s lacks %q:\n%s", args[0], typ, want, r.stdout)
			}
			if regexp.MustCompile(`running policy +[^\n]*\([ad]\)`).MatchString(r.stdout) {
				t.Errorf("%s of %s shows the policy's code:\n%s", args[0], typ, r.stdout)
			}
		}
		o := decode[showOutput](t, f.ok("--json", "show", f.lockOf(info)))
		if o.RunningPolicy != strings.TrimSpace(strings.TrimPrefix(want, "running policy   ")) {
			t.Errorf("show --json of %s: running policy %q", typ, o.RunningPolicy)
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
// its lock once its owner is gone, and lookup names its type and key form.
// A plain lock's type goes with its owner's record: list shows it without
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
	if o.Type != "" || o.State != "orphaned" || o.Owner != plain.ID {
		t.Errorf("show of the plain orphan: %+v", o.Info)
	}
}
