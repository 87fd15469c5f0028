package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// replaceType is the task type of replace mode: "sync user N's profile,
// which is now version V". Only the newest version matters, so a newer
// update should replace an older one that has not run yet, never be refused.
const replaceType = "user:profile-sync"

// replaceSummary is what a replace-mode run observed; runReplace prints it
// and the test checks it.
type replaceSummary struct {
	report
	Phase1, Phase2 *tally
	// Runs per phase, and the users whose runs in it did not end on their
	// latest version (in phase 1 also: did not run exactly once).
	Runs1, Runs2   int
	Stale1, Stale2 int
	// How long phase 1 took to enqueue, then to process; phase 2 in all.
	Enqueue1, Process1, Took2 time.Duration
	// Ran holds the versions each user's runs got, in the order they ran.
	Ran map[int][]int
	// One user per phase to show in the summary: what was sent, what ran.
	sample1, sample2 sample
}

// sample is one user's updates in a phase and the versions its runs got.
type sample struct {
	user          int
	first, latest int
	ran           []int
}

// runReplace shows dedup.Replace with dedup.RunningDefer, in two phases.
//
// Phase 1 enqueues every update before the server starts: each user's first
// update creates its task and every later one replaces that waiting task's
// payload in place, so each user runs once, with its latest version.
//
// Phase 2 sends as many updates again with the workers running. An update
// that finds its user's task running becomes a follow-up task that runs
// once the current run ends, and later updates replace the follow-up's
// payload: a user never runs twice at once, and its last run always has its
// latest version.
//
// It returns an error when Redis cannot be used or any check fails; the
// summary is returned whenever the run got as far as producing.
func runReplace(ctx context.Context, out io.Writer, o options) (*replaceSummary, error) {
	e, err := newEnv(ctx, o, replaceConfig(), replaceType)
	if err != nil {
		return nil, err
	}
	defer e.close()
	r := &replaceRun{
		e:       e,
		o:       o,
		s:       &replaceSummary{report: report{Queue: e.queue}, Phase1: newTally(), Phase2: newTally()},
		perUser: (o.Enqueues + o.Users - 1) / o.Users,
	}
	phaseErr := r.phases(ctx)
	var c checks
	r.settle(ctx, &c, phaseErr)
	r.check(&c)
	r.s.FailedChecks = c

	printReplace(printer{out}, r.s, o, e.where)
	return r.s, c.err()
}

// replaceConfig puts the type's whole policy in its rule, so no enqueue can
// forget it: key on user_id; a newer payload replaces a waiting one;
// updates that meet a running user are folded into one follow-up task.
func replaceConfig() dedup.Config {
	return dedup.Config{Rules: map[string]dedup.Rule{replaceType: {
		Fields:     []string{"user_id"},
		OnConflict: dedup.Replace,
		OnRunning:  dedup.RunningDefer,
	}}}
}

// replaceRun is one replace-mode run, carried from step to step.
type replaceRun struct {
	e            *env
	o            options
	s            *replaceSummary
	perUser      int           // most updates a user gets per phase
	sent1, sent2 int           // updates each phase sent
	runs1        map[int][]int // the runs by the end of phase 1
}

// phases runs phase 1 and, if it went well, phase 2, both within
// o.Timeout. It returns the first error.
func (r *replaceRun) phases(ctx context.Context) error {
	wctx, cancel := context.WithTimeout(ctx, r.o.Timeout)
	defer cancel()
	if err := r.phase1(wctx); err != nil {
		return err
	}
	return r.phase2(wctx)
}

// phase1 sends every update before the server starts, so all of them meet
// waiting tasks; then it starts the server and waits for the runs.
func (r *replaceRun) phase1(ctx context.Context) error {
	t0 := time.Now()
	r.sent1 = produce(ctx, r.o.Producers, replaceType, newPlan(r.o, 0).next, r.send, r.s.Phase1)
	r.s.Enqueue1 = time.Since(t0)
	err := r.e.start()
	if err == nil {
		err = r.e.w.waitFor(ctx, r.s.Phase1.Created)
	}
	r.s.Process1 = time.Since(t0) - r.s.Enqueue1
	r.runs1 = r.e.w.runsOf()
	return err
}

// phase2 sends newer versions with the workers running. It follows a
// finished phase 1 (every lock settled), so each user starts free.
func (r *replaceRun) phase2(ctx context.Context) error {
	t0 := time.Now()
	r.sent2 = produce(ctx, r.o.Producers, replaceType, newPlan(r.o, r.perUser).next, r.send, r.s.Phase2)
	err := r.e.w.waitFor(ctx, r.s.Phase1.Created+r.s.Phase2.Created+r.s.Phase2.Deferred)
	r.s.Took2 = time.Since(t0)
	return err
}

// send uses Submit because, unlike EnqueueContext, it says whether the
// update created a task, replaced a waiting one's payload, or was deferred
// behind a running one.
func (r *replaceRun) send(ctx context.Context, t *asynq.Task) (dedup.Result, error) {
	return r.e.client.Submit(ctx, t, asynq.Queue(r.e.queue))
}

// settle finishes the environment's part of the summary and the checks,
// then splits the runs it recorded by phase.
func (r *replaceRun) settle(ctx context.Context, c *checks, phaseErr error) {
	s := r.s
	all := newTally()
	all.merge(s.Phase1)
	all.merge(s.Phase2)
	r.e.finish(ctx, &s.report, c, phaseErr, all)
	s.Ran = r.e.w.runsOf()
	s.Runs1, s.Stale1, s.sample1 = phaseRuns(s.Phase1, r.runs1, nil, 1)
	s.Runs2, s.Stale2, s.sample2 = phaseRuns(s.Phase2, s.Ran, r.runs1, r.perUser+1)
}

// check adds what replace mode promises: in phase 1 one run per user with
// its latest version; in phase 2 a run per new task or follow-up, each user
// ending on its latest version; no run ever going back a version.
func (r *replaceRun) check(c *checks) {
	s, o := r.s, r.o
	active := min(o.Users, o.Enqueues) // users that get updates
	p1, p2 := s.Phase1, s.Phase2
	c.add(r.sent1 == o.Enqueues, "phase 1: only %s of %s updates were sent", commas(r.sent1), commas(o.Enqueues))
	c.add(p1.Created == active, "phase 1: %s new tasks, want one per user (%s)", commas(p1.Created), commas(active))
	c.add(p1.Replaced == r.sent1-active, "phase 1: %s replaced, want every update but each user's first (%s)", commas(p1.Replaced), commas(r.sent1-active))
	c.add(p1.Deferred == 0 && p1.Rejected == 0, "phase 1: %s deferred and %s rejected with no worker running", commas(p1.Deferred), commas(p1.Rejected))
	c.add(s.Runs1 == active && s.Stale1 == 0, "phase 1: %s runs, %s users did not run exactly once with their latest version", commas(s.Runs1), commas(s.Stale1))
	c.add(r.sent2 == o.Enqueues, "phase 2: only %s of %s updates were sent", commas(r.sent2), commas(o.Enqueues))
	c.add(p2.Rejected == 0, "phase 2: %s updates rejected", commas(p2.Rejected))
	c.add(s.Runs2 == p2.Created+p2.Deferred, "phase 2: %s runs, want new tasks + deferred (%s)", commas(s.Runs2), commas(p2.Created+p2.Deferred))
	c.add(s.Stale2 == 0, "phase 2: %s users' last run did not have their latest version", commas(s.Stale2))
	c.add(s.Backwards == 0, "%s runs got a version no newer than their user's previous run", commas(s.Backwards))
}

// plan hands a phase's updates (update i is for user i % o.Users) to the
// producers: producer p owns the users u with u % o.Producers == p and sends
// each one's updates back to back, oldest first. So a user's updates go out
// one at a time, in order, and its "latest" is well defined; and in phase 2
// a user's burst meets its own task waiting, then running, then done.
type plan struct {
	todo [][]update // per producer: what it has left to send
}

func newPlan(o options, lastVersion int) *plan {
	pl := &plan{todo: make([][]update, o.Producers)}
	for u := range min(o.Users, o.Enqueues) {
		p := u % o.Producers
		for i := u; i < o.Enqueues; i += o.Users {
			pl.todo[p] = append(pl.todo[p], update{user: u, version: lastVersion + i/o.Users + 1})
		}
	}
	return pl
}

// next is called for producer p by p's goroutine only, and each touches
// only its own list, so no lock is needed.
func (pl *plan) next(p int) (update, bool) {
	todo := pl.todo[p]
	if len(todo) == 0 {
		return update{}, false
	}
	pl.todo[p] = todo[1:]
	return todo[0], true
}

// phaseRuns compares the runs of a phase (runs minus before, the runs before
// it) with the updates it sent, whose versions start at first. It returns
// how many runs the phase had, how many users are stale — their last run did
// not have their latest version, or, in the first phase (before == nil), they
// did not run exactly once — and the user to show: the one with the most
// runs, which in phase 2 shows a follow-up at work.
func phaseRuns(t *tally, runs, before map[int][]int, first int) (n, stale int, show sample) {
	show.user = -1
	for user, latest := range t.latest {
		ran := runs[user][len(before[user]):]
		n += len(ran)
		switch {
		case len(ran) == 0 || ran[len(ran)-1] != latest:
			stale++
		case before == nil && len(ran) != 1:
			stale++
		}
		if show.user < 0 || len(ran) > len(show.ran) || len(ran) == len(show.ran) && user < show.user {
			show = sample{user: user, first: first, latest: latest, ran: ran}
		}
	}
	return n, stale, show
}

func printReplace(p printer, s *replaceSummary, o options, where string) {
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "NO"
	}
	p.line("dedup example (replace): %s updates over %s users, per phase (queue %s, %s)", commas(o.Enqueues), commas(o.Users), s.Queue, where)
	p.line("phase 1: all enqueued before the workers start (enqueue %.1fs, then process %.1fs)", s.Enqueue1.Seconds(), s.Process1.Seconds())
	p.line("  %-24s: %s", "new tasks", commas(s.Phase1.Created))
	p.line("  %-24s: %-7s (each waiting task keeps its place; its payload is now the latest)", "replaced waiting payload", commas(s.Phase1.Replaced))
	p.enqueueErrors("enqueue errors", s.Phase1)
	p.line("  %-24s: %-7s (every user once, with its latest version: %s)", "processed", commas(s.Runs1), yes(s.Stale1 == 0 && s.Runs1 == s.Phase1.Created))
	p.sample(s.sample1)
	p.line("phase 2: as many again while the workers run, each user's updates back to back (%.1fs)", s.Took2.Seconds())
	p.line("  %-24s: %-7s (the user had no task waiting or running)", "new tasks", commas(s.Phase2.Created))
	p.line("  %-24s: %-7s (into the user's waiting task, or its follow-up)", "replaced waiting payload", commas(s.Phase2.Replaced))
	p.line("  %-24s: %-7s (the user was running: a follow-up task runs once it is done)", "deferred behind a run", commas(s.Phase2.Deferred))
	p.enqueueErrors("enqueue errors", s.Phase2)
	p.line("  %-24s: %-7s (= new tasks + deferred: %s; every user ended on its latest version: %s)",
		"processed", commas(s.Runs2), yes(s.Runs2 == s.Phase2.Created+s.Phase2.Deferred), yes(s.Stale2 == 0))
	p.sample(s.sample2)
	p.line("both phases:")
	p.line("  %-24s: %-7s (no run of a user got an older version than its run before)", "runs in version order", yes(s.Backwards == 0))
	st := s.Stats
	p.footer(&s.report,
		stat{"locked", st.Locked}, stat{"replaced", st.Replaced}, stat{"deferred", st.Deferred}, stat{"started", st.Started},
		stat{"released", st.Released}, stat{"busy", st.Busy}, stat{"lock lost", st.LockLost}, stat{"redis errors", st.RedisErrors})
}

// sample prints one user's story in a phase: what was sent, what ran.
func (p printer) sample(s sample) {
	if s.user < 0 {
		return
	}
	ran := make([]string, len(s.ran))
	for i, v := range s.ran {
		ran[i] = fmt.Sprintf("v%d", v)
	}
	p.line("  %-24s  e.g. user %d: sent v%d…v%d, ran %d× (%s)", "", s.user, s.first, s.latest, len(s.ran), strings.Join(ran, ", "))
}
