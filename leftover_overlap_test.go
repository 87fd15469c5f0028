package dedup

import (
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// The invariant TestLifecycleMatrix checks: "no key ever had two live tasks
// or two overlapping runs (except under RunningAllow)". asynq gives up an
// attempt whose Timeout passed and retries it while its handler, which
// ignores its context, still runs. failures.md: the key "is held for the
// retry asynq makes, never released under it" and the outlived note keeps it
// from healing under the leftover. The retry's start checks the key (it is
// run again): it must not run beside the leftover handler of its own key.
func TestRetryDoesNotRunBesideTheLeftoverHandlerOfItsGivenUpAttempt(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		release := make(chan struct{})
		defer close(release)
		rc := newRecorder(func(r run) error {
			if r.retry == 0 {
				<-release // ignores its context: outlives its Timeout
			}
			return nil
		})
		h.serve(rc.handler(), nil) // (retry delay 50 ms)
		a := h.enqueue(counterTask("k", 1, 1), asynq.Timeout(time.Second), asynq.MaxRetry(3))
		waitFor(t, rc.runs, "the first attempt runs")
		eventually(t, "asynq gives the attempt up and the retry is due or done", func() bool {
			if len(rc.runs) > 0 {
				return true
			}
			ti, err := h.insp.GetTaskInfo(h.queue, a.ID)
			return err == nil && ti.Retried > 0 && ti.State == asynq.TaskStateRetry && ti.NextProcessAt.Before(time.Now().Add(-time.Second))
		})
		if len(rc.runs) > 0 {
			r := <-rc.runs
			t.Fatalf("the retry of %s (retry %d) runs while the handler of its given-up attempt still runs", r.id, r.retry)
		}
	})
}
