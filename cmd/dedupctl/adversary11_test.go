package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// Adversarial tests, round 11: dedupctl lookup, the "keyed on" line, and
// doctor's young orphans, against a real redis-server. Each test quotes the
// promise it attacks.

// 1. Promise (lookup.go, operations.md): "bad input → exit 2 with a
// reason" (exit status: "2 usage error"); TestLookupRefusesBadInput: "Bad
// lookups are refused with a reason, before Redis is asked". Attack: input
// only the library's key code rejects: a --payload that is not JSON with
// --fields, an empty path in --fields, a --field path with an empty
// segment, a number whose exponent the canonical form refuses, a --fields
// path missing from --payload. They come back as exit 1 (an "error", as if
// Redis failed), and only after Redis was dialled: with Redis down the
// operator is told Redis is unreachable instead of what is wrong.
func TestAdversary11LookupBadKeyInputIsAUsageError(t *testing.T) {
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

// 2. Promise (lookup): "finds exactly the lock Dedup.Lookup would (same
// fingerprint as the enqueue), VALUE parsed as JSON when valid else a
// string"; keys.md's canonical JSON. Attack: numbers spelt 1 / 1.0 / 1e0 /
// 10e-1, a big integer one off, strings with escapes, nested objects and
// arrays given in another member order, --field flags in another order
// than the enqueue's paths, a queue the lock is not in, Config.HashKey.
// (The key has a mode, a failure hold, so that its mode record keeps the
// key form "keyed on" prints: a plain lock keeps none.)
func TestAdversary11LookupFindsCanonicalSpellings(t *testing.T) {
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
		if !strings.Contains(r.stdout, "owner            "+info.ID) || !strings.Contains(r.stdout, "keyed on         fields big, deep.x.y, n, o, s") {
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

// 3. Promise (operations): "An orphan younger than --grace … doctor lists
// it too, marked left alone, and counts it in its summary"; "--fix never
// releases a young one"; a lock show calls orphaned is reported or
// explained; the summary says "it" for one. Attack: one young orphan
// (WrapClient, owner deleted: show says its task may not be stored yet),
// one old orphan (NewClient, written with its task, which vanished without
// asynq's scripts: they would release the lock its record names) and a
// healthy lock; doctor, doctor --json, doctor --fix.
func TestAdversary11DoctorExplainsEveryOrphanAndFixesNoYoungOne(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	young := f.enqueue(f.qa, "a11:doc", 1)
	healthy := f.enqueue(f.qa, "a11:doc", 2)
	old := f.orphaned(f.qa, "a11:doc", 3)
	if err := f.insp.DeleteTask(f.qa, young.ID); err != nil {
		t.Fatal(err)
	}
	if r := f.ok("show", f.lockOf(young)); !strings.Contains(r.stdout, "state            orphaned") ||
		!strings.Contains(r.stdout, "missing (or not stored yet: the lock was taken before its task") {
		t.Fatalf("show %s:\n%s", young.ID, r.stdout)
	}
	if r := f.ok("show", f.lockOf(old)); !strings.Contains(r.stdout, "state            orphaned") {
		t.Fatalf("show %s:\n%s", old.ID, r.stdout)
	}
	r := f.ok("doctor")
	want := "3 locks checked, 1 lock whose owner cannot run, 1 orphan younger than --grace 1m00s left alone; run with --fix to release it\n"
	if !strings.HasSuffix(r.stdout, want) || !strings.Contains(r.stdout, young.ID) || !strings.Contains(r.stdout, "left alone") || !strings.Contains(r.stdout, old.ID) {
		t.Errorf("doctor:\n%s\nwant it to end %q", r.stdout, want)
	}
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--fix"))
	if out.Released != 1 || len(out.Findings) != 1 || out.Findings[0].Owner != old.ID || len(out.Young) != 1 || out.Young[0].Owner != young.ID || out.Grace != "1m00s" {
		t.Errorf("doctor --fix: %+v", out)
	}
	if !f.exists(f.lockOf(young)) || !f.exists(f.lockOf(healthy)) || f.exists(f.lockOf(&asynq.TaskInfo{ID: old.ID, Queue: old.Queue})) {
		t.Errorf("after --fix: young %v healthy %v old %v; want the old orphan alone released", f.exists(f.lockOf(young)), f.exists(f.lockOf(healthy)), f.exists(f.lockOf(old)))
	}
	r = f.ok("doctor", "--fix")
	if !strings.Contains(r.stdout, "2 locks checked, 0 locks whose owner cannot run, 1 orphan younger than --grace 1m00s left alone, 0 released") {
		t.Errorf("second doctor --fix:\n%s", r.stdout)
	}
}

// 4. Promise (operations): show prints one lock "in full", one row per
// item; the lock keeps its task type verbatim. Attack: under the default
// Config every type is deduplicated, so any service that can enqueue into
// asynq chooses the type a lock records; a type holding a newline and a
// row of its own forges lines of show's and list's output (an owner, a
// state) that an operator (or a script reading it) takes for the lock's.
func TestAdversary11HostileTypeCannotForgeShowRows(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	typ := "a11:x\nowner            dd-0000000000000000-forgedforgedforged00\nstate            waiting"
	info, err := f.client.Enqueue(asynq.NewTask(typ, []byte("p")), asynq.Queue(f.qa))
	if err != nil {
		t.Fatal(err)
	}
	r := f.ok("show", f.lockOf(info))
	if n := strings.Count(r.stdout, "\nowner  "); n != 1 || strings.Contains(r.stdout, "forged") && !strings.Contains(r.stdout, `\n`) {
		t.Errorf("show prints %d owner rows (a type forged one):\n%s", n, r.stdout)
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

// 5. Promise: "show/lookup print keyed on … and never a key's value";
// "list --type T finds a lock whose owner's asynq record is gone" (a key
// with modes: its mode record keeps the type; a plain lock's type goes
// with its owner's record). Attack: a per-call Fields overriding a rule's
// Key, on a type with a comma and 1 KB of name; owner gone; list --type
// and lookup find it and say fields; the explicit key of the rule never
// shows.
func TestAdversary11LookupOverriddenRuleOddTypeOwnerGone(t *testing.T) {
	typ := "a11:a,b<script>" + strings.Repeat("t", 1024)
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{typ: {Key: "secret-rule-key", OnFailure: dedup.FailHold, FailureHold: time.Hour}}})
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
