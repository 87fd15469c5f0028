package dedup

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The Scheduler's tests run replicas (Schedulers, each on its own Dedup and
// Redis client, as in separate pods) against one real asynq server, label
// every run by the firing it carries (SchedulerFiringHeader) and count:
// exactly one run per firing, and no firing missing between the first and
// the last seen. Clocks are skewed through the Scheduler's clock hook.

const schedType = "sched:report"

func schedTask() *asynq.Task { return asynq.NewTask(schedType, []byte(`{"report":"daily"}`)) }

// schedRuns records the runs of a Scheduler's tasks by entry and firing.
type schedRuns struct {
	t      *testing.T
	mu     sync.Mutex
	runs   map[string]map[time.Time]int // entry → firing → runs
	fresh  chan struct{}                // a send for each firing run for the first time
	labels int
}

func newSchedRuns(t *testing.T) *schedRuns {
	return &schedRuns{t: t, runs: map[string]map[time.Time]int{}, fresh: make(chan struct{}, 10000)}
}

func (r *schedRuns) handler() asynq.HandlerFunc {
	return func(_ context.Context, task *asynq.Task) error {
		entry, at, ok := SchedulerFiring(task)
		if !ok {
			r.t.Errorf("a task without the scheduler's headers: %v", task.Headers())
			return nil
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.runs[entry] == nil {
			r.runs[entry] = map[time.Time]int{}
		}
		r.runs[entry][at]++
		if r.runs[entry][at] == 1 {
			r.labels++
			r.fresh <- struct{}{}
		}
		return nil
	}
}

// waitFirings waits until n more firings have run for the first time.
func (r *schedRuns) waitFirings(n int) {
	r.t.Helper()
	for i := range n {
		waitFor(r.t, r.fresh, fmt.Sprintf("firing %d of %d", i+1, n))
	}
}

// firings returns the firings of entry that ran, in order, with their runs.
func (r *schedRuns) firings(entry string) ([]time.Time, map[time.Time]int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.runs[entry]
	ats := slices.SortedFunc(maps.Keys(m), time.Time.Compare)
	return ats, maps.Clone(m)
}

// checkOncePerFiring fails the test unless each firing of entry ran exactly
// once, and every firing between the first and the last seen ran; it
// returns how many firings ran.
func (r *schedRuns) checkOncePerFiring(entry string, period time.Duration) int {
	r.t.Helper()
	ats, runs := r.firings(entry)
	if len(ats) == 0 {
		r.t.Fatalf("entry %s: no firing ran", entry)
	}
	for i, at := range ats {
		if runs[at] != 1 {
			r.t.Errorf("entry %s: firing %s ran %d times, want once", entry, at.Format(time.TimeOnly), runs[at])
		}
		if i > 0 && at.Sub(ats[i-1]) != period {
			r.t.Errorf("entry %s: firings missing between %s and %s", entry, ats[i-1].Format(time.TimeOnly), at.Format(time.TimeOnly))
		}
	}
	r.t.Logf("entry %s: %d firings from %s to %s, each run once", entry[:8], len(ats), ats[0].Format(time.TimeOnly), ats[len(ats)-1].Format(time.TimeOnly))
	return len(ats)
}

// entries returns the entries that ran.
func (r *schedRuns) entries() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.runs))
}

// drained waits until the queues hold no task that has yet to run.
func drained(t *testing.T, insp *asynq.Inspector, queues ...string) {
	t.Helper()
	eventually(t, "queues drained", func() bool {
		for _, q := range queues {
			qi, err := insp.GetQueueInfo(q)
			if err != nil || qi.Pending+qi.Active+qi.Scheduled+qi.Retry > 0 {
				return false
			}
		}
		return true
	})
}

// schedReplica is a replica: its own Redis client, Dedup (sharing h's
// prefix) and Scheduler, whose clock reads offset ahead of the host's.
func schedReplica(t *testing.T, h *harness, rdb redis.UniversalClient, offset time.Duration, opts *SchedulerOpts) *Scheduler {
	t.Helper()
	if rdb == nil {
		rdb = newRDB(t)
	}
	d, err := New(context.Background(), rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: h.d.cfg.Rules})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if opts == nil {
		opts = &SchedulerOpts{}
	}
	if opts.Logger == nil {
		opts.Logger = quietLogger()
	}
	s := NewScheduler(d, opts)
	s.now = func() time.Time { return time.Now().Add(offset) }
	t.Cleanup(s.Shutdown) // before d.Close (cleanups run last first)
	return s
}

// register registers the test's entry, @every 1s in h's queue, on every
// replica, and returns its ID (the same on all).
func register(t *testing.T, h *harness, replicas ...*Scheduler) string {
	t.Helper()
	var id string
	for i, s := range replicas {
		got, err := s.Register("@every 1s", schedTask(), asynq.Queue(h.queue), asynq.MaxRetry(1))
		if err != nil {
			t.Fatal(err)
		}
		if i > 0 && got != id {
			t.Fatalf("replica %d registered entry %s, replica 0 %s", i, got, id)
		}
		id = got
	}
	return id
}

func startAll(t *testing.T, replicas ...*Scheduler) {
	t.Helper()
	for _, s := range replicas {
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
	}
}

func shutdownAll(replicas ...*Scheduler) {
	for _, s := range replicas {
		s.Shutdown()
	}
}

func TestSchedulerSkewedReplicasRunEachFiringOnce(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	var replicas []*Scheduler
	for _, off := range []time.Duration{-2 * time.Second, 0, 2 * time.Second} {
		replicas = append(replicas, schedReplica(t, h, nil, off, nil))
	}
	id := register(t, h, replicas...)
	startAll(t, replicas...)
	runs.waitFirings(10) // about 6 s: the replicas 2 s apart start on firings 4 s apart
	shutdownAll(replicas...)
	drained(t, h.insp, h.queue)
	if n := runs.checkOncePerFiring(id, time.Second); n < 10 {
		t.Errorf("%d firings ran, want 10 or more", n)
	}
}

// The test above has teeth: replicas further apart than MaxSkew do run
// firings twice.
func TestSchedulerReplicasFurtherApartThanMaxSkewRunFiringsTwice(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	opts := func() *SchedulerOpts { return &SchedulerOpts{MaxSkew: time.Millisecond} }
	replicas := []*Scheduler{schedReplica(t, h, nil, -time.Second, opts()), schedReplica(t, h, nil, time.Second, opts())}
	id := register(t, h, replicas...)
	startAll(t, replicas...)
	runs.waitFirings(8) // the slow replica reaches the fast one's first firing after 2 s
	shutdownAll(replicas...)
	drained(t, h.insp, h.queue)
	ats, n := runs.firings(id)
	twice := 0
	for _, at := range ats {
		if n[at] > 1 {
			twice++
		}
	}
	if twice == 0 {
		t.Errorf("clocks 2 s apart with MaxSkew 1ms: no firing of %d ran twice", len(ats))
	}
	t.Logf("clocks 2 s apart with MaxSkew 1ms: %d of %d firings ran twice", twice, len(ats))
}

func TestSchedulerReplicaShutdownMidRunMissesNoFiring(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	fast := schedReplica(t, h, nil, 2*time.Second, nil) // it takes nearly every firing
	others := []*Scheduler{schedReplica(t, h, nil, -time.Second, nil), schedReplica(t, h, nil, 0, nil)}
	id := register(t, h, append(others, fast)...)
	startAll(t, append(others, fast)...)
	runs.waitFirings(3)
	fast.Shutdown()
	runs.waitFirings(4)
	shutdownAll(others...)
	drained(t, h.insp, h.queue)
	runs.checkOncePerFiring(id, time.Second)
}

func TestSchedulerReplicaKilledMidRunMissesNoFiring(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	replicas := []*Scheduler{schedReplica(t, h, nil, -time.Second, nil), schedReplica(t, h, nil, 0, nil)}
	id := register(t, h, replicas...)
	// The replica in another process runs 2 s ahead: it takes nearly every
	// firing until it is killed.
	w := startSchedWorker(t, h, 2*time.Second)
	startAll(t, replicas...)
	created := schedWorkerCreated(h)
	faultPoll(t, 30*time.Second, "the worker process enqueued 2 firings", func() bool { return len(created()) >= 2 })
	w.kill()
	killedAfter := len(created())
	runs.waitFirings(4)
	shutdownAll(replicas...)
	drained(t, h.insp, h.queue)
	runs.checkOncePerFiring(id, time.Second)
	if got := runs.entries(); len(got) != 1 {
		t.Errorf("tasks of entries %v, want only %s (the worker process registered the same entry)", got, id)
	}
	if n := len(created()); n != killedAfter {
		t.Errorf("the killed worker enqueued %d firings after SIGKILL", n-killedAfter)
	}
	t.Logf("the worker process enqueued %d firings before SIGKILL", killedAfter)
}

func TestSchedulerStartedLateEnqueuesNoEarlierFiring(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	early := schedReplica(t, h, nil, 0, nil)
	var (
		mu        sync.Mutex
		attempted []time.Time
	)
	late := schedReplica(t, h, nil, 0, &SchedulerOpts{PreEnqueueFunc: func(task *asynq.Task, _ []asynq.Option) {
		_, at, _ := SchedulerFiring(task)
		mu.Lock()
		attempted = append(attempted, at)
		mu.Unlock()
	}})
	id := register(t, h, early, late)
	startAll(t, early)
	runs.waitFirings(3) // firings the late replica was not there for
	startedAt := late.now()
	startAll(t, late)
	runs.waitFirings(3)
	shutdownAll(early, late)
	drained(t, h.insp, h.queue)
	runs.checkOncePerFiring(id, time.Second)
	mu.Lock()
	defer mu.Unlock()
	if len(attempted) == 0 {
		t.Fatal("the late replica attempted no firing")
	}
	for _, at := range attempted {
		if !at.After(startedAt) {
			t.Errorf("the replica started at %s enqueued the earlier firing %s", startedAt.Format(time.StampMilli), at.Format(time.StampMilli))
		}
	}
}

// hookLog records one replica's hook calls, pairing each PostEnqueueFunc
// call with the firing its PreEnqueueFunc call named (one entry: a
// replica's enqueues of it follow one another).
type hookLog struct {
	mu       sync.Mutex
	pending  time.Time
	pre      []time.Time
	post     map[time.Time]error
	errCalls []error
}

func (l *hookLog) opts() *SchedulerOpts {
	l.post = map[time.Time]error{}
	return &SchedulerOpts{
		PreEnqueueFunc: func(task *asynq.Task, _ []asynq.Option) {
			_, at, _ := SchedulerFiring(task)
			l.mu.Lock()
			defer l.mu.Unlock()
			l.pending = at
			l.pre = append(l.pre, at)
		},
		PostEnqueueFunc: func(_ *asynq.TaskInfo, err error) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.post[l.pending] = err
		},
		EnqueueErrorHandler: func(_ *asynq.Task, _ []asynq.Option, err error) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.errCalls = append(l.errCalls, err)
		},
	}
}

func TestSchedulerHooksSeeEveryFiringAndDuplicatesSkipTheErrorHandler(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	logs := []*hookLog{{}, {}}
	a, b := schedReplica(t, h, nil, 0, logs[0].opts()), schedReplica(t, h, nil, 0, logs[1].opts())
	id := register(t, h, a, b)
	startAll(t, a, b)
	runs.waitFirings(3)
	shutdownAll(a, b)
	drained(t, h.insp, h.queue)
	runs.checkOncePerFiring(id, time.Second)
	both := 0
	for _, l := range logs {
		l.mu.Lock()
		if len(l.pre) != len(l.post) || len(l.pre) == 0 {
			t.Errorf("PreEnqueueFunc called %d times, PostEnqueueFunc %d (firings: %d)", len(l.pre), len(l.post), len(l.post))
		}
		if len(l.errCalls) != 0 {
			t.Errorf("EnqueueErrorHandler called with %v", l.errCalls)
		}
		l.mu.Unlock()
	}
	for at, errA := range logs[0].post {
		errB, ok := logs[1].post[at]
		if !ok || errors.Is(errA, context.Canceled) || errors.Is(errB, context.Canceled) {
			continue // (an enqueue Shutdown cut short)
		}
		both++
		var dup *DuplicateTaskError
		switch {
		case errA == nil && errors.As(errB, &dup), errB == nil && errors.As(errA, &dup):
		default:
			t.Errorf("firing %s: replica errors %v and %v, want one nil and one *DuplicateTaskError", at.Format(time.TimeOnly), errA, errB)
		}
	}
	if both < 2 {
		t.Errorf("%d firings enqueued by both replicas, want 2 or more", both)
	}
}

func TestSchedulerEnqueueErrorHandlerGetsRealErrors(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	// No server: the first firing's task waits, and MaxPending 1 refuses
	// the next firings (ErrTooManyPending), a real error.
	h := newHarness(t, Config{Rules: map[string]Rule{schedType: {MaxPending: 1}}})
	logs := []*hookLog{{}, {}}
	failed := make(chan struct{}, 100)
	replicas := make([]*Scheduler, 2)
	for i, l := range logs {
		opts := l.opts()
		handler := opts.EnqueueErrorHandler
		opts.EnqueueErrorHandler = func(task *asynq.Task, o []asynq.Option, err error) {
			handler(task, o, err)
			failed <- struct{}{}
		}
		replicas[i] = schedReplica(t, h, nil, 0, opts)
	}
	register(t, h, replicas...)
	startAll(t, replicas...)
	waitFor(t, failed, "a real enqueue error")
	shutdownAll(replicas...)
	created, dups, errs := 0, 0, 0
	for _, l := range logs {
		l.mu.Lock()
		pending := 0
		for _, err := range l.post {
			var dup *DuplicateTaskError
			switch {
			case err == nil:
				created++
			case errors.As(err, &dup):
				dups++
			case errors.Is(err, ErrTooManyPending):
				pending++
			}
		}
		for _, err := range l.errCalls {
			if !errors.Is(err, ErrTooManyPending) {
				t.Errorf("EnqueueErrorHandler got %v, want ErrTooManyPending", err)
			}
		}
		if len(l.errCalls) != pending {
			t.Errorf("EnqueueErrorHandler called %d times for %d ErrTooManyPending", len(l.errCalls), pending)
		}
		errs += pending
		l.mu.Unlock()
	}
	if created != 1 || errs == 0 {
		t.Errorf("created %d, duplicates %d, errors %d: want 1 created and errors", created, dups, errs)
	}
	t.Logf("created %d, duplicates %d (no EnqueueErrorHandler call), errors %d", created, dups, errs)
}

func TestSchedulerHoldsAFiringsKeyPastItsSuccess(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	ran := make(chan *asynq.Task, 100)
	h.serve(func(_ context.Context, task *asynq.Task) error { ran <- task; return nil }, nil)
	var opts atomic.Value
	s := schedReplica(t, h, nil, 0, &SchedulerOpts{MaxSkew: 3 * time.Second, PreEnqueueFunc: func(_ *asynq.Task, o []asynq.Option) { opts.Store(o) }})
	id := register(t, h, s)
	startAll(t, s)
	task := waitFor(t, ran, "a firing")
	s.Shutdown()
	_, at, _ := SchedulerFiring(task)
	var descs []string
	for _, o := range opts.Load().([]asynq.Option) {
		descs = append(descs, o.String())
	}
	if !slices.Contains(descs, "dedup.firingHold(4s)") { // next firing 1 s later, + MaxSkew
		t.Fatalf("firing options %v do not hold the key for 4s", descs)
	}
	key := h.keyOf(asynq.NewTask(schedType, nil), h.queue, Key(fmt.Sprintf("%s@%d", id, at.Unix())))
	eventually(t, "the succeeded firing's task is done", func() bool {
		st := h.taskState(task.ResultWriter().TaskID())
		return st == 0 || st == asynq.TaskStateCompleted
	})
	if v := h.rdb.Get(context.Background(), key).Val(); !strings.HasPrefix(v, "~x:") {
		t.Fatalf("the succeeded firing's key: %q, want held until its window ends", v)
	}
	left := h.rdb.PTTL(context.Background(), key).Val()
	if left <= 0 || left > 4*time.Second {
		t.Errorf("the key of firing %s is held %v more, want up to 4s", at.Format(time.TimeOnly), left)
	}
}

func TestSchedulerSkipsAFiringItWokeTooLateFor(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	var (
		jump      atomic.Int64 // added to the clock: a suspended process, a clock step
		attempted = make(chan time.Time, 100)
	)
	s := schedReplica(t, h, nil, 0, &SchedulerOpts{PreEnqueueFunc: func(task *asynq.Task, _ []asynq.Option) {
		_, at, _ := SchedulerFiring(task)
		attempted <- at
		jump.Store(int64(5 * time.Second)) // from the first firing on, the clock reads 5 s later
	}})
	s.now = func() time.Time { return time.Now().Add(time.Duration(jump.Load())) }
	register(t, h, s)
	startAll(t, s)
	first := waitFor(t, attempted, "the first firing")
	second := waitFor(t, attempted, "the firing after the jump")
	s.Shutdown()
	if second.Sub(first) < 5*time.Second {
		t.Errorf("after a 5 s jump at firing %s, the next firing enqueued was %s: firings it woke too late for were enqueued late",
			first.Format(time.TimeOnly), second.Format(time.TimeOnly))
	}
}

func TestSchedulerRegisterRefusesOptionsThatBreakOneRunPerFiring(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, nil)
	cases := map[string][]asynq.Option{
		"Key":         {Key("k")},
		"SharedKey":   {SharedKey("k")},
		"Fields":      {Fields("report")},
		"Skip":        {Skip()},
		"TaskID":      {asynq.TaskID("fixed")},
		"Cooldown":    {Cooldown(time.Hour)},
		"Period":      {Period(time.Hour, nil)},
		"OnFailure":   {OnFailure(FailHoldUntilReleased, 0)},
		"OnConflict":  {OnConflict(Replace)},
		"MergeWith":   {MergeWith(func(a, _ []byte) ([]byte, error) { return a, nil })},
		"Debounce":    {Debounce(time.Second)},
		"Unique":      {asynq.Unique(time.Minute)},
		"bad TTL":     {TTL(-1)},
		"blank queue": {asynq.Queue(" ")},
	}
	for name, opts := range cases {
		if _, err := s.Register("@every 1m", schedTask(), opts...); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: err = %v, want ErrInvalidOption", name, err)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	if _, err := s.Register("@every 1m", asynq.NewTask(schedType, nil, asynq.TaskID("in-newtask"))); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("TaskID in NewTask: err = %v, want ErrInvalidOption", err)
	}
	for _, spec := range []string{"", "* * *", "@fortnightly", "0 0 30 2 *", "CRON_TZ=Nowhere/City 0 9 * * *"} {
		if _, err := s.Register(spec, schedTask()); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("spec %q: err = %v, want ErrInvalidOption", spec, err)
		}
	}
	if _, err := s.Register("@every 1m", schedTask(), TTL(time.Hour), asynq.MaxRetry(2), Headers(map[string]string{"a": "b"})); err != nil {
		t.Errorf("options that keep the promise: %v", err)
	}
	if _, err := s.Register("@every 1m", schedTask(), TTL(time.Hour)); !errors.Is(err, ErrInvalidOption) || !strings.Contains(err.Error(), "registered already") {
		t.Errorf("the same entry again: err = %v", err)
	}
}

func TestSchedulerRegisterRefusesATypeItCannotDeduplicate(t *testing.T) {
	for name, rule := range map[string]Rule{
		"Skip":         {Skip: true},
		"RunningDefer": {OnRunning: RunningDefer},
		"RunningAllow": {OnRunning: RunningAllow},
		"Debounce":     {OnConflict: Replace, Debounce: time.Second},
		"Period":       {Period: time.Hour},
	} {
		h := newHarness(t, Config{Rules: map[string]Rule{schedType: rule}})
		if _, err := NewScheduler(h.d, nil).Register("@hourly", schedTask()); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("rule %s: err = %v, want ErrInvalidOption", name, err)
		} else if name == "Skip" && !strings.Contains(err.Error(), "every replica would enqueue every firing") {
			t.Errorf("rule Skip: %v does not say why", err)
		} else {
			t.Logf("rule %s: %v", name, err)
		}
	}
	h := newHarness(t, Config{OptIn: true, Rules: map[string]Rule{schedType: {OnConflict: Replace}}})
	if _, err := NewScheduler(h.d, nil).Register("@hourly", schedTask()); err != nil {
		t.Errorf("a Replace rule (the scheduler rejects in its calls): %v", err)
	}
}

func TestSchedulerUnregisterStopsAnEntry(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	h := newHarness(t, Config{})
	runs := newSchedRuns(t)
	h.serve(runs.handler(), nil)
	s := schedReplica(t, h, nil, 0, nil)
	stopped := register(t, h, s)
	kept, err := s.Register("@every 1s", asynq.NewTask(schedType, []byte(`{"report":"kept"}`)), asynq.Queue(h.queue))
	if err != nil {
		t.Fatal(err)
	}
	startAll(t, s)
	eventually(t, "both entries fired", func() bool { return len(runs.entries()) == 2 })
	if err := s.Unregister(stopped); err != nil {
		t.Fatal(err)
	}
	drained(t, h.insp, h.queue)
	before, _ := runs.firings(stopped)
	keptBefore, _ := runs.firings(kept)
	eventually(t, "the kept entry fired twice more", func() bool {
		ats, _ := runs.firings(kept)
		return len(ats) >= len(keptBefore)+2
	})
	s.Shutdown()
	drained(t, h.insp, h.queue)
	if after, _ := runs.firings(stopped); len(after) != len(before) {
		t.Errorf("the unregistered entry ran %d more firings", len(after)-len(before))
	}
	if err := s.Unregister(stopped); err == nil {
		t.Error("Unregister of an entry gone: no error")
	}
}

func TestSchedulerEntryIDIsTheSameOnEveryReplica(t *testing.T) {
	h := newHarness(t, Config{})
	a, b := NewScheduler(h.d, nil), NewScheduler(h.d, &SchedulerOpts{Location: time.FixedZone("X", 3600)})
	id := func(s *Scheduler, spec string, task *asynq.Task, opts ...asynq.Option) string {
		t.Helper()
		got, err := s.Register(spec, task, opts...)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Unregister(got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	base := id(a, "@every 1m", schedTask())
	for name, same := range map[string]string{
		"another spelling of @every": id(a, "@every 60s", schedTask()),
		"another Location, @every":   id(b, "@every 1m", schedTask()),
		"options other than Queue":   id(a, "@every 1m", schedTask(), asynq.MaxRetry(3), TTL(time.Hour)),
		"queue named by default":     id(a, "@every 1m", schedTask(), asynq.Queue("default")),
		"queue given to NewTask":     id(a, "@every 1m", asynq.NewTask(schedType, []byte(`{"report":"daily"}`), asynq.Queue("default"))),
	} {
		if same != base {
			t.Errorf("%s: entry %s, want %s", name, same, base)
		}
	}
	cron := id(a, "0 9 * * *", schedTask())
	for name, other := range map[string]string{
		"spec":     id(a, "@every 2m", schedTask()),
		"payload":  id(a, "@every 1m", asynq.NewTask(schedType, []byte(`{"report":"weekly"}`))),
		"type":     id(a, "@every 1m", asynq.NewTask(schedType+"x", []byte(`{"report":"daily"}`))),
		"queue":    id(a, "@every 1m", schedTask(), asynq.Queue("low")),
		"location": id(b, "0 9 * * *", schedTask()),
	} {
		if other == base || other == cron {
			t.Errorf("another %s: the same entry ID %s", name, other)
		}
	}
	if got := id(b, "CRON_TZ=UTC 0 9 * * *", schedTask()); got != cron {
		t.Errorf("CRON_TZ=UTC on a Scheduler elsewhere: entry %s, want %s (UTC's)", got, cron)
	}
}

func TestSchedulerCronSpecInLocationAcrossDST(t *testing.T) {
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Skipf("no time zone data: %v", err)
	}
	s, err := parseSchedule("0 9 * * *", ny)
	if err != nil {
		t.Fatal(err)
	}
	// 2024-03-10: New York moves from EST (UTC−5) to EDT (UTC−4).
	for _, c := range []struct{ after, want string }{
		{"2024-03-09T12:00:00Z", "2024-03-09T14:00:00Z"}, // 9:00 EST
		{"2024-03-09T14:00:00Z", "2024-03-10T13:00:00Z"}, // 9:00 EDT: 23 h later
		{"2024-11-02T14:00:00Z", "2024-11-03T14:00:00Z"}, // back to EST: 25 h later
	} {
		after, _ := time.Parse(time.RFC3339, c.after)
		if got := s.next(after).UTC().Format(time.RFC3339); got != c.want {
			t.Errorf("next after %s: %s, want %s", c.after, got, c.want)
		}
	}
	tokyo, err := parseSchedule("CRON_TZ=Asia/Tokyo 0 9 * * *", ny) // the spec's zone wins
	if err != nil {
		t.Fatal(err)
	}
	after, _ := time.Parse(time.RFC3339, "2024-03-09T12:00:00Z")
	if got := tokyo.next(after).UTC().Format(time.RFC3339); got != "2024-03-10T00:00:00Z" {
		t.Errorf("CRON_TZ=Asia/Tokyo: next %s, want 2024-03-10T00:00:00Z", got)
	}
}

func TestSchedulerEveryIsAlignedToTheEpoch(t *testing.T) {
	for _, c := range []struct {
		spec        string
		after, want int64 // Unix seconds
	}{
		{"@every 10s", 1_700_000_003, 1_700_000_010},
		{"@every 10s", 1_700_000_010, 1_700_000_020}, // strictly after
		{"@every 1h30m", 1_700_000_000, 1_700_001_000},
		{"@every 1500ms", 1_700_000_000, 1_700_000_001}, // rounded down to whole seconds, as robfig/cron
		{"@every 7s", -3, 0},
		{"@every 7s", -8, -7},
	} {
		s, err := parseSchedule(c.spec, time.UTC)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.next(time.Unix(c.after, 0)).Unix(); got != c.want {
			t.Errorf("%s after %d: %d, want %d", c.spec, c.after, got, c.want)
		}
		// Every replica agrees, whenever it started: the firing after any
		// moment between two firings is the same.
		prev := time.Unix(c.want, 0).Add(-time.Nanosecond)
		if got := s.next(prev).Unix(); got != c.want {
			t.Errorf("%s just before %d: %d", c.spec, c.want, got)
		}
	}
}

func TestSchedulerStartAndShutdownStates(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	s.Shutdown() // not started: nothing to do, and it can still start
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err == nil {
		t.Error("a second Start: no error")
	}
	s.Shutdown()
	s.Shutdown()
	if err := s.Start(); err == nil {
		t.Error("Start after Shutdown: no error")
	}
}

// TestSchedulerComparedWithAsynqScheduler logs, without asserting, the runs
// per firing of three replicas "@every 1s" started 0.7 s apart (as pods
// start): asynq's Scheduler, asynq's with asynq.Unique(time.Second), and
// this package's; and asynq's with Unique "@every 2s". asynq's @every fires
// on whole seconds counted from each replica's start, so at 1s the
// replicas fire together, at 2s not; a firing there is a period of the
// window.
func TestSchedulerComparedWithAsynqScheduler(t *testing.T) {
	needRealRedis(t)
	t.Parallel()
	const replicas, window = 3, 8 * time.Second
	plain, unique, unique2, ours := newHarness(t, Config{}), newHarness(t, Config{}), newHarness(t, Config{}), newHarness(t, Config{})
	var n [4]atomic.Int64
	counting := func(n *atomic.Int64, next asynq.HandlerFunc) asynq.HandlerFunc {
		return func(ctx context.Context, task *asynq.Task) error {
			n.Add(1)
			if next != nil {
				return next(ctx, task)
			}
			return nil
		}
	}
	plainServe(t, plain, counting(&n[0], nil))
	plainServe(t, unique, counting(&n[1], nil))
	plainServe(t, unique2, counting(&n[2], nil))
	runs := newSchedRuns(t)
	ours.serve(counting(&n[3], runs.handler()), nil)
	var id string
	for i := range replicas {
		if i > 0 {
			time.Sleep(700 * time.Millisecond) // the pods' start times: part of the scenario
		}
		asynqScheduler(t, "@every 1s", plain.queue)
		asynqScheduler(t, "@every 1s", unique.queue, asynq.Unique(time.Second))
		asynqScheduler(t, "@every 2s", unique2.queue, asynq.Unique(time.Second))
		s := schedReplica(t, ours, nil, 0, nil)
		id = register(t, ours, s)
		startAll(t, s)
	}
	var start, end [4]int64
	for i := range n {
		start[i] = n[i].Load()
	}
	time.Sleep(window) // the measurement's window
	for i := range n {
		end[i] = n[i].Load()
	}
	perFiring := func(i int, period time.Duration) float64 { return float64(end[i]-start[i]) / float64(window/period) }
	t.Logf("%d replicas started 0.7 s apart, runs per firing over %v: @every 1s: asynq.Scheduler %.2f, with asynq.Unique(1s) %.2f, dedup.Scheduler %.2f; @every 2s: asynq.Scheduler with asynq.Unique(1s) %.2f",
		replicas, window, perFiring(0, time.Second), perFiring(1, time.Second), perFiring(3, time.Second), perFiring(2, 2*time.Second))
	ats, runsOf := runs.firings(id)
	total := 0
	for _, at := range ats {
		total += runsOf[at]
	}
	t.Logf("dedup.Scheduler: %d runs of %d firings, by their firing header", total, len(ats))
}

// plainServe runs an asynq server without the middleware on h's queue.
func plainServe(t *testing.T, h *harness, handler asynq.HandlerFunc) {
	t.Helper()
	srv := asynq.NewServerFromRedisClient(h.rdb, asynq.Config{
		Concurrency: 10, Queues: map[string]int{h.queue: 1}, TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel,
	})
	if err := srv.Start(handler); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
}

// asynqScheduler starts one of asynq's own Schedulers with one entry.
func asynqScheduler(t *testing.T, spec, queue string, opts ...asynq.Option) {
	t.Helper()
	s := asynq.NewScheduler(asynq.RedisClientOpt{Addr: redistest.Addr()}, &asynq.SchedulerOpts{LogLevel: asynq.FatalLevel})
	if _, err := s.Register(spec, schedTask(), append(opts, asynq.Queue(queue))...); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
}

func TestClusterSchedulerRunsEachFiringOnce(t *testing.T) {
	c := clusterClient(t)
	t.Parallel()
	h := newHarnessOn(t, c, Config{})
	queues := queuesOnEveryMaster(t, c, h.queue)
	runs := newSchedRuns(t)
	srvQueues := map[string]int{}
	for _, q := range queues {
		srvQueues[q] = 1
	}
	srv := asynq.NewServerFromRedisClient(c, asynq.Config{
		Concurrency: 8, Queues: srvQueues, LogLevel: asynq.FatalLevel, IsFailure: IsFailure,
		TaskCheckInterval: 20 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
	})
	if err := srv.Start(h.d.Middleware()(runs.handler())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	// Two replicas 2 s apart, each on a Cluster client of its own, with one
	// entry in a queue on each master.
	var replicas []*Scheduler
	for _, off := range []time.Duration{-time.Second, time.Second} {
		replicas = append(replicas, schedReplica(t, h, clusterClient(t), off, nil))
	}
	ids := map[string]bool{}
	for _, q := range queues {
		for _, s := range replicas {
			id, err := s.Register("@every 1s", schedTask(), asynq.Queue(q))
			if err != nil {
				t.Fatal(err)
			}
			ids[id] = true
		}
	}
	if len(ids) != len(queues) {
		t.Fatalf("%d entry IDs for %d entries", len(ids), len(queues))
	}
	startAll(t, replicas...)
	runs.waitFirings(6 * len(queues))
	shutdownAll(replicas...)
	drained(t, h.insp, queues...)
	for id := range ids {
		runs.checkOncePerFiring(id, time.Second)
	}
	for _, q := range queues {
		_ = h.insp.DeleteQueue(q, true)
	}
}

// Register refuses OnFailure ("Cooldown, Period or OnFailure (the Scheduler
// sets the hold)"), OnFailure(FailRelease, 0) too, which the Scheduler's
// FailHold would otherwise silently override.
func TestSchedulerRegisterRefusesEveryOnFailure(t *testing.T) {
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, nil)
	if id, err := s.Register("@every 1m", jobTask("s", 1), OnFailure(FailRelease, 0)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("Register with OnFailure(FailRelease, 0): entry %q, err %v; want ErrInvalidOption", id, err)
	}
}

// docs/scheduler.md: "each firing once however many replicas run it". A
// firing that fails for good keeps its key (FailHold) so that a replica
// whose clock lags cannot enqueue it again; a firing revoked by its handler
// (asynq.RevokeTask) keeps it too: the lagging replica's enqueue of the same
// firing (the very options the first replica used) is a duplicate. (An
// operator's delete frees the firing's key, as docs/scheduler.md says: not
// tested here.)
func TestSchedulerFiringRevokedByItsHandlerIsNotEnqueuedAgain(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"revoked"} { // (an operator's delete frees the firing's key: docs/scheduler.md)
		t.Run(end, func(t *testing.T) {
			h := newHarness(t, Config{})
			type firing struct {
				task *asynq.Task
				opts []asynq.Option
			}
			fired := make(chan firing, 10)
			posted := make(chan error, 10)
			s := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger(), PreEnqueueFunc: func(task *asynq.Task, opts []asynq.Option) {
				fired <- firing{task, opts}
			}, PostEnqueueFunc: func(info *asynq.TaskInfo, err error) { posted <- err }})
			if _, err := s.Register("@every 1s", asynq.NewTask("job:report", nil), asynq.Queue(h.queue)); err != nil {
				t.Fatal(err)
			}
			var ran atomic.Int32
			if end == "revoked" {
				h.serve(func(context.Context, *asynq.Task) error { ran.Add(1); return asynq.RevokeTask }, nil)
			}
			if err := s.Start(); err != nil {
				t.Fatal(err)
			}
			f := waitFor(t, fired, "a firing")
			if err := waitFor(t, posted, "the firing's enqueue"); err != nil {
				t.Fatal(err)
			}
			s.Shutdown()
			_, at, _ := SchedulerFiring(f.task)
			entry, _, _ := SchedulerFiring(f.task)
			id := func() string {
				l, found, _ := h.d.Lookup(context.Background(), f.task, f.opts...)
				if found {
					return l.Holder
				}
				return ""
			}
			holder := ""
			eventually(t, "the firing's task is stored", func() bool { holder = id(); return holder != "" })
			if end == "revoked" {
				eventually(t, "the firing ran and was revoked", func() bool { s := h.d.Stats(); return ran.Load() >= 1 && s.Released+s.Cooling >= 1 })
			} else {
				if err := h.insp.DeleteTask(h.queue, holder); err != nil {
					t.Fatal(err)
				}
			}
			// A replica whose clock lags by 0.5 s (within MaxSkew) enqueues this firing now.
			res, err := h.d.NewClient().Submit(context.Background(), f.task, f.opts...)
			var dup *DuplicateTaskError
			if !errors.As(err, &dup) {
				t.Errorf("a lagging replica's enqueue of firing %s of entry %s after it was %s: %+v %v, want a duplicate",
					at.Format(time.TimeOnly), entry[:8], end, res.Outcome, err)
			}
		})
	}
}

// Register refuses a type whose rule has a Period (the firings' hold is a
// Cooldown), and accepts one whose rule holds failures (the Scheduler's
// FailHold overrides it).
func TestSchedulerRegisterChecksTheTypesRule(t *testing.T) {
	h := newHarness(t, Config{Rules: map[string]Rule{
		"job:period": {Period: time.Hour},
		"job:held":   {OnFailure: FailHoldUntilReleased, MaxPending: 3},
	}})
	s := NewScheduler(h.d, nil)
	if _, err := s.Register("@hourly", asynq.NewTask("job:period", nil)); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("a Period type: %v, want ErrInvalidOption", err)
	}
	if _, err := s.Register("@hourly", asynq.NewTask("job:held", nil)); err != nil {
		t.Errorf("a FailHoldUntilReleased type: %v", err)
	}
}

// Register, Unregister and Shutdown from many goroutines (run with -race):
// once Shutdown and every Unregister have returned, nothing is enqueued.
func TestSchedulerRegisterUnregisterAndShutdownRace(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{})
	s := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				id, err := s.Register("@every 1s", asynq.NewTask("job:race", fmt.Appendf(nil, "%d-%d", g, i)), asynq.Queue(h.queue))
				if err != nil {
					t.Errorf("Register: %v", err)
					return
				}
				if i%2 == 0 {
					if err := s.Unregister(id); err != nil {
						t.Errorf("Unregister: %v", err)
					}
				}
			}
		})
	}
	wg.Go(func() { s.Shutdown() })
	wg.Wait()
	s.Shutdown()
	size := queueTasks(t, h)
	next := time.Now().Truncate(time.Second).Add(1500 * time.Millisecond)
	eventually(t, "a firing time has passed", func() bool { return time.Now().After(next) })
	if n := queueTasks(t, h); n != size {
		t.Errorf("%d tasks enqueued after Shutdown returned", n-size)
	}
	if err := s.Start(); err == nil {
		t.Error("Start after Shutdown: no error")
	}
}

// Two Schedulers in one process, on one Dedup, with the same entry: each
// firing runs once.
func TestSchedulerTwoInOneProcessRunEachFiringOnce(t *testing.T) {
	t.Parallel()
	h := newHarness(t, Config{})
	var (
		mu    sync.Mutex
		runs  = map[string]int{} // firing → runs
		fresh = make(chan struct{}, 100)
	)
	h.serve(func(_ context.Context, task *asynq.Task) error {
		_, at, ok := SchedulerFiring(task)
		if !ok {
			t.Errorf("a task without the scheduler's headers")
		}
		mu.Lock()
		defer mu.Unlock()
		if runs[at.String()]++; runs[at.String()] == 1 {
			fresh <- struct{}{}
		}
		return nil
	}, nil)
	a := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	b := NewScheduler(h.d, &SchedulerOpts{Logger: quietLogger()})
	t.Cleanup(a.Shutdown)
	t.Cleanup(b.Shutdown)
	for _, s := range []*Scheduler{a, b} {
		if _, err := s.Register("@every 1s", asynq.NewTask("job:twice", nil), asynq.Queue(h.queue)); err != nil {
			t.Fatal(err)
		}
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, fresh, "a firing")
	waitFor(t, fresh, "another firing")
	a.Shutdown()
	b.Shutdown()
	eventually(t, "every task ran", func() bool {
		qi, err := h.insp.GetQueueInfo(h.queue)
		return err == nil && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0
	})
	mu.Lock()
	defer mu.Unlock()
	for at, n := range runs {
		if n != 1 {
			t.Errorf("firing %s ran %d times", at, n)
		}
	}
}
