package main

import (
	"context"
	"fmt"
	"io"
	"sync/atomic"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// rejectType is the task type of reject mode: a request to reindex a user,
// which one run does for all requests waiting at the time.
const rejectType = "user:reindex"

// rejectSummary is what a reject-mode run observed; runReject prints it and
// the test checks it.
type rejectSummary struct {
	report
	tally
}

// runReject shows the default policy: while a user's task is queued or
// running, further enqueues for that user are refused with a
// *dedup.DuplicateTaskError, which also matches asynq.ErrDuplicateTask, so
// code written for asynq.Unique keeps working. The producers use
// EnqueueContext, the drop-in replacement for asynq's.
//
// It returns an error when Redis cannot be used or any check fails; the
// summary is returned whenever the run got as far as producing.
func runReject(ctx context.Context, out io.Writer, o options) (*rejectSummary, error) {
	e, err := newEnv(ctx, o, dedup.Config{}, rejectType)
	if err != nil {
		return nil, err
	}
	defer e.close()
	// Start before producing, so tasks finish while others are still being
	// enqueued: that is what frees keys for later enqueues of the same user.
	if err := e.start(); err != nil {
		return nil, err
	}
	wctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()

	s := &rejectSummary{report: report{Queue: e.queue}, tally: *newTally()}
	// Any producer takes the next enqueue, so two producers may well race
	// for the same user; the lock script decides which one wins.
	var next atomic.Int64
	claim := func(int) (update, bool) {
		i := int(next.Add(1) - 1)
		return update{user: i % o.Users}, i < o.Enqueues
	}
	send := func(ctx context.Context, t *asynq.Task) (dedup.Result, error) {
		info, err := e.client.EnqueueContext(ctx, t, asynq.Queue(e.queue), dedup.Fields("user_id"))
		if err != nil {
			return dedup.Result{}, err
		}
		// With the default policies an enqueue that is not refused created
		// its task.
		return dedup.Result{Outcome: dedup.Created, TaskID: info.ID, Info: info}, nil
	}
	attempted := produce(wctx, o.Producers, rejectType, claim, send, &s.tally)

	// All enqueues are in; wait for the server to finish every accepted task.
	waitErr := e.w.waitFor(wctx, s.Created)
	cancel()

	var c checks
	e.finish(ctx, &s.report, &c, waitErr, &s.tally)
	c.add(attempted == o.Enqueues, "only %s of %s enqueues were attempted", commas(attempted), commas(o.Enqueues))
	c.add(s.Created+s.Rejected+s.Errors == attempted, "accepted + rejected + errors (%d) != attempted (%d)", s.Created+s.Rejected+s.Errors, attempted)
	c.add(s.NotAsynqDup == 0, "%s DuplicateTaskErrors did not match asynq.ErrDuplicateTask", commas(s.NotAsynqDup))
	c.add(s.Processed == s.Created, "processed (%s) != accepted (%s)", commas(s.Processed), commas(s.Created))
	s.FailedChecks = c

	printReject(printer{out}, s, o, e.where)
	return s, c.err()
}

func printReject(p printer, s *rejectSummary, o options, where string) {
	p.line("dedup example (reject): %s enqueues over %s users (queue %s, %s)", commas(o.Enqueues), commas(o.Users), s.Queue, where)
	p.line("  %-24s: %s", "accepted (new tasks)", commas(s.Created))
	rej := commas(s.Rejected)
	if s.SampleHolder != "" {
		rej = fmt.Sprintf("%-7s e.g. held by task %s  (errors.Is(err, asynq.ErrDuplicateTask) = %t)", rej, s.SampleHolder, s.NotAsynqDup == 0)
	}
	p.line("  %-24s: %s", "rejected as duplicates", rej)
	p.enqueueErrors("other enqueue errors", &s.tally)
	p.line("  %-24s: %s", "processed", commas(s.Processed))
	if s.Created > o.Users {
		p.line("  (accepted > %s users: a user's key is free again once its task is done, so a later", commas(o.Users))
		p.line("   enqueue for that user starts a new task; duplicates are refused only while one is")
		p.line("   queued or running.)")
	}
	st := s.Stats
	p.footer(&s.report,
		stat{"locked", st.Locked}, stat{"duplicates", st.Duplicates}, stat{"started", st.Started}, stat{"released", st.Released},
		stat{"busy", st.Busy}, stat{"lock lost", st.LockLost}, stat{"redis errors", st.RedisErrors})
}
