package dedup

import (
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/asynq-dedup/dedup/internal/jsonkey"

	"github.com/hibiken/asynq"
)

// Defaults. Each Config field's comment says which applies when it is zero.
const (
	defaultPrefix      = "dedup"
	defaultTTL         = time.Hour
	defaultLockTimeout = time.Second
	defaultHealGrace   = time.Minute
)

// defaultMaxBatch is Config.MaxBatch's default.
const defaultMaxBatch = 64

// Config configures a Dedup. The zero value is ready to use: every type that
// passes through the wrapper is deduplicated on its whole payload.
type Config struct {
	// Prefix starts every key this package writes. It may not contain '{' or
	// '}' (the queue's hash tag follows it). Default "dedup".
	Prefix string

	// TTL is a lock's lifetime, a safety net: a lock lives as long as its
	// task (asynq's own scripts release it), and one whose task is gone
	// heals at the key's next enqueue, but a lock nothing releases (a queue
	// deleted, say) expires after this long. It counts from the enqueue
	// while the task waits (for ProcessIn/ProcessAt tasks, from the time
	// they are due), and covers a retry's delay; the heartbeat extends it
	// while a handler runs long. Default one hour: set it above
	// your queues' longest wait.
	TTL time.Duration

	// LockTimeout bounds each Redis call the library makes (enqueue,
	// middleware, Lookup, Release, Ping, the flusher), so a slow Redis
	// cannot hang it; an enqueue whose call may have stored its task asks
	// once more whether it did (ErrOutcomeUnknown), so it may take twice
	// as long. A call waiting for a connection that Redis refuses ends at
	// once (ErrUnavailable), on a single-node client. Default 1 s. It holds whatever the
	// client's options: a client without go-redis's
	// Options.ContextTimeoutEnabled is copied into one more client (one more
	// connection pool) with it set, which the library uses for its own
	// calls.
	LockTimeout time.Duration

	// Rules sets per-task-type fields, TTL, key and opt-out. Per-call options
	// override them. A name matches as asynq's ServeMux patterns do: the
	// type itself, else the longest name the type begins with ("email:"
	// covers "email:welcome" unless "email:welcome" has a rule of its own).
	// Default: none.
	Rules map[string]Rule

	// OptIn makes deduplication apply only to types that have a rule (that is
	// not Skip) or to calls that pass one of this package's options but Skip
	// and Headers: each of the others asks for deduplication, so none is
	// ignored; Headers is a transport concern (dedupotel adds it to every
	// call). A call opted in without a rule or key option is keyed on its
	// whole payload. Default false: every type is deduplicated on its whole
	// payload.
	OptIn bool

	// RetryDelayFunc must return (an upper bound of) the delay your
	// asynq.Config.RetryDelayFunc gives; across a failed attempt the lock is
	// held for that delay plus TTL. Default: the upper bound of asynq's
	// default, n⁴ + 15 + 29·(n+1) seconds.
	RetryDelayFunc asynq.RetryDelayFunc

	// FailOpen lets tasks through unlocked when Redis fails on a lock call
	// (logged and counted); answers from Redis that a key is held are still
	// enforced. Default false (fail-closed: the enqueue returns an error
	// matching ErrUnavailable, and the middleware does not run the handler).
	FailOpen bool

	// CancelOnLockLoss cancels the handler's context (cause ErrLockLost) when
	// the heartbeat finds the lock taken over or expired. Default false: the
	// loss is logged and counted and the handler goes on.
	CancelOnLockLoss bool

	// SkipBusy makes the execution-time guard drop a task whose key another
	// live task holds (the middleware returns nil, so asynq marks it done),
	// for every type whose Rule leaves OnBusy at its default. Default false:
	// the task is retried later (ErrKeyBusy), because dropping it loses work
	// when its payload differs from the holder's. Rule.OnBusy chooses per
	// type.
	SkipBusy bool

	// NoExecutionGuard turns off locking at execution for tasks that reach
	// the middleware without a lock (asynq.Scheduler, other services, the
	// CLI). Default false: such tasks take a lock when they start.
	NoExecutionGuard bool

	// MaxBatch is the most lock calls sent to Redis as one pipeline. Calls
	// made while every sender is busy are batched (auto-pipelining), which
	// cuts Redis's per-call cost under load; a call never waits for a batch
	// to fill. Default 64; negative turns batching off, so
	// each call makes its own round trip from the calling goroutine.
	MaxBatch int

	// BreakerThreshold is how many consecutive Redis failures open the
	// circuit breaker, after which lock calls fail at once (ErrCircuitOpen)
	// until a probe succeeds; the probes are spaced 500 ms doubling to 30 s,
	// with full jitter. On Redis Cluster each master has its own breaker.
	// Default 5; negative disables the breaker.
	BreakerThreshold int

	// HashKey, if set, switches fingerprints from 64-bit xxhash to a keyed
	// 128-bit hash (HMAC-SHA-256, truncated), for deployments where payload
	// fields come from untrusted users who could otherwise search for a
	// collision to block someone else's key. Keep it secret and the same in
	// every process; changing it changes every key. Default: none (xxhash).
	HashKey []byte

	// OnDecision, if set, is called for every duplicate, fold (Replace,
	// Merge, Defer) and busy arrival, with its type, queue, lock key and
	// the task involved, never the payload: BullMQ's "deduplicated" event.
	// It runs synchronously on the enqueuing (or handling) goroutine, so
	// keep it fast; a panic in it is logged and ignored. In
	// Client.EnqueueBatch too it runs on the goroutine that called it, never
	// twice at once within the batch: with the hook set, the batch's steps
	// that can decide run there one at a time (docs/batch.md). Default:
	// none.
	OnDecision func(Decision)

	// Logger receives warnings (fail-open, lost locks, Redis errors). Never
	// given payload contents. Default slog.Default().
	Logger *slog.Logger

	// The fields below are fixed for users (their defaults apply); the
	// package's tests set them.

	// healGrace is how old a lock taken before its task was stored (by a
	// Client over asynq's own client: WrapClient, or NewClient when it
	// cannot store tasks itself) must be before it is treated as orphaned
	// when its task does not exist in asynq. It covers the gap between
	// taking the lock and asynq storing the task. Default 1 minute.
	healGrace time.Duration

	// breakerBackoff spaces the probes while the breaker is open. Default:
	// 500 ms doubling to 30 s, with full jitter (never below Min).
	breakerBackoff backoff

	// connectAttempts bounds the PINGs New makes before giving up (the
	// context bounds them too). Default 5.
	connectAttempts int

	// connectBackoff spaces the PINGs. Default: 100 ms doubling to 5 s, with
	// full jitter.
	connectBackoff backoff

	// noDirectEnqueue makes a Client from NewClient always enqueue through
	// asynq's client. By default, for a task without asynq.NewTask options,
	// its lock script also stores the task in asynq's own layout (v0.26.0):
	// one round trip instead of two. Default false.
	noDirectEnqueue bool

	// heartbeat is how often the heartbeat looks at running handlers
	// (defaultHeartbeat); the package's tests shorten it.
	heartbeat time.Duration
}

// Rule is the deduplication setting for one task type.
type Rule struct {
	// Fields selects JSON paths ("user_id", "report.kind") whose values form
	// the key. Empty: the whole raw payload (any encoding).
	Fields []string

	// MissingAsNull treats an absent selected field as JSON null. Default
	// false: an absent field is an error (*PayloadError, ErrFieldMissing).
	MissingAsNull bool

	// Key, if set, is the key for every task of this type (hashed; any bytes).
	Key string

	// KeyFunc computes the key from the payload, for non-JSON payloads.
	// It takes precedence over Key and Fields.
	KeyFunc func(taskType string, payload []byte) (string, error)

	// Shared puts Key/KeyFunc keys in one namespace shared by every type with
	// Shared set, instead of one per type.
	Shared bool

	// TTL overrides Config.TTL for this type.
	TTL time.Duration

	// Skip turns deduplication off for this type. A call that passes one
	// of this package's options asking for it (any but Skip and Headers)
	// is refused with ErrInvalidOption rather than have them ignored.
	Skip bool

	// OnConflict: what an enqueue does when the key's task is waiting.
	// Default Reject. The four policies (OnConflict, OnRunning, OnBusy,
	// OnFailure) side by side, with which a call may set:
	// docs/glossary.md#policies.
	OnConflict Conflict

	// MergeFunc is required with OnConflict: Merge.
	MergeFunc MergeFunc

	// OnRunning: what an enqueue does when the key's task is running.
	// Default RunningReject; per type only (docs/glossary.md#policies). Recorded with the key (and RunningAllow in the
	// task's header), so the server needs no matching configuration.
	OnRunning Running

	// OnBusy: what the server's middleware does with a task of this type
	// that arrives without a lock (Scheduler, other services) and finds
	// its key held: retry it later, drop it, or fold it into the holder.
	// Default BusyRetry (BusyDrop with Config.SkipBusy); per type only
	// (docs/glossary.md#policies).
	OnBusy Busy

	// Cooldown keeps the key held after its task succeeds, until Cooldown
	// has passed since the key was taken (throttle: at most one successful
	// run per window); enqueues meanwhile fail with a *DuplicateTaskError
	// whose CoolingDown is set. See Cooldown for the details. Needs
	// OnRunning RunningReject. Default 0: the key frees when its task
	// succeeds.
	Cooldown time.Duration

	// Debounce, with OnConflict Replace or Merge, makes a new task due
	// Debounce after its enqueue, and moves it to Debounce after each later
	// enqueue folded into it while it is still scheduled: a burst runs once,
	// with its last payload, about Debounce after the burst ends; asynq
	// moves due tasks to pending every DelayedTaskCheckInterval (5 s by
	// default), so the run comes up to that much later: lower it on the
	// server for short delays. See Debounce for the details. Not with
	// RunningDefer. Default 0: off.
	Debounce time.Duration

	// Period takes the key at most once per wall-clock window of this
	// length ("one digest per user per day"): the key includes the window,
	// and once its task succeeds it stays held until the window ends. At
	// least a second; whole days from a day on. See Period for the
	// details. Needs OnRunning RunningReject; not with Cooldown. Default
	// 0: off.
	Period time.Duration

	// Location is the time zone of Period's windows (where midnight is).
	// Default nil: UTC.
	Location *time.Location

	// OnFailure: what becomes of the key when its task fails for good
	// (archived after its last retry, or SkipRetry): FailRelease frees it
	// (the default), FailHold keeps it held for FailHoldFor, and
	// FailHoldUntilReleased until someone releases it. See Failure and
	// docs/glossary.md#policies.
	OnFailure Failure

	// FailHoldFor is how long FailHold holds the key after the failure;
	// it goes with OnFailure FailHold only. Default 0.
	FailHoldFor time.Duration

	// MaxPending bounds how many keys of this type may wait in one queue at
	// once; an enqueue of a new key beyond it fails with ErrTooManyPending
	// (or waits, with WaitForRoom). Enqueues folded into waiting keys always
	// pass. Default 0: no bound.
	MaxPending int
}

func (c *Config) withDefaults() (Config, error) {
	cfg := *c
	if cfg.Prefix == "" {
		cfg.Prefix = defaultPrefix
	}
	if strings.ContainsAny(cfg.Prefix, "{}") {
		return cfg, errorf("%w: Prefix %q contains a brace", ErrInvalidOption, cfg.Prefix)
	}
	for name, d := range map[string]*time.Duration{"TTL": &cfg.TTL, "LockTimeout": &cfg.LockTimeout, "HealGrace": &cfg.healGrace} {
		if *d < 0 {
			return cfg, errorf("%w: %s is negative", ErrInvalidOption, name)
		}
		*d = lifetime(*d)
	}
	if cfg.TTL == 0 {
		cfg.TTL = defaultTTL
	}
	if cfg.heartbeat <= 0 {
		cfg.heartbeat = defaultHeartbeat
	}
	if cfg.LockTimeout == 0 {
		cfg.LockTimeout = defaultLockTimeout
	}
	if cfg.healGrace == 0 {
		cfg.healGrace = defaultHealGrace
	}
	if cfg.RetryDelayFunc == nil {
		cfg.RetryDelayFunc = maxDefaultRetryDelay
	}
	if cfg.connectAttempts == 0 {
		cfg.connectAttempts = 5
	}
	if cfg.connectBackoff == (backoff{}) {
		cfg.connectBackoff = backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	}
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = defaultMaxBatch
	}
	if cfg.BreakerThreshold == 0 {
		cfg.BreakerThreshold = 5
	}
	if cfg.breakerBackoff == (backoff{}) {
		cfg.breakerBackoff = backoff{Min: 500 * time.Millisecond, Max: 30 * time.Second}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg, nil
}

// resolved is the effective setting for one task: its type's rule with the
// call's options applied.
type resolved struct {
	skip            bool // the call's Skip
	typeOff         bool // the type's Rule.Skip (optedIn then says a call's option asked for deduplication)
	fields          *jsonkey.Fields
	form            string // how the key is chosen, for the lock record (store's KeyForm); "": work it out (keyForm)
	missingAsNull   bool
	key             string
	hasKey          bool
	keyFunc         func(string, []byte) (string, error)
	shared          bool
	ttl             time.Duration
	optedIn         bool // a rule or a call option asked for dedup (Config.OptIn)
	conflict        Conflict
	merge           MergeFunc
	running         Running
	maxPending      int
	busy            Busy
	cooldown        time.Duration
	period          time.Duration  // Period: the window's length; 0 none
	loc             *time.Location // Period's time zone; nil UTC
	window          time.Time      // Period: the window of this enqueue (settleWindow); zero: work it out when hashing
	windowEnd       time.Time
	failSet         bool          // the per-call OnFailure option applied
	firing          time.Duration // a Scheduler firing: its key is held this long from the take, whatever its task does
	failHold        time.Duration // recorded in a taken lock: 0 release on a final failure, negative hold until released, else hold
	callKept        []string      // the per-call Cooldown and OnFailure options applied (a fold does not apply them: the key keeps what it was taken with)
	debounce        time.Duration
	waitForRoom     bool
	callConflict    Conflict // the per-call OnConflict, if callConflictSet
	callConflictSet bool
	callMerge       MergeFunc // the per-call MergeWith function, if any
	callKey         string    // the per-call key option applied ("dedup.Key", "dedup.SharedKey"), if any
	fixedFP         string    // the key's fingerprint, given (a busy arrival folded into the key it met)
	quiet           bool      // an enqueue on the middleware's behalf: its busy decision speaks for it
}

// ruleError names the rule an option error (one matching ErrInvalidOption)
// came from, in the order of every other error of this package: the
// sentinel first, then where, then what.
func ruleError(typ string, err error) error {
	what := strings.TrimPrefix(err.Error(), ErrInvalidOption.Error()+": ")
	return &wrapped{msg: fmt.Sprintf("%v: rule for %q: %s", ErrInvalidOption, typ, what), err: err}
}

func compileRules(rules map[string]Rule) (map[string]*resolved, error) {
	out := make(map[string]*resolved, len(rules))
	for typ, r := range rules {
		if strings.TrimSpace(typ) == "" {
			return nil, errorf("%w: a rule with a blank name would match every type (asynq's ServeMux refuses such patterns too)", ErrInvalidOption)
		}
		fs, err := compileFields(r.Fields)
		if err != nil {
			return nil, ruleError(typ, err)
		}
		if r.TTL < 0 {
			return nil, errorf("%w: rule for %q: negative TTL", ErrInvalidOption, typ)
		}
		if r.MaxPending < 0 {
			return nil, errorf("%w: rule for %q: negative MaxPending", ErrInvalidOption, typ)
		}
		if r.OnConflict < Reject || r.OnConflict > Merge || r.OnRunning < RunningReject || r.OnRunning > RunningDefer {
			return nil, errorf("%w: rule for %q: unknown policy", ErrInvalidOption, typ)
		}
		if r.OnBusy < BusyRetry || r.OnBusy > BusyFold {
			return nil, errorf("%w: rule for %q: unknown OnBusy", ErrInvalidOption, typ)
		}
		if (r.OnConflict == Merge) != (r.MergeFunc != nil) {
			return nil, errorf("%w: rule for %q: OnConflict Merge and MergeFunc go together", ErrInvalidOption, typ)
		}
		res := &resolved{
			typeOff: r.Skip, fields: fs, missingAsNull: r.MissingAsNull,
			key: r.Key, hasKey: r.Key != "", keyFunc: r.KeyFunc, shared: r.Shared, ttl: lifetime(r.TTL), optedIn: !r.Skip,
			conflict: r.OnConflict, merge: r.MergeFunc, running: r.OnRunning, maxPending: r.MaxPending, busy: r.OnBusy,
			cooldown: min(r.Cooldown, maxLifetime), debounce: min(r.Debounce, maxLifetime),
		}
		if res.failHold, err = failHold(r.OnFailure, r.FailHoldFor); err != nil {
			return nil, ruleError(typ, err)
		}
		if r.Period != 0 {
			if err := checkPeriod(r.Period); err != nil {
				return nil, ruleError(typ, err)
			}
			res.period, res.loc = r.Period, r.Location
		}
		if err := res.checkModes(); err != nil {
			return nil, ruleError(typ, err)
		}
		res.form = keyForm(res)
		out[typ] = res
	}
	return out, nil
}
