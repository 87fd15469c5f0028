package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestRun runs the whole example on an embedded miniredis, smaller than the
// default so it stays quick under -race, and checks that the numbers of the
// summary add up.
func TestRun(t *testing.T) {
	o := options{Enqueues: 2_000, Users: 200, Producers: 8, Workers: 20, Timeout: 25 * time.Second}
	var out bytes.Buffer
	s, err := run(t.Context(), &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if s.Accepted+s.Rejected != o.Enqueues {
		t.Errorf("accepted %d + rejected %d != %d enqueues", s.Accepted, s.Rejected, o.Enqueues)
	}
	// Every user's first enqueue finds its key free.
	if s.Accepted < o.Users {
		t.Errorf("accepted %d < %d users", s.Accepted, o.Users)
	}
	if s.Processed != s.Accepted {
		t.Errorf("processed %d != accepted %d", s.Processed, s.Accepted)
	}
	if s.Violations != 0 || s.MaxPerKey != 1 {
		t.Errorf("violations %d, max per key %d; want 0, 1", s.Violations, s.MaxPerKey)
	}
	if s.LocksLeft != 0 || s.EnqueueErrors != 0 || s.NotOnce != 0 || !s.AllAsynqDup {
		t.Errorf("locks left %d, enqueue errors %d, not run once %d, all asynq dup %t", s.LocksLeft, s.EnqueueErrors, s.NotOnce, s.AllAsynqDup)
	}
	if s.Rejected > 0 && !strings.HasPrefix(s.SampleHolder, "dd-") {
		t.Errorf("sample holder %q does not look like a dedup task ID", s.SampleHolder)
	}
	// The library's own counters must agree with what the example saw.
	st := s.Stats
	if int(st.Locked) != s.Accepted || int(st.Duplicates) != s.Rejected || int(st.Released) != s.Processed {
		t.Errorf("dedup.Stats %+v disagree with accepted %d, rejected %d, processed %d", st, s.Accepted, s.Rejected, s.Processed)
	}
	if !strings.HasSuffix(out.String(), "\nOK\n") {
		t.Errorf("summary does not end in OK")
	}
}

// TestRunBadRedisURL checks that a malformed or unreachable REDIS_URL fails
// at once with a message naming the problem.
func TestRunBadRedisURL(t *testing.T) {
	for url, want := range map[string]string{
		"http://localhost:6379": "not a valid Redis URL",
		"redis://127.0.0.1:1/0": "cannot reach Redis at 127.0.0.1:1",
	} {
		o := defaultOptions()
		o.RedisURL = url
		var out bytes.Buffer
		_, err := run(t.Context(), &out, o)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("REDIS_URL=%s: error %v, want it to contain %q", url, err, want)
		}
	}
}
