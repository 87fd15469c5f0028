package dedup

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
)

// A Scheduler that runs each firing once across replicas (asynq #395,
// #554, #653, #1013). Every replica runs the same Scheduler with the same
// entries; each computes the same firing times and enqueues each firing
// through Dedup.NewClient with a key made of the entry and the firing. The
// first replica takes the key and stores the task in one atomic script; the
// others get a *DuplicateTaskError. The key stays held after the task
// succeeds until no replica whose clock lags by up to MaxSkew can still
// produce that firing. See docs/scheduler.md.

// defaultMaxSkew is SchedulerOpts.MaxSkew's default: one minute, far above
// what NTP-synchronised hosts drift apart.
const defaultMaxSkew = time.Minute

// Headers of the tasks a Scheduler enqueues, so a handler can tell which
// firing it runs (SchedulerFiring reads them). They are added to the task's
// own headers (asynq.NewTaskWithHeaders), replacing any of the same name.
const (
	// schedulerEntryHeader holds the ID of the entry that enqueued the task,
	// as Scheduler.Register returned it.
	schedulerEntryHeader = "dedup-scheduler-entry"
	// schedulerFiringHeader holds the firing the task was enqueued for:
	// RFC 3339 in UTC, whole seconds ("2025-01-31T09:00:00Z").
	schedulerFiringHeader = "dedup-scheduler-firing"
)

// SchedulerOpts configures a Scheduler. The zero value (or nil) is ready to
// use; each field's comment gives its default.
type SchedulerOpts struct {
	// Location is the time zone of cron specs that name none (CRON_TZ=).
	// Default time.UTC, as asynq's Scheduler. "@every" specs do not depend
	// on it.
	Location *time.Location

	// MaxSkew is the largest difference between the clocks of the
	// replicas that is tolerated: a firing's key stays held, after its task
	// succeeds, until (next firing − this firing) + MaxSkew after it was
	// taken, so that a replica whose clock lags by up to MaxSkew finds it
	// held. Replicas further apart may run a firing twice. Default
	// 1 minute, also when zero or negative.
	MaxSkew time.Duration

	// PreEnqueueFunc, if set, is called before each enqueue of a firing,
	// with the firing's task (its headers included) and every option the
	// enqueue passes. Keep it fast: the entry's next firing waits for it.
	// Default: none.
	PreEnqueueFunc func(task *asynq.Task, opts []asynq.Option)

	// PostEnqueueFunc, if set, is called after each enqueue of a firing,
	// with the enqueued task's TaskInfo or the error. Every replica but one
	// gets a *DuplicateTaskError for each firing: count them here if you
	// wish. Default: none.
	PostEnqueueFunc func(info *asynq.TaskInfo, err error)

	// EnqueueErrorHandler, if set, is called when a firing could not be
	// enqueued: not for a *DuplicateTaskError (another replica enqueued the
	// firing: the normal case), nor for an enqueue cut short by Unregister
	// or Shutdown. Default: none (the error is logged).
	EnqueueErrorHandler func(task *asynq.Task, opts []asynq.Option, err error)

	// Logger receives the Scheduler's log lines. Default: the Dedup's
	// (Config.Logger).
	Logger *slog.Logger
}

// Scheduler enqueues tasks on cron schedules, as asynq's Scheduler does,
// but each firing once however many replicas run it. It is safe for
// concurrent use. Create one per process with NewScheduler.
type Scheduler struct {
	d      *Dedup
	client *Client
	opts   SchedulerOpts
	log    *slog.Logger
	now    func() time.Time // the clock firings are computed on (tests skew it)

	mu      sync.Mutex
	state   schedState
	entries map[string]*schedEntry
}

type schedState int

const (
	schedNew schedState = iota
	schedRunning
	schedClosed
)

// schedEntry is one registered entry.
type schedEntry struct {
	id      string
	sched   schedule
	typ     string
	payload []byte
	headers map[string]string
	opts    []asynq.Option // asynq.NewTask's, then Register's
	queue   string

	// Set by run, under the Scheduler's lock.
	stop context.CancelFunc
	done chan struct{}
}

// NewScheduler returns a Scheduler that enqueues through d.NewClient(): the
// lock and asynq's task record are written in one atomic script. d must
// not be nil, and must stay open while the Scheduler runs. opts may be nil
// (the defaults).
func NewScheduler(d *Dedup, opts *SchedulerOpts) *Scheduler {
	var o SchedulerOpts
	if opts != nil {
		o = *opts
	}
	if o.Location == nil {
		o.Location = time.UTC
	}
	if o.MaxSkew <= 0 {
		o.MaxSkew = defaultMaxSkew
	}
	if o.Logger == nil {
		o.Logger = d.log
	}
	return &Scheduler{d: d, client: d.NewClient(), opts: o, log: o.Logger, now: time.Now, entries: map[string]*schedEntry{}}
}

// Register adds an entry that enqueues task on the cron spec (as asynq's
// Scheduler parses it: five fields, descriptors such as @daily,
// "@every <duration>", a CRON_TZ= prefix), with opts: asynq's options and
// this package's, as a Client call takes them. A Scheduler that runs
// already starts the entry at once.
//
// The entry ID is a hash of the schedule (and the time zone it is read in),
// the task's type and payload and its queue: every replica that registers
// the same entry gets the same ID, and its tasks carry it
// (header dedup-scheduler-entry). "@every d" fires at the multiples of d since the
// Unix epoch, not every d from its start as in asynq, so that replicas agree.
//
// The options are checked once, here, composed with the type's rule as
// each firing composes them. Register refuses (ErrInvalidOption) a spec
// that does not parse or never fires, an entry registered already, and
// what would break the one-run-per-firing promise: a key-choosing option
// (Key, SharedKey, Fields, Skip; the Scheduler keys each firing itself),
// an asynq.TaskID, a folding option (OnConflict, MergeWith, Debounce), a
// Cooldown, Period or OnFailure (the Scheduler sets the hold), asynq.Unique
// or asynq.Group, and
// a type whose rule turns deduplication off or cannot be combined with a
// cooldown (Rule.OnRunning other than RunningReject, Rule.Debounce).
func (s *Scheduler) Register(cronspec string, task *asynq.Task, opts ...asynq.Option) (entryID string, err error) {
	e, err := s.newEntry(cronspec, task, opts)
	if err != nil {
		return "", err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.entries[e.id]; ok {
		return "", errorf("%w: Scheduler.Register: entry %s (the same schedule, type, payload and queue) is registered already", ErrInvalidOption, e.id)
	}
	s.entries[e.id] = e
	if s.state == schedRunning {
		s.run(e)
	}
	return e.id, nil
}

// Unregister removes an entry. Once it returns the entry enqueues nothing
// more: an enqueue of it under way is cut short or has ended.
func (s *Scheduler) Unregister(entryID string) error {
	s.mu.Lock()
	e, ok := s.entries[entryID]
	delete(s.entries, entryID)
	s.mu.Unlock()
	if !ok {
		return errorf("dedup: Scheduler.Unregister: no entry %q", entryID)
	}
	e.halt()
	return nil
}

// Start starts every entry: each computes its next firing from now (a
// firing missed while the process was down is never enqueued later). It
// fails if the Scheduler runs already or was shut down.
func (s *Scheduler) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.state {
	case schedRunning:
		return errors.New("dedup: Scheduler.Start: the scheduler is running already")
	case schedClosed:
		return errors.New("dedup: Scheduler.Start: the scheduler was shut down")
	}
	s.state = schedRunning
	for _, e := range s.entries {
		s.run(e)
	}
	s.log.Info("dedup: scheduler started", slog.Int("entries", len(s.entries)), slog.String("location", s.opts.Location.String()), slog.Duration("max_skew", s.opts.MaxSkew))
	return nil
}

// Run starts the Scheduler and blocks until the process receives SIGINT or
// SIGTERM, then shuts it down, as asynq's Scheduler.Run does.
func (s *Scheduler) Run() error {
	if err := s.Start(); err != nil {
		return err
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	<-sigs
	s.Shutdown()
	return nil
}

// Shutdown stops every entry and returns once none enqueues any more (an
// enqueue under way is cut short). It does nothing to a Scheduler that was
// not started, or is shut down already; a Scheduler shut down cannot start
// again. It does not close the Dedup.
func (s *Scheduler) Shutdown() {
	s.mu.Lock()
	if s.state != schedRunning {
		s.mu.Unlock()
		return
	}
	s.state = schedClosed
	es := slices.Collect(maps.Values(s.entries))
	s.mu.Unlock()
	for _, e := range es {
		e.stop()
	}
	for _, e := range es {
		<-e.done
	}
	s.log.Info("dedup: scheduler stopped")
}

// SchedulerFiring returns the entry and the firing a Scheduler enqueued
// task for, read from its headers; ok is false for a task without them.
func SchedulerFiring(task *asynq.Task) (entryID string, at time.Time, ok bool) {
	h := taskHeaders(task)
	entryID = h[schedulerEntryHeader]
	at, err := time.Parse(time.RFC3339, h[schedulerFiringHeader])
	if entryID == "" || err != nil {
		return "", time.Time{}, false
	}
	return entryID, at, true
}

// run starts e's goroutine; the caller holds s.mu.
func (s *Scheduler) run(e *schedEntry) {
	ctx, cancel := context.WithCancel(context.Background())
	e.stop, e.done = cancel, make(chan struct{})
	go s.loop(ctx, e)
}

// halt stops e's goroutine, if it runs, and waits for it.
func (e *schedEntry) halt() {
	if e.stop != nil {
		e.stop()
		<-e.done
	}
}

// loop enqueues e's firings until ctx ends. The first is the next after
// now. A firing woken for only once its following firing is due (the
// process was suspended, the clock jumped) is skipped: enqueued that late it
// could outlive the hold of the key other replicas took for it.
func (s *Scheduler) loop(ctx context.Context, e *schedEntry) {
	defer close(e.done)
	at := e.sched.next(s.now())
	for !at.IsZero() {
		if !s.sleepUntil(ctx, at) {
			return
		}
		now := s.now()
		following := e.sched.next(at)
		if !following.IsZero() && !now.Before(following) {
			s.log.Warn("dedup: scheduler skipped a firing it woke too late for", slog.String("entry", e.id), slog.String("type", e.typ),
				slog.Time("firing", at), slog.Time("now", now))
			at = e.sched.next(now)
			continue
		}
		s.fire(ctx, e, at, following)
		at = following
	}
}

// sleepUntil waits until the Scheduler's clock reads t; false if ctx ended
// first.
func (s *Scheduler) sleepUntil(ctx context.Context, t time.Time) bool {
	for {
		d := t.Sub(s.now())
		if d <= 0 {
			return true
		}
		timer := time.NewTimer(d)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false
		case <-timer.C:
		}
	}
}

// fire enqueues e's firing at, whose next firing is following (zero: none),
// and reports the outcome to the hooks. The enqueue must end before the
// next firing is due.
func (s *Scheduler) fire(ctx context.Context, e *schedEntry, at, following time.Time) {
	hold := maxLifetime
	if !following.IsZero() {
		hold = following.Sub(at) + s.opts.MaxSkew
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, following.Sub(s.now()))
		defer cancel()
	}
	task, opts := e.firing(at, hold)
	if f := s.opts.PreEnqueueFunc; f != nil {
		f(task, opts)
	}
	res, err := s.client.Submit(ctx, task, opts...)
	if f := s.opts.PostEnqueueFunc; f != nil {
		f(res.Info, err)
	}
	attrs := []any{slog.String("entry", e.id), slog.String("type", e.typ), slog.Time("firing", at)}
	var dup *DuplicateTaskError
	switch {
	case err == nil:
		s.log.Debug("dedup: scheduler enqueued a firing", append(attrs, slog.String("task_id", res.TaskID))...)
	case errors.As(err, &dup):
		s.log.Debug("dedup: scheduler: another replica enqueued this firing", append(attrs, slog.String("holder", dup.Holder))...)
	case errors.Is(err, context.Canceled) && errors.Is(ctx.Err(), context.Canceled): // Unregister, Shutdown
		s.log.Debug("dedup: scheduler stopped during an enqueue", append(attrs, slog.Any("error", err))...)
	default:
		s.log.Warn("dedup: scheduler could not enqueue a firing", append(attrs, slog.Any("error", err))...)
		if f := s.opts.EnqueueErrorHandler; f != nil {
			f(task, opts, err)
		}
	}
}

// firing returns the task and options of e's firing at: the entry's
// options, then the Scheduler's own, which key the call on the entry and
// the firing and hold the key for hold after it is taken.
func (e *schedEntry) firing(at time.Time, hold time.Duration) (*asynq.Task, []asynq.Option) {
	h := make(map[string]string, len(e.headers)+2)
	maps.Copy(h, e.headers)
	h[schedulerEntryHeader] = e.id
	h[schedulerFiringHeader] = at.UTC().Format(time.RFC3339)
	opts := make([]asynq.Option, 0, len(e.opts)+4)
	opts = append(opts, e.opts...)
	opts = append(opts,
		asynq.Queue(e.queue),
		OnConflict(Reject),
		Key(e.id+"@"+strconv.FormatInt(at.Unix(), 10)),
		firingHold(hold), // held until it expires, whatever its task does
	)
	return newTask(e.typ, e.payload, h), opts
}

// newEntry parses and checks an entry.
func (s *Scheduler) newEntry(spec string, task *asynq.Task, opts []asynq.Option) (*schedEntry, error) {
	if task == nil {
		return nil, errorf("%w: Scheduler.Register: nil task", ErrInvalidOption)
	}
	sch, err := parseSchedule(spec, s.opts.Location)
	if err != nil {
		return nil, err
	}
	if sch.next(s.now()).IsZero() {
		return nil, errorf("%w: cron spec %q: never fires", ErrInvalidOption, spec)
	}
	own, ok := taskOpts(task)
	if !ok {
		return nil, errorf("%w: Scheduler.Register: this asynq version's task options cannot be read", ErrInvalidOption)
	}
	all := append(slices.Clip(own), opts...) // asynq applies NewTask's options first
	if err := refuseOptions(all); err != nil {
		return nil, err
	}
	e := &schedEntry{sched: sch, typ: task.Type(), payload: task.Payload(), headers: maps.Clone(taskHeaders(task)), opts: all, queue: queueOf(all)}
	e.id = entryID(sch, e.typ, e.payload, e.queue)
	if err := s.check(e); err != nil {
		return nil, err
	}
	return e, nil
}

// check composes a firing of e as an enqueue will, so that what would fail
// at every firing fails at Register instead.
func (s *Scheduler) check(e *schedEntry) error {
	task, opts := e.firing(e.sched.next(s.now()), defaultMaxSkew)
	var k call
	err := s.client.compose(&k, task, opts)
	switch {
	case s.d.ruleFor(e.typ).typeOff, err == nil && !s.d.active(&k.rule):
		// (Said before compose's own refusal of the firing's options.)
		err = errorf("%w: the type's rule turns deduplication off (Skip): every replica would enqueue every firing", ErrInvalidOption)
	case err != nil:
	case k.conflicting != "":
		err = errorf("%w: %s cannot be combined with deduplication", ErrInvalidOption, k.conflicting)
	default:
		err = firingRule(&k.rule)
	}
	if err != nil {
		return errorf("dedup: Scheduler.Register %q: %w", e.typ, err)
	}
	return nil
}

// firingRule refuses a type's rule that a firing's key cannot follow: one
// that runs the key beside a running firing, or moves or folds firings.
func firingRule(r *resolved) error {
	switch {
	case r.running != RunningReject:
		return errorf("%w: the type's rule has OnRunning %v: a firing's key is held until its window ends, whatever its task does", ErrInvalidOption, r.running)
	case r.debounce > 0:
		return errorf("%w: the type's rule has a Debounce, which would move a firing", ErrInvalidOption)
	case r.period > 0:
		return errorf("%w: the type's rule has a Period: a firing's key is the entry's and the firing's", ErrInvalidOption)
	}
	return nil
}

// refuseOptions refuses the options that would break the promise of one
// task per firing.
func refuseOptions(opts []asynq.Option) error {
	for _, o := range opts {
		if o == nil {
			continue
		}
		if why := refusal(o); why != "" {
			return errorf("%w: Scheduler.Register: %s %s", ErrInvalidOption, o.String(), why)
		}
	}
	return nil
}

// refusal says why a Scheduler refuses o, or "".
func refusal(o asynq.Option) string {
	switch o.Type() {
	case asynq.TaskIDOpt:
		return "names the task, but every firing makes a task of its own"
	case asynq.UniqueOpt, asynq.GroupOpt:
		return "cannot be combined with deduplication"
	}
	ov, ok := o.(option)
	if !ok || ov.headers != nil {
		return ""
	}
	var r resolved // what the option alone sets
	if ov.apply(&r) != nil {
		return "" // the composition reports the error
	}
	switch {
	case r.skip:
		return "turns deduplication off, but the firing's key is what makes it run once"
	case r.callKey != "" || r.fields != nil:
		return "chooses the key, but the scheduler keys each firing itself (entry and firing time)"
	case r.callConflictSet || r.callMerge != nil || r.debounce > 0:
		return "folds enqueues together, but each firing is one task and the other replicas' enqueues of it are rejected"
	case r.cooldown > 0 || r.period > 0 || r.failSet:
		return "sets the hold, which the scheduler sets itself: (next firing − this firing) + MaxSkew, after success or failure"
	}
	return ""
}

// queueOf is the queue the last asynq.Queue option names, else "default":
// the queue every firing's lock and task live in.
func queueOf(opts []asynq.Option) string {
	q := "default"
	for _, o := range opts {
		if o != nil && o.Type() == asynq.QueueOpt {
			if v, ok := o.Value().(string); ok {
				q = v
			}
		}
	}
	return q
}

// entryID hashes what makes an entry: its schedule (and the zone it is read
// in), task type, payload and queue.
func entryID(s schedule, typ string, payload []byte, queue string) string {
	h := sha256.New()
	for _, part := range [][]byte{[]byte(s.canon()), []byte(typ), payload, []byte(queue)} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}
