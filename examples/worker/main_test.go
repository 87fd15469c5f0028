package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"
)

// runSmall runs a mode on an embedded miniredis, smaller than the default so
// it stays quick under -race. It logs the summary, stops the test if the run
// failed, and checks that the summary ends in OK.
func runSmall[S any](t *testing.T, run func(context.Context, io.Writer, options) (S, error)) (S, options) {
	t.Helper()
	// Timeout only bounds a hang: a run takes about 10 s alone, and 25 s ran
	// out under -race beside the root package's tests on two cores.
	o := options{Enqueues: 2_000, Users: 200, Producers: 8, Workers: 20, Timeout: 2 * time.Minute}
	var out bytes.Buffer
	s, err := run(t.Context(), &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if !strings.HasSuffix(out.String(), "\nOK\n") {
		t.Errorf("summary does not end in OK")
	}
	return s, o
}

// TestRunReject runs the reject demonstration on an embedded miniredis and
// checks that the numbers of the summary add up.
func TestRunReject(t *testing.T) {
	s, o := runSmall(t, runReject)
	if s.Created+s.Rejected != o.Enqueues {
		t.Errorf("accepted %d + rejected %d != %d enqueues", s.Created, s.Rejected, o.Enqueues)
	}
	// Every user's first enqueue finds its key free.
	if s.Created < o.Users {
		t.Errorf("accepted %d < %d users", s.Created, o.Users)
	}
	if s.Processed != s.Created {
		t.Errorf("processed %d != accepted %d", s.Processed, s.Created)
	}
	checkCommon(t, &s.report)
	if s.Errors != 0 || s.NotAsynqDup != 0 {
		t.Errorf("enqueue errors %d, rejections not matching asynq.ErrDuplicateTask %d", s.Errors, s.NotAsynqDup)
	}
	if s.Rejected > 0 && !strings.HasPrefix(s.SampleHolder, "dd-") {
		t.Errorf("sample holder %q does not look like a dedup task ID", s.SampleHolder)
	}
	// The library's own counters must agree with what the example saw.
	st := s.Stats
	if int(st.Locked) != s.Created || int(st.Duplicates) != s.Rejected || int(st.Released) != s.Processed {
		t.Errorf("dedup.Stats %+v disagree with accepted %d, rejected %d, processed %d", st, s.Created, s.Rejected, s.Processed)
	}
}

// TestRunReplace runs the replace demonstration on an embedded miniredis.
// Phase 1 is exact: with no worker running, each user's first update creates
// its task and every later one replaces that task's payload, so each user
// runs once, with its last version. Phase 2's split between new, replaced and
// deferred depends on timing; what must hold is that each user's last run
// has its last version and that no user ever runs twice at once.
func TestRunReplace(t *testing.T) {
	s, o := runSmall(t, runReplace)
	p1, p2 := s.Phase1, s.Phase2
	if p1.Created != o.Users || p1.Replaced != o.Enqueues-o.Users || p1.Deferred != 0 || p1.Rejected != 0 || p1.Errors != 0 {
		t.Errorf("phase 1: created %d, replaced %d, deferred %d, rejected %d, errors %d; want %d, %d, 0, 0, 0",
			p1.Created, p1.Replaced, p1.Deferred, p1.Rejected, p1.Errors, o.Users, o.Enqueues-o.Users)
	}
	if s.Runs1 != o.Users || s.Stale1 != 0 {
		t.Errorf("phase 1: %d runs, %d users not run exactly once with their last version; want %d, 0", s.Runs1, s.Stale1, o.Users)
	}
	// Independently of the summary's own counts: user u is sent versions
	// 1…perUser in phase 1 and perUser+1…2·perUser in phase 2. Its first run
	// must be perUser (phase 1, exactly once), its later runs (phase 2)
	// strictly newer, the last one 2·perUser.
	perUser := o.Enqueues / o.Users
	for user := range o.Users {
		ran := s.Ran[user]
		if len(ran) < 2 || ran[0] != perUser || ran[len(ran)-1] != 2*perUser {
			t.Errorf("user %d ran versions %v; want %d first, then newer ones ending in %d", user, ran, perUser, 2*perUser)
			continue
		}
		for i := 1; i < len(ran); i++ {
			if ran[i] <= ran[i-1] || ran[i] <= perUser {
				t.Errorf("user %d ran versions %v: not in increasing order, or a phase 1 version ran twice", user, ran)
				break
			}
		}
	}
	if p2.Created+p2.Replaced+p2.Deferred != o.Enqueues || p2.Rejected != 0 || p2.Errors != 0 {
		t.Errorf("phase 2: created %d + replaced %d + deferred %d != %d, or rejected %d, errors %d",
			p2.Created, p2.Replaced, p2.Deferred, o.Enqueues, p2.Rejected, p2.Errors)
	}
	if s.Runs2 != p2.Created+p2.Deferred || s.Stale2 != 0 || s.Backwards != 0 {
		t.Errorf("phase 2: %d runs, want created + deferred = %d; %d users stale; %d runs went backwards",
			s.Runs2, p2.Created+p2.Deferred, s.Stale2, s.Backwards)
	}
	checkCommon(t, &s.report)
	st := s.Stats
	if int(st.Replaced) != p1.Replaced+p2.Replaced || int(st.Deferred) != p2.Deferred || int(st.Released) != s.Processed {
		t.Errorf("dedup.Stats %+v disagree with replaced %d, deferred %d, processed %d", st, p1.Replaced+p2.Replaced, p2.Deferred, s.Processed)
	}
}

// checkCommon checks what must hold in every mode.
func checkCommon(t *testing.T, r *report) {
	t.Helper()
	if r.Violations != 0 || r.MaxPerUser != 1 {
		t.Errorf("violations %d, max per user %d; want 0, 1", r.Violations, r.MaxPerUser)
	}
	if r.LocksLeft != 0 || r.TasksLeft != 0 || r.NotOnce != 0 || r.HandlerErrors != 0 {
		t.Errorf("locks left %d, tasks left %d, not run once %d, handler errors %d; want all 0", r.LocksLeft, r.TasksLeft, r.NotOnce, r.HandlerErrors)
	}
}

// TestRunBadRedisURL checks that a malformed or unreachable REDIS_URL fails
// at once with a message naming the problem.
func TestRunBadRedisURL(t *testing.T) {
	for url, want := range map[string]string{
		"http://localhost:6379": "not a valid Redis URL",
		"redis://127.0.0.1:1/0": "cannot reach Redis at 127.0.0.1:1",
	} {
		for mode, run := range modes {
			o := defaultOptions()
			o.RedisURL = url
			var out bytes.Buffer
			err := run(t.Context(), &out, o)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("-mode=%s, REDIS_URL=%s: error %v, want it to contain %q", mode, url, err, want)
			}
		}
	}
}
