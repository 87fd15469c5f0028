package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// An on-call engineer goes from "user 42" to the lock: by fields, by the
// whole payload with fields chosen from it, and by an explicit key; the
// lock shows how its key was chosen (field names, never values).
func TestLookupFindsTheLockByTypeAndKey(t *testing.T) {
	f := newFixture(t, dedup.Config{OptIn: true, Rules: map[string]dedup.Rule{
		"email:welcome": {Fields: []string{"user_id", "tenant.id"}},
		"report:build":  {Key: "nightly"},
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

// The lock keeps its type: list --type finds a lock whose owner's task an
// operator deleted, and show names its type.
func TestListByTypeFindsALockWhoseOwnerIsGone(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info, err := f.client.EnqueueContext(context.Background(), asynq.NewTask("email:gone", []byte(`{"u":1}`)), asynq.Queue(f.qa), dedup.Fields("u"), dedup.TTL(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.insp.DeleteTask(f.qa, info.ID); err != nil {
		t.Fatal(err)
	}
	r := f.ok("list", "--type", "email:gone")
	if !strings.Contains(r.stdout, info.ID) || !strings.Contains(r.stdout, "orphaned") {
		t.Fatalf("list --type does not show the orphan of %s:\n%s", info.ID, r.stdout)
	}
	r = f.ok("lookup", "--type", "email:gone", "--field", "u=1", "--queue", f.qa)
	if !strings.Contains(r.stdout, "type             email:gone") || !strings.Contains(r.stdout, "keyed on         fields u") {
		t.Fatalf("lookup of the orphan:\n%s", r.stdout)
	}
}
