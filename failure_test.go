package dedup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// failRules is counterRules with a short heartbeat: (a final failure's hold is) / 3
// settled on a guess and checked again at the next heartbeat (Lease/3).
func failRules(r Rule) Config {
	cfg := counterRules(r)
	cfg.heartbeat = (3 * time.Second) / 3
	return cfg
}

// heldAfterArchive waits until the key of task id is held after its final
// failure and asynq has archived it. The hold is written before asynq
// archives the task; until asynq has, a duplicate meets a holder that its
// record says runs (failures.md).
func heldAfterArchive(t *testing.T, h *harness, id string) {
	t.Helper()
	eventually(t, "archived and held", func() bool { return h.taskState(id) == asynq.TaskStateArchived && h.d.Stats().FailHeld >= 1 })
}

// failedDup asserts that enqueuing task is refused with a *DuplicateTaskError
// whose Failed is set, naming holder, and returns it.
func failedDup(t *testing.T, c *Client, task *asynq.Task, q, holder string, opts ...asynq.Option) *DuplicateTaskError {
	t.Helper()
	_, err := c.Enqueue(task, append([]asynq.Option{asynq.Queue(q)}, opts...)...)
	var de *DuplicateTaskError
	if !errors.As(err, &de) || !de.FailHeld || de.CoolingDown || de.Holder != holder || !errors.Is(err, ErrDuplicateTask) {
		t.Fatalf("enqueue after the failure: %v (%+v), want a failed hold by %s", err, de, holder)
	}
	return de
}

func TestFailHoldKeepsTheKeyAfterRetriesAreExhausted(t *testing.T) {
	t.Parallel()
	bothPaths(t, failRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}), func(t *testing.T, h *harness) {
		rc := newRecorder(func(run) error { return errors.New("boom: upstream said no") })
		h.serve(rc.handler(), nil)
		info := h.enqueue(counterTask("a", 1, 0), asynq.MaxRetry(1))
		waitFor(t, rc.runs, "first attempt")
		waitFor(t, rc.runs, "last attempt")
		eventually(t, "archived and held", func() bool { return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1 })
		de := failedDup(t, h.client, counterTask("a", 2, 0), h.queue, info.ID)
		if de.FreeIn <= 59*time.Minute || de.FreeIn > time.Hour {
			t.Fatalf("FreeIn %v, want about the hour of FailHoldFor", de.FreeIn)
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
		// (The hold is written before asynq archives the task; until asynq
		// has, a duplicate meets a holder that its record says runs.)
		heldAfterArchive(t, h, info.ID)
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
	heldAfterArchive(t, h, info.ID)
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
	// (asynq's done script, after the middleware returned, drops the locks.)
	eventually(t, "both released", func() bool { return h.d.Stats().Released == 2 && len(h.locks()) == 0 })
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
	if s := h.d.Stats(); s.FailHeld != 0 {
		t.Fatalf("fail_held %d, want 0", s.FailHeld)
	}
}

// A handler that ignores the deadline of its last retry: asynq archives
// the task at the deadline, and the key is held by the failure from then,
// while the handler runs on and after it returns, whatever it returned.
func TestFailHoldWhenAsynqArchivesAnAttemptThatOutlivedItsDeadline(t *testing.T) {
	t.Parallel()
	h := newHarness(t, failRules(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
	h.client = h.d.NewClient()
	release := make(chan struct{})
	rc := newRecorder(func(run) error { <-release; return nil }) // ignores its context
	h.serve(rc.handler(), nil)
	info := h.enqueue(counterTask("slow", 1, 0), asynq.MaxRetry(0), asynq.Timeout(time.Second))
	waitFor(t, rc.runs, "the attempt")
	eventually(t, "archived by asynq", func() bool { return h.taskState(info.ID) == asynq.TaskStateArchived })
	_, err := h.client.Enqueue(counterTask("slow", 2, 0), asynq.Queue(h.queue))
	var de *DuplicateTaskError
	if !errors.As(err, &de) || !de.FailHeld || de.Holder != info.ID {
		t.Fatalf("enqueue while the given-up handler still runs: %v, want held by %s's failure", err, info.ID)
	}
	close(release)
	eventually(t, "held after the failure", func() bool {
		_, err := h.client.Enqueue(counterTask("slow", 2, 0), asynq.Queue(h.queue))
		var de *DuplicateTaskError
		return errors.As(err, &de) && de.FailHeld
	})
}

func TestRunningAHeldTaskAgainByHandMakesItTheHolderAgain(t *testing.T) {
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
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
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
		{OnFailure: FailHold, FailHoldFor: -time.Second},
		{OnFailure: FailRelease, FailHoldFor: time.Second},
		{OnFailure: FailHoldUntilReleased, FailHoldFor: time.Second},
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

// An operator's archive of a waiting task is no failure (docs/policies.md):
// the key frees, even under FailHoldUntilReleased, and Lookup says the lock
// is orphaned (it heals), not failed.
func TestFailHoldTreatsAnArchiveOfAWaitingTaskAsNoFailure(t *testing.T) {
	h := newHarness(t, jobRules(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	info := h.enqueue(jobTask("a", 1)) // no server: it waits
	if err := h.insp.ArchiveTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	kl, found, err := h.d.Lookup(context.Background(), jobTask("a", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "orphaned" {
		t.Errorf("Lookup after the archive: %+v %v %v, want orphaned", kl, found, err)
	}
	if _, err := h.client.Enqueue(jobTask("a", 2), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("enqueue after the operator archived %s: %v, want a new task", info.ID, err)
	}
}

// A panic on the last retry is a final failure; the lock keeps "dedup:
// handler panicked", never the panic's value (which may quote the payload;
// asynq's record has it), as documented.
func TestFailHoldKeepsAPanicOnTheLastRetryAsAPanic(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { panic("disk on fire") }, nil)
	info := h.enqueue(jobTask("panic", 1), asynq.MaxRetry(0), asynq.Retention(time.Hour))
	eventually(t, "archived and held", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	kl, found, err := h.d.Lookup(context.Background(), jobTask("panic", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || kl.LastError != errPanicked.Error() {
		t.Fatalf("Lookup: state %q, LastError %q; want failed with %q", kl.State, kl.LastError, errPanicked)
	}
}

// The last error is kept in the lock up to 1,000 bytes, cut at a character
// and marked: an error of multi-byte text (and control characters) comes
// back from Lookup (and so dedupctl show's "last error", and the lock
// browser) as valid UTF-8, a prefix of the error's text. (Once, the scripts
// cut it at 1000 bytes inside a character.)
func TestFailHoldKeepsTheLastErrorAsValidText(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	msg := "upstream said:\nstate            free\x1b[2J xy" + strings.Repeat("é", 600)
	h.serve(func(context.Context, *asynq.Task) error { return fmt.Errorf("%s: %w", msg, asynq.SkipRetry) }, nil)
	info := h.enqueue(jobTask("utf8", 1))
	heldAfterArchive(t, h, info.ID)
	kl, found, err := h.d.Lookup(context.Background(), jobTask("utf8", 2), asynq.Queue(h.queue))
	if err != nil || !found || kl.State != "failed" || kl.Holder != info.ID {
		t.Fatalf("Lookup: %+v %v %v", kl, found, err)
	}
	kept, cut := strings.CutSuffix(kl.LastError, "…") // documented: up to 1,000 bytes, cut at a character, marked
	if !cut || !strings.HasPrefix(msg, kept) || len(kl.LastError) > 1000 || len(kept) < 900 {
		t.Errorf("LastError %q is not the error's text cut as documented", kl.LastError)
	}
	t.Logf("LastError %d bytes: %q", len(kl.LastError), kl.LastError)
	if !utf8.ValidString(kl.LastError) {
		t.Errorf("LastError (%d bytes) is not valid UTF-8: ends %q", len(kl.LastError), kl.LastError[len(kl.LastError)-4:])
	}
}

// A call folded into a waiting task leaves the key's failure policy as it
// was; "Result.NotApplied names the call's options that were not applied":
// both the folded call's Cooldown and its OnFailure.
func TestOnFailureOfAFoldedCallIsNamedNotApplied(t *testing.T) {
	h := newHarness(t, jobRules(Rule{OnConflict: Replace}))
	h.client = h.d.NewClient()
	first := h.enqueue(jobTask("f", 1))
	res, err := h.client.Submit(context.Background(), jobTask("f", 2), asynq.Queue(h.queue), OnFailure(FailHoldUntilReleased, 0), Cooldown(time.Hour))
	if err != nil || res.Outcome != Replaced || res.TaskID != first.ID {
		t.Fatalf("Submit: %+v %v, want replaced into %s", res, err, first.ID)
	}
	named := strings.Join(res.NotApplied, " ")
	if !strings.Contains(named, "dedup.Cooldown") {
		t.Fatalf("NotApplied %v does not name the Cooldown", res.NotApplied)
	}
	if !strings.Contains(named, "dedup.OnFailure") {
		t.Errorf("NotApplied %v does not name dedup.OnFailure, which the fold did not apply", res.NotApplied)
	}
}

// Cooldown and FailHold together: success cools for the cooldown, a final
// fail holds for FailHoldFor.
func TestCooldownCoolsAndFailHoldHoldsOnOneKey(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{Cooldown: time.Hour, OnFailure: FailHold, FailHoldFor: 10 * time.Minute}))
	h.client = h.d.NewClient()
	h.serve(func(_ context.Context, task *asynq.Task) error {
		if decodeJob(task).Key == "bad" {
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	ok := h.enqueue(jobTask("ok", 1))
	bad := h.enqueue(jobTask("bad", 1))
	eventually(t, "both settled", func() bool { s := h.d.Stats(); return s.Cooling == 1 && s.FailHeld == 1 })
	heldAfterArchive(t, h, bad.ID)
	_, err := h.client.Enqueue(jobTask("ok", 2), asynq.Queue(h.queue))
	var d *DuplicateTaskError
	if !errors.As(err, &d) || !d.CoolingDown || d.Holder != ok.ID || d.FreeIn < 59*time.Minute || d.FreeIn > time.Hour {
		t.Errorf("after success: %v, want cooling after %s for about the hour of the cooldown", err, ok.ID)
	}
	if d := failedDup(t, h.client, jobTask("bad", 2), h.queue, bad.ID); d.FreeIn > 10*time.Minute || d.FreeIn < 9*time.Minute {
		t.Errorf("after failure: FreeIn %v, want the 10m of FailHoldFor", d.FreeIn)
	}
}

// A failure whose lock owes a RunningDefer follow-up hands the key to the
// follow-up, which runs; its success frees the key.
func TestFailureHandsTheKeyToTheDeferFollowUp(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnConflict: Replace, OnRunning: RunningDefer, OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	release := make(chan struct{})
	ran := make(chan int, 4)
	h.serve(func(_ context.Context, task *asynq.Task) error {
		n := decodeJob(task).N
		ran <- n
		if n == 1 {
			<-release
			return asynq.SkipRetry
		}
		return nil
	}, nil)
	h.enqueue(jobTask("d", 1))
	if n := waitFor(t, ran, "the first run"); n != 1 {
		t.Fatalf("ran %d", n)
	}
	res, err := h.client.Submit(context.Background(), jobTask("d", 2), asynq.Queue(h.queue))
	if err != nil || res.Outcome != Deferred {
		t.Fatalf("Submit while running: %+v %v, want a follow-up", res, err)
	}
	close(release)
	if n := waitFor(t, ran, "the follow-up"); n != 2 {
		t.Fatalf("ran %d, want the follow-up's payload", n)
	}
	eventually(t, "the key frees after the follow-up's success", func() bool {
		_, err := h.client.Enqueue(jobTask("d", 3), asynq.Queue(h.queue))
		return err == nil
	})
	if s := h.d.Stats(); s.FailHeld != 0 {
		t.Errorf("fail_held %d, want 0 (the key went to the follow-up)", s.FailHeld)
	}
}

// An operator releases a failed hold while the archived task runs again by
// hand; a new task takes the key. The re-run failing again must not hold
// the new task's key as its own failure.
func TestFailHoldReleasedWhileTheTaskRunsAgainSparesTheNewTasksKey(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	rerun := make(chan struct{})
	ran := make(chan run, 8)
	var attempts sync.Map
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		ran <- run{id: id, task: task}
		n, _ := attempts.LoadOrStore(id, new(atomic.Int32))
		if decodeJob(task).N == 1 {
			if n.(*atomic.Int32).Add(1) == 2 {
				<-rerun // the run by hand waits
			}
			return fmt.Errorf("still broken: %w", asynq.SkipRetry)
		}
		return nil
	}, nil)
	a := h.enqueue(jobTask("r", 1), asynq.Retention(time.Hour))
	waitFor(t, ran, "the failing run")
	eventually(t, "archived and held", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	if err := h.insp.RunTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ran, "the run by hand")
	if ok, err := h.d.Release(context.Background(), jobTask("r", 0), a.ID, asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("Release during the run by hand: %v %v", ok, err)
	}
	b := h.enqueue(jobTask("r", 2))
	if r := waitFor(t, ran, "the new task"); r.id != b.ID {
		t.Fatalf("ran %s, want %s", r.id, b.ID)
	}
	close(rerun)
	eventually(t, "the run by hand failed again", func() bool { return h.taskState(a.ID) == asynq.TaskStateArchived })
	eventually(t, "settled", func() bool { s := h.d.Stats(); return s.Released+s.FailHeld+s.LockLost >= 3 })
	kl, found, err := h.d.Lookup(context.Background(), jobTask("r", 3), asynq.Queue(h.queue))
	if err != nil || (found && kl.State == "failed") {
		t.Fatalf("after the new task succeeded and the released re-run failed: %+v %v %v, want no failed hold", kl, found, err)
	}
}

// A failed hold does not keep a MaxPending slot: the key's task is not
// waiting.
func TestFailHoldsDoNotFillMaxPending(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{MaxPending: 1, OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	a := h.enqueue(jobTask("a", 1))
	heldAfterArchive(t, h, a.ID)
	failedDup(t, h.client, jobTask("a", 2), h.queue, a.ID)
	if _, err := h.client.Enqueue(jobTask("b", 1), asynq.Queue(h.queue)); err != nil {
		t.Fatalf("a new key with the only other key held after its failure: %v", err)
	}
	failedDup(t, h.client, jobTask("a", 3), h.queue, a.ID)
}

// An operator deletes the archived task that holds its key: the docs list
// only Release as the way out ("held until someone releases it"), and
// Lookup still says failed; Release still frees it.
func TestFailHoldSurvivesTheDeletionOfTheArchivedHolder(t *testing.T) {
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHoldUntilReleased}))
	h.client = h.d.NewClient()
	h.serve(func(context.Context, *asynq.Task) error { return asynq.SkipRetry }, nil)
	a := h.enqueue(jobTask("del", 1))
	eventually(t, "archived and held", func() bool {
		return h.taskState(a.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
		t.Fatal(err)
	}
	failedDup(t, h.client, jobTask("del", 2), h.queue, a.ID)
	kl, found, _ := h.d.Lookup(context.Background(), jobTask("del", 2), asynq.Queue(h.queue))
	if !found || kl.State != "failed" {
		t.Fatalf("Lookup: %+v %v, want failed", kl, found)
	}
	if ok, err := h.d.Release(context.Background(), jobTask("del", 3), a.ID, asynq.Queue(h.queue)); !ok || err != nil {
		t.Fatalf("Release: %v %v", ok, err)
	}
	h.enqueue(jobTask("del", 4))
}

// An attempt on its last retry that asynq gives up at its deadline, with a
// handler that returns the context's error at once: held, failed, with an
// error that says so.
func TestFailHoldHoldsADeadlineOnTheLastRetry(t *testing.T) {
	t.Parallel()
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
	h.client = h.d.NewClient()
	h.serve(func(ctx context.Context, _ *asynq.Task) error { <-ctx.Done(); return ctx.Err() }, nil)
	info := h.enqueue(jobTask("dl", 1), asynq.MaxRetry(0), asynq.Timeout(time.Second))
	eventually(t, "held after asynq archived it", func() bool {
		_, err := h.client.Enqueue(jobTask("dl", 2), asynq.Queue(h.queue))
		var de *DuplicateTaskError
		return errors.As(err, &de) && de.FailHeld && de.Holder == info.ID
	})
	kl, _, _ := h.d.Lookup(context.Background(), jobTask("dl", 3), asynq.Queue(h.queue))
	if kl.State != "failed" || kl.LastError == "" {
		t.Errorf("Lookup: %+v, want failed with an error", kl)
	}
}

// A handler asynq gives up at its deadline on the last retry, under a fail
// hold: asynq archives the task at the deadline, without waiting for the
// handler, and the middleware's settle can only follow. An enqueue that
// lands between the two meets a key still held (the attempt noted, before
// its deadline, that its handler may outlive it), and the settle then
// writes the hold.
func TestFailHoldHoldsTheKeyBetweenAsynqsArchiveAtTheDeadlineAndTheSettle(t *testing.T) {
	t.Parallel()
	rdb := newRDB(t)
	late := &heldBackAfter{open: make(chan struct{})}
	rdb.AddHook(redistest.CmdHook(late.before))
	h := newHarnessOn(t, rdb, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
	h.client = h.d.NewClient()
	h.serve(func(ctx context.Context, _ *asynq.Task) error {
		dl, _ := ctx.Deadline()
		late.from.Store(dl.UnixNano())
		<-ctx.Done()
		return ctx.Err()
	}, nil)
	info := h.enqueue(jobTask("dl", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
	eventually(t, "asynq archived the task, its end not settled yet", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && late.held.Load() > 0
	})
	_, err := h.client.Enqueue(jobTask("dl", 2), asynq.Queue(h.queue))
	var de *DuplicateTaskError
	if !errors.As(err, &de) || de.Holder != info.ID {
		t.Errorf("enqueue between asynq's archive and the settle: %v, want a duplicate of %s", err, info.ID)
	}
	close(late.open)
	eventually(t, "held after the settle", func() bool {
		_, err := h.client.Enqueue(jobTask("dl", 3), asynq.Queue(h.queue))
		return errors.As(err, &de) && de.FailHeld && de.Holder == info.ID
	})
}

// heldBackAfter holds back the library's settle and extend calls made at or
// after the time from (unix ns; 0: none) until open is closed.
type heldBackAfter struct {
	from atomic.Int64
	held atomic.Int64
	open chan struct{}
}

func (h *heldBackAfter) before(cmd redis.Cmder) {
	if from := h.from.Load(); from != 0 && time.Now().UnixNano() >= from && isScript(cmd, "settle", "extend") {
		h.held.Add(1)
		<-h.open
	}
}

// A failure with retries left, returned after the attempt's deadline note
// (the handler still ran LockTimeout before its deadline), before the
// deadline: the key is held for the retry, the retry runs (the note went
// with the handler's end: the retry does not meet its own task busy) and
// its success frees the key.
func TestRetryOfAFailureAfterTheDeadlineNoteRunsAndFreesTheKey(t *testing.T) {
	t.Parallel()
	for name, timeout := range map[string]time.Duration{"in the last LockTimeout": 3 * time.Second, "Timeout below LockTimeout": time.Second} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h, n := noteHarness(t, Rule{OnFailure: FailHold, FailHoldFor: time.Hour})
			runs := make(chan int, 8)
			h.serve(byAttempt(n, map[int]error{0: errors.New("boom")}, runs), nil)
			info := h.enqueue(jobTask("r", 1), asynq.MaxRetry(1), asynq.Timeout(timeout), asynq.Retention(time.Hour))
			waitFor(t, runs, "the first attempt")
			waitFor(t, runs, "the retry")
			eventually(t, "asynq completes the retry", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
			lock := h.keyOf(jobTask("r", 1), h.queue)
			if _, err := h.client.Enqueue(jobTask("r", 2), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("the key's next enqueue after the retry's success: %v (lock %s, mode %v)", err, h.lockState(lock), h.modeFields(lock))
			}
			if s := h.d.Stats(); s.Held != 1 || s.Busy != 0 || s.FailHeld != 0 || s.LockLost != 0 {
				t.Errorf("stats %+v, want held once for the retry", s)
			}
		})
	}
}

// A fail-hold task whose last attempt succeeds after its deadline note:
// the key frees (no hold: it did not fail).
func TestFailHoldSuccessAfterTheDeadlineNoteFreesTheKey(t *testing.T) {
	t.Parallel()
	for _, f := range []Failure{FailHold, FailHoldUntilReleased} {
		t.Run(f.String(), func(t *testing.T) {
			t.Parallel()
			r := Rule{OnFailure: f}
			if f == FailHold {
				r.FailHoldFor = time.Hour
			}
			h, n := noteHarness(t, r)
			h.serve(byAttempt(n, map[int]error{0: nil}, nil), retryInAnHour)
			info := h.enqueue(jobTask("f", 1), asynq.MaxRetry(0), asynq.Timeout(3*time.Second), asynq.Retention(time.Hour))
			eventually(t, "asynq completes it", func() bool { return h.taskState(info.ID) == asynq.TaskStateCompleted })
			if _, err := h.client.Enqueue(jobTask("f", 2), asynq.Queue(h.queue)); err != nil {
				t.Fatalf("the key's next enqueue after the success: %v", err)
			}
			if s := h.d.Stats(); s.FailHeld != 0 || s.Released != 1 {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

// A handler that ignores the deadline of its last retry, under a fail
// hold: asynq archives the task at the deadline without waiting for it, and
// the hold is written then, while the handler still runs, so that a
// worker that dies before it returns (a stuck handler, then kill -9)
// loses nothing. The handler's return later neither restarts nor
// stretches the hold: it only ends the note that it ran on.
func TestFailHoldIsWrittenWhenAsynqArchivesAtTheDeadlineWhileTheHandlerRunsOn(t *testing.T) {
	t.Parallel()
	for _, until := range []bool{false, true} {
		name := "FailHold"
		rule := Rule{OnFailure: FailHold, FailHoldFor: time.Hour}
		if until {
			name, rule = "FailHoldUntilReleased", Rule{OnFailure: FailHoldUntilReleased}
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, jobRulesQuickHeartbeat(rule))
			h.client = h.d.NewClient()
			stuck, back := make(chan struct{}), make(chan struct{})
			h.serve(func(ctx context.Context, _ *asynq.Task) error {
				<-stuck // ignores its deadline
				close(back)
				return nil
			}, nil)
			info := h.enqueue(jobTask("stuck", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
			eventually(t, "asynq archived the task, its handler still running", func() bool {
				return h.taskState(info.ID) == asynq.TaskStateArchived
			})
			var de *DuplicateTaskError
			eventually(t, "the key is held by the failure while the handler runs on", func() bool {
				_, err := h.client.Enqueue(jobTask("stuck", 2), asynq.Queue(h.queue))
				return errors.As(err, &de) && de.FailHeld && de.Holder == info.ID
			})
			kl, _, err := h.d.Lookup(context.Background(), jobTask("stuck", 3), asynq.Queue(h.queue))
			if err != nil || kl.State != "failed" || kl.LastError == "" {
				t.Errorf("Lookup while the handler runs on: %+v, %v; want failed, with asynq's error", kl, err)
			}
			before := kl.TTL
			for range 2 { // the heartbeat renews the note that the handler runs on: never the hold
				h.d.hb.beat(time.Now())
			}
			close(stuck)
			<-back
			mode := store.ModeOf(kl.Key)
			eventually(t, "the handler's end clears its note", func() bool {
				return !h.rdb.HExists(context.Background(), mode, store.FieldOutlived).Val()
			})
			kl, _, err = h.d.Lookup(context.Background(), jobTask("stuck", 4), asynq.Queue(h.queue))
			modeTTL := h.rdb.PTTL(context.Background(), mode).Val()
			switch {
			case err != nil || kl.State != "failed":
				t.Errorf("Lookup after the handler returned: %+v, %v; want failed", kl, err)
			case until && modeTTL != -1 || !until && modeTTL < kl.TTL-time.Second:
				t.Errorf("the key's mode record (its error) lives %v, its lock %v: it must live as long", modeTTL, kl.TTL)
			case until && kl.TTL >= 0:
				t.Errorf("hold TTL %v after the handler returned, want none (until released)", kl.TTL)
			case !until && (kl.TTL > before || kl.TTL < 0):
				t.Errorf("hold TTL %v after the handler returned, %v before: the hold was stretched", kl.TTL, before)
			}
		})
	}
}

// A fail hold shorter than the run of a handler that ignores its last
// retry's deadline: failNow writes the hold as asynq archives the task, and
// the hold's time ends while the handler still runs. The key must still
// count that handler as running until it returns (as it did when the hold
// was written at the return): a new task of the key must not be created,
// and run beside it, and the hold ending on time is no lock loss. Once the
// handler returns, the key frees (the hold's time is over).
func TestFailHoldEndingWhileTheGivenUpHandlerRunsOnKeepsTheKeyUntilItReturns(t *testing.T) {
	t.Parallel()
	const hold = 2 * time.Second
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: hold}))
	h.client = h.d.NewClient()
	stuck, back := make(chan struct{}), make(chan struct{})
	var once sync.Once
	unstick := func() { once.Do(func() { close(stuck) }) }
	defer unstick()
	runs := make(chan int, 8)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		runs <- decodeJob(task).N
		if decodeJob(task).N == 1 {
			<-stuck // ignores its deadline
			close(back)
		}
		return nil
	}, nil)
	info := h.enqueue(jobTask("short", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
	waitFor(t, runs, "the attempt")
	var de *DuplicateTaskError
	eventually(t, "held by the failure while the handler runs on", func() bool {
		_, err := h.client.Enqueue(jobTask("short", 2), asynq.Queue(h.queue))
		return errors.As(err, &de) && de.FailHeld && de.Holder == info.ID
	})
	time.Sleep(hold + 1500*time.Millisecond) // (the hold's time is over; the handler still runs)
	if _, err := h.client.Enqueue(jobTask("short", 3), asynq.Queue(h.queue)); !errors.As(err, &de) || de.Holder != info.ID {
		t.Errorf("enqueue after the hold's time, the given-up handler still running: %v, want a duplicate of %s", err, info.ID)
	}
	select {
	case n := <-runs:
		t.Errorf("task %d ran beside the given-up handler", n)
	default:
	}
	if s := h.d.Stats(); s.LockLost != 0 {
		t.Errorf("stats %+v: the hold ending on time is no lock loss", s)
	}
	unstick()
	<-back
	eventually(t, "the key frees once the handler returned", func() bool {
		_, err := h.client.Enqueue(jobTask("short", 4), asynq.Queue(h.queue))
		return err == nil
	})
}

// A fail-hold task with no retries (its first attempt is its last) whose
// handler ignores the deadline: asynq archives it at the deadline (writing
// its record's message anew: a mark the note put there goes) and failNow
// holds the key. An operator runs the archived task by hand at once, while
// that handler still runs: the run must wait for it (the note, which names
// the task, makes its start meet the key busy), not run beside it. Once the
// handler has returned, a run by hand runs, once, and its success frees
// the key.
func TestRunningTheArchivedTaskByHandWhileItsGivenUpHandlerRunsOnWaitsForIt(t *testing.T) {
	t.Parallel()
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
	h.client = h.d.NewClient()
	stuck, back := make(chan struct{}), make(chan struct{})
	var once sync.Once
	unstick := func() { once.Do(func() { close(stuck) }) }
	defer unstick()
	var n atomic.Int32
	runs := make(chan int, 8)
	h.serve(func(ctx context.Context, task *asynq.Task) error {
		i := int(n.Add(1))
		runs <- i
		if i == 1 {
			<-stuck // ignores its deadline
			close(back)
		}
		return nil
	}, nil)
	info := h.enqueue(jobTask("hand", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second), asynq.Retention(time.Hour))
	waitFor(t, runs, "the attempt")
	eventually(t, "archived and held by the failure", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	busy := h.d.Stats().Busy
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	if i, ok := startedWithinASecond(runs); ok {
		t.Fatalf("the run by hand (run %d) started beside the given-up handler", i)
	}
	if s := h.d.Stats(); s.Busy <= busy {
		t.Errorf("stats %+v: the run by hand did not meet its key busy", s)
	}
	unstick()
	<-back
	eventually(t, "the given-up handler settled", func() bool { return h.d.Stats().Processed >= 1 })
	if st := h.taskState(info.ID); st == asynq.TaskStateArchived {
		if err := h.insp.RunTask(h.queue, info.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, runs, "the run by hand once the handler returned")
	eventually(t, "its success frees the key", func() bool {
		_, err := h.client.Enqueue(jobTask("hand", 2), asynq.Queue(h.queue))
		return err == nil
	})
}

// The worker stops while a handler that asynq gave up at its last retry's
// deadline runs on (asynq's Shutdown does not wait for it: the task is
// archived; then the Dedup closes, its heartbeat with it, as when the
// process is killed). The hold failNow wrote stays, with its error and
// its time, after the note that the handler runs on lapses; doctor --fix
// keeps it; Release frees it, and the key takes a new task. The stopped
// worker's handler returning at last ends only its own note: the new
// holder's key is untouched.
func TestFailHoldWrittenAtTheDeadlineSurvivesTheWorkerStoppingWhileTheHandlerRunsOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: time.Hour})
	h := newHarness(t, cfg)
	h.client = h.d.NewClient()
	operator := dedupctl(t, h)
	stuck, back := make(chan struct{}), make(chan struct{})
	var once sync.Once
	unstick := func() { once.Do(func() { close(stuck) }) }
	defer unstick()
	srv := h.serve(func(context.Context, *asynq.Task) error {
		<-stuck // ignores its deadline
		close(back)
		return nil
	}, func(c *asynq.Config) { c.ShutdownTimeout = time.Second })
	task := jobTask("stop", 1)
	info := h.enqueue(task, asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
	eventually(t, "archived and held by the failure", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	srv.Shutdown()
	_ = h.d.Close()
	key := h.keyOf(task, h.queue)
	mode := store.ModeOf(key)
	eventually(t, "the note that the handler runs on lapses", func() bool {
		o, err := h.rdb.HGet(ctx, mode, store.FieldOutlived).Int64()
		now := h.rdb.Time(ctx).Val().UnixMilli()
		return errors.Is(err, redis.Nil) || err == nil && o <= now
	})
	cfg.Prefix = h.prefix
	h2 := newHarnessOn(t, h.rdb, cfg) // (another worker, on the same keys)
	h2.queue = h.queue
	h2.client = h2.d.NewClient()
	de := failedDup(t, h2.client, jobTask("stop", 2), h.queue, info.ID)
	if de.FreeIn < 59*time.Minute || de.FreeIn > time.Hour {
		t.Errorf("FreeIn %v after the worker stopped, want the hour's rest", de.FreeIn)
	}
	if m := h.modeFields(key); m["e"] == "" {
		t.Errorf("the key's mode record lost the failure's error: %v", m)
	}
	operator("doctor", "--fix", "--grace", "0")
	if o := h.lockOwner(key); o != info.ID {
		t.Fatalf("after doctor --fix: lock holder %q, want the failed %s", o, info.ID)
	}
	if ok, err := h2.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	next, err := h2.client.Enqueue(jobTask("stop", 3), asynq.Queue(h.queue))
	if err != nil {
		t.Fatalf("enqueue after the release: %v", err)
	}
	unstick()
	<-back
	eventually(t, "the stopped worker's handler settled", func() bool { return h.d.Stats().Processed == 1 })
	if o := h.lockOwner(key); o != next.ID {
		t.Errorf("after the stopped worker's handler returned: lock holder %q, want the new task %s", o, next.ID)
	}
	if m := h.modeFields(key); m["id"] != next.ID || m["e"] != "" {
		t.Errorf("after the stopped worker's handler returned: mode record %v, want the new task's", m)
	}
}

// A handler of a fail-hold task's last retry that returns as its deadline
// passes, or just after, with a success or an error: asynq archives the
// task at the deadline, whatever it returns, so the key is held by the
// failure, once (failNow and the handler's return race: whichever writes
// the hold, the other must not write it again, nor count it twice), with
// no note left behind, its mode record as long-lived as its lock.
func TestFailHoldAsTheLastRetrysHandlerReturnsAtItsDeadline(t *testing.T) {
	t.Parallel()
	for _, after := range []time.Duration{0, 20 * time.Millisecond} {
		for _, res := range []error{nil, context.DeadlineExceeded, errors.New("boom")} {
			t.Run(fmt.Sprintf("%v after, %v", after, res), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: time.Hour}))
				h.client = h.d.NewClient()
				h.serve(func(ctx context.Context, _ *asynq.Task) error {
					<-ctx.Done()
					time.Sleep(after)
					return res
				}, nil)
				task := jobTask("at", 1)
				info := h.enqueue(task, asynq.MaxRetry(0), asynq.Timeout(time.Second))
				eventually(t, "archived and settled", func() bool {
					return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().Processed == 1
				})
				failedDup(t, h.client, jobTask("at", 2), h.queue, info.ID)
				key := h.keyOf(task, h.queue)
				if m := h.modeFields(key); m["o"] != "" || m["oa"] != "" || m["e"] == "" {
					t.Errorf("mode record %v: want the failure's error, no note", m)
				}
				lt, mt := h.rdb.PTTL(ctx, key).Val(), h.rdb.PTTL(ctx, store.ModeOf(key)).Val()
				if lt <= 0 || lt > time.Hour || mt < lt-time.Second {
					t.Errorf("lock lives %v, its mode record %v: want the hour's rest, both", lt, mt)
				}
				if s := h.d.Stats(); s.FailHeld != 1 || s.LockLost != 0 || s.RedisErrors != 0 || s.Released != 0 || s.Held != 0 {
					t.Errorf("stats %+v, want fail-held once", s)
				}
			})
		}
	}
}

// A short fail hold written as asynq gave the last retry up, its handler
// running on; an operator releases the key and runs the archived task by
// hand (allowed: the key was freed), and that run takes the key and runs.
// The first handler returns after the hold's time: its end must leave the
// key of the run by hand alone (not end the hold it no longer is).
func TestFailHoldsEndAtTheGivenUpHandlersReturnSparesARunByHandThatTookTheKey(t *testing.T) {
	t.Parallel()
	const hold = time.Second // (ends well before the run by hand's deadline)
	h := newHarness(t, jobRulesQuickHeartbeat(Rule{OnFailure: FailHold, FailHoldFor: hold}))
	h.client = h.d.NewClient()
	ctx := context.Background()
	gates := [3]chan struct{}{nil, make(chan struct{}), make(chan struct{})}
	var once [3]sync.Once
	open := func(i int) { once[i].Do(func() { close(gates[i]) }) }
	defer open(1)
	defer open(2)
	var n atomic.Int32
	runs := make(chan int, 8)
	h.serve(func(context.Context, *asynq.Task) error {
		i := int(n.Add(1))
		runs <- i
		if i < len(gates) {
			<-gates[i] // ignores its deadline
		}
		return nil
	}, nil)
	task := jobTask("byhand", 1)
	info := h.enqueue(task, asynq.MaxRetry(0), asynq.Timeout(3*time.Second), asynq.Retention(time.Hour))
	waitFor(t, runs, "the attempt")
	eventually(t, "archived and held by the failure", func() bool {
		return h.taskState(info.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
	})
	heldAt := time.Now()
	if ok, err := h.d.Release(ctx, task, "", asynq.Queue(h.queue)); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	if err := h.insp.RunTask(h.queue, info.ID); err != nil {
		t.Fatal(err)
	}
	if i := waitFor(t, runs, "the run by hand"); i != 2 {
		t.Fatalf("run %d", i)
	}
	key := h.keyOf(task, h.queue)
	time.Sleep(time.Until(heldAt.Add(hold + 500*time.Millisecond))) // (the hold's time is over)
	if st := h.taskState(info.ID); st != asynq.TaskStateActive {
		t.Fatalf("the run by hand is %v, want still active", st)
	}
	open(1)
	eventually(t, "the first handler's end settled", func() bool { return h.d.Stats().Processed == 1 })
	if o := h.lockOwner(key); o != info.ID {
		t.Errorf("after the first handler returned: lock holder %q, want the run by hand's %s (%v)", o, info.ID, h.modeFields(key))
	}
	if _, err := h.client.Enqueue(jobTask("byhand", 2), asynq.Queue(h.queue)); err == nil {
		t.Errorf("enqueue while the run by hand runs: accepted, want a duplicate")
	}
	open(2)
	eventually(t, "the run by hand's success frees the key", func() bool {
		_, err := h.client.Enqueue(jobTask("byhand", 3), asynq.Queue(h.queue))
		return err == nil
	})
}

// The archived holder of a fail hold written at its deadline is deleted
// by hand while its given-up handler runs on: the hold stays, through the
// handler's return, with its time (FailHold) or until released; nothing
// runs again.
func TestFailHoldWrittenAtTheDeadlineSurvivesTheDeletionOfTheArchivedHolderWhileItsHandlerRunsOn(t *testing.T) {
	t.Parallel()
	for _, until := range []bool{false, true} {
		rule := Rule{OnFailure: FailHold, FailHoldFor: time.Hour}
		if until {
			rule = Rule{OnFailure: FailHoldUntilReleased}
		}
		t.Run(rule.OnFailure.String(), func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, jobRulesQuickHeartbeat(rule))
			h.client = h.d.NewClient()
			stuck := make(chan struct{})
			var once sync.Once
			unstick := func() { once.Do(func() { close(stuck) }) }
			defer unstick()
			runs := make(chan struct{}, 8)
			h.serve(func(context.Context, *asynq.Task) error {
				runs <- struct{}{}
				<-stuck // ignores its deadline
				return nil
			}, nil)
			a := h.enqueue(jobTask("del", 1), asynq.MaxRetry(0), asynq.Timeout(2*time.Second))
			waitFor(t, runs, "the attempt")
			eventually(t, "archived and held", func() bool {
				return h.taskState(a.ID) == asynq.TaskStateArchived && h.d.Stats().FailHeld == 1
			})
			if err := h.insp.DeleteTask(h.queue, a.ID); err != nil {
				t.Fatal(err)
			}
			failedDup(t, h.client, jobTask("del", 2), h.queue, a.ID)
			unstick()
			eventually(t, "the handler's end settled", func() bool { return h.d.Stats().Processed == 1 })
			de := failedDup(t, h.client, jobTask("del", 3), h.queue, a.ID)
			if until && de.FreeIn >= 0 || !until && (de.FreeIn < 59*time.Minute || de.FreeIn > time.Hour) {
				t.Errorf("FreeIn %v after the handler returned", de.FreeIn)
			}
			select {
			case <-runs:
				t.Error("ran again")
			default:
			}
			if ok, err := h.d.Release(context.Background(), jobTask("del", 4), a.ID, asynq.Queue(h.queue)); !ok || err != nil {
				t.Fatalf("Release: %v %v", ok, err)
			}
			if _, err := h.client.Enqueue(jobTask("del", 5), asynq.Queue(h.queue)); err != nil {
				t.Errorf("enqueue after the release: %v", err)
			}
		})
	}
}
