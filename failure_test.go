package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// failRules is counterRules with a short heartbeat: (a final failure's hold is) / 3
// settled on a guess and checked again at the next heartbeat (Lease/3).
func failRules(r Rule) Config {
	cfg := counterRules(r)
	cfg.heartbeat = (3 * time.Second) / 3
	return cfg
}

// failedDup asserts that enqueuing task is refused with a *DuplicateTaskError
// whose Failed is set, naming holder, and returns it.
func failedDup(t *testing.T, c *Client, task *asynq.Task, q, holder string, opts ...asynq.Option) *DuplicateTaskError {
	t.Helper()
	_, err := c.Enqueue(task, append([]asynq.Option{asynq.Queue(q)}, opts...)...)
	var de *DuplicateTaskError
	if !errors.As(err, &de) || !de.Failed || de.CoolingDown || de.TaskID != holder || !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("enqueue after the failure: %v (%+v), want a failed hold by %s", err, de, holder)
	}
	return de
}

func TestFailHoldKeepsTheKeyAfterRetriesAreExhausted(t *testing.T) {
	bothPaths(t, failRules(Rule{OnFailure: FailHold, FailureHold: time.Hour}), func(t *testing.T, h *harness) {
		rc := newRecorder(func(run) error { return errors.New("boom: upstream said no") })
		h.serve(rc.handler(), nil)
		info := h.enqueue(counterTask("a", 1, 0), asynq.MaxRetry(1))
		waitFor(t, rc.runs, "first attempt")
		waitFor(t, rc.runs, "last attempt")
		eventually(t, "archived and held", func() bool { return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1 })
		de := failedDup(t, h.client, counterTask("a", 2, 0), h.queue, info.ID)
		if de.FreeIn <= 59*time.Minute || de.FreeIn > time.Hour {
			t.Fatalf("FreeIn %v, want about the hour of FailureHold", de.FreeIn)
		}
		kl, found, err := h.d.Lookup(context.Background(), counterTask("a", 3, 0), asynq.Queue(h.queue))
		if err != nil || !found || kl.State != "failed" || kl.Holder != info.ID || !strings.Contains(kl.LastError, "upstream said no") {
			t.Fatalf("Lookup: %+v %v %v, want failed, held by %s with its error", kl, found, err, info.ID)
		}
		if s := h.d.Stats(); s.Released != 0 {
			t.Fatalf("released %d, want 0", s.Released)
		}
	})
}

func TestFailHoldUntilReleasedHoldsAfterSkipRetryUntilReleasedByHand(t *testing.T) {
	bothPaths(t, failRules(Rule{OnFailure: FailHoldUntilReleased}), func(t *testing.T, h *harness) {
		rc := newRecorder(func(run) error { return fmt.Errorf("bad input: %w", asynq.SkipRetry) })
		h.serve(rc.handler(), nil)
		info := h.enqueue(counterTask("b", 1, 0))
		waitFor(t, rc.runs, "the only attempt")
		eventually(t, "held after the failure", func() bool { return h.d.Stats().FailureHeld == 1 })
		if de := failedDup(t, h.client, counterTask("b", 2, 0), h.queue, info.ID); de.FreeIn >= 0 {
			t.Fatalf("FreeIn %v, want negative (until released)", de.FreeIn)
		}
		if ttl := h.rdb.PTTL(context.Background(), h.keyOf(counterTask("b", 0, 0), h.queue)).Val(); ttl != -1 {
			t.Fatalf("lock PTTL %v, want no expiry", ttl)
		}
		released, err := h.d.Release(context.Background(), counterTask("b", 3, 0), info.ID, asynq.Queue(h.queue))
		if err != nil || !released {
			t.Fatalf("Release: %v %v", released, err)
		}
		next := h.enqueue(counterTask("b", 4, 0))
		if next.ID == info.ID {
			t.Fatal("the key was not taken by a new task")
		}
	})
}

func TestFailurePolicyIsRecordedSoTheServerNeedsNoRule(t *testing.T) {
	// The producer's per-call option decides; the server's Dedup has no rule.
	h := newHarness(t, Config{heartbeat: (3 * time.Second) / 3})
	rc := newRecorder(func(run) error { return asynq.SkipRetry })
	h.serve(rc.handler(), nil)
	c := h.d.NewClient()
	info, err := c.Enqueue(userTask(5, ""), asynq.Queue(h.queue), Fields("user_id"), OnFailure(FailHold, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "the attempt")
	eventually(t, "held", func() bool { return h.d.Stats().FailureHeld == 1 })
	failedDup(t, c, userTask(5, "again"), h.queue, info.ID, Fields("user_id"))
	// Without the option, the same failure releases.
	other, err := c.Enqueue(userTask(6, ""), asynq.Queue(h.queue), Fields("user_id"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, rc.runs, "the other attempt")
	eventually(t, "released and archived", func() bool {
		return h.d.Stats().Released == 1 && h.taskState(other.ID) == asynq.TaskStateArchived
	})
	if _, err := c.Enqueue(userTask(6, "again"), asynq.Queue(h.queue), Fields("user_id")); err != nil {
		t.Fatalf("enqueue after a released failure of %s: %v", other.ID, err)
	}
}

func TestFailHoldDoesNotHoldRevokedDeletedOrSucceededTasks(t *testing.T) {
	h := newHarness(t, failRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	rc := newRecorder(func(r run) error {
		switch decodeCounter(r.task).Key {
		case "revoked":
			return asynq.RevokeTask
		case "retried":
			return errors.New("try later")
		}
		return nil
	})
	h.serve(rc.handler(), retryInAnHour)
	for _, key := range []string{"revoked", "ok"} {
		h.enqueue(counterTask(key, 1, 0))
		waitFor(t, rc.runs, key)
	}
	eventually(t, "both released", func() bool { return h.d.Stats().Released == 2 })
	retried := h.enqueue(counterTask("retried", 1, 0), asynq.MaxRetry(3))
	waitFor(t, rc.runs, "retried")
	eventually(t, "waiting for its retry", func() bool { return h.taskState(retried.ID) == asynq.TaskStateRetry })
	if err := h.insp.DeleteTask(h.queue, retried.ID); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"revoked", "ok", "retried"} {
		if _, err := h.client.Enqueue(counterTask(key, 2, 0), asynq.Queue(h.queue)); err != nil {
			t.Fatalf("%s: enqueue after it ended: %v", key, err)
		}
	}
	if s := h.d.Stats(); s.FailureHeld != 0 {
		t.Fatalf("failure_held %d, want 0", s.FailureHeld)
	}
}

// A handler that ignores its deadline holds the key while it runs; once it
// returns, asynq's record (archived) decides, whatever it returned.
func TestFailHoldWhenAsynqArchivesAnAttemptThatOutlivedItsDeadline(t *testing.T) {
	h := newHarness(t, failRules(Rule{OnFailure: FailHold, FailureHold: time.Hour}))
	h.client = h.d.NewClient()
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil }) // ignores its context
	h.serve(rc.handler(), nil)
	info := h.enqueue(counterTask("slow", 1, 0), asynq.MaxRetry(0), asynq.Timeout(time.Second))
	waitFor(t, rc.runs, "the attempt")
	eventually(t, "archived by asynq", func() bool { return h.taskState(info.ID) == asynq.TaskStateArchived })
	_, err := h.client.Enqueue(counterTask("slow", 2, 0), asynq.Queue(h.queue))
	var de *DuplicateTaskError
	if !errors.As(err, &de) || de.Failed || de.TaskID != info.ID {
		t.Fatalf("enqueue while the given-up handler still runs: %v, want held by %s (running)", err, info.ID)
	}
	close(release)
	eventually(t, "held after the failure", func() bool {
		_, err := h.client.Enqueue(counterTask("slow", 2, 0), asynq.Queue(h.queue))
		var de *DuplicateTaskError
		return errors.As(err, &de) && de.Failed
	})
}

func TestRunningAHeldTaskAgainByHandMakesItTheOwnerAgain(t *testing.T) {
	h := newHarness(t, failRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	fail := make(chan bool, 2)
	fail <- true
	fail <- false
	rc := newRecorder(func(run) error {
		if <-fail {
			return asynq.SkipRetry
		}
		return nil
	})
	h.serve(rc.handler(), nil)
	info := h.enqueue(counterTask("c", 1, 0), asynq.Retention(time.Hour))
	waitFor(t, rc.runs, "the failing attempt")
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailureHeld == 1
	})
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitFor(t, rc.runs, "the run by hand"); r.id != info.ID {
		t.Fatalf("ran %s, want %s", r.id, info.ID)
	}
	eventually(t, "completed and released", func() bool {
		_, err := h.client.Enqueue(counterTask("c", 2, 0), asynq.Queue(h.queue))
		return err == nil
	})
}

func TestOnFailureRefusesWhatItCannotDo(t *testing.T) {
	for _, r := range []Rule{
		{OnFailure: FailHold},
		{OnFailure: FailHold, FailureHold: -time.Second},
		{OnFailure: FailRelease, FailureHold: time.Second},
		{OnFailure: FailHoldUntilReleased, FailureHold: time.Second},
		{OnFailure: Failure(9)},
	} {
		_, err := New(context.Background(), newRDB(t), Config{Rules: map[string]Rule{"t": r}, Logger: quietLogger()})
		if !errors.Is(err, ErrInvalidOption) || !strings.Contains(err.Error(), `rule for "t"`) {
			t.Errorf("%+v: %v, want ErrInvalidOption naming the rule", r, err)
		}
	}
	h := newHarness(t, Config{})
	_, err := h.client.Enqueue(userTask(1, ""), asynq.Queue(h.queue), OnFailure(FailHold, 0))
	if !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("OnFailure(FailHold, 0): %v, want ErrInvalidOption", err)
	}
	if n := len(h.locks()); n != 0 {
		t.Fatalf("%d locks left behind", n)
	}
}
