package dedup

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Dedup holds the configuration and Redis client shared by the client
// wrapper (WrapClient) and the server middleware (Middleware). It is safe for
// concurrent use. Create one per process with New and Close it on shutdown.
type Dedup struct {
	rdb   redis.UniversalClient
	cfg   Config
	rules map[string]*resolved
	log   *slog.Logger
	insp  *asynq.Inspector
	hb    *heartbeater
	br    *breaker
	batch *batcher // nil when Config.MaxBatch < 0

	ctxTimeouts bool // the client applies context deadlines to socket reads
	stats       metrics

	// queues remembers, per task type, the queue its tasks landed in when the
	// call named none (a queue set in asynq.NewTask is invisible before the
	// enqueue), so the next lock is taken in the right queue at once.
	queues sync.Map // string → string
}

// New checks that Redis answers (PING with backoff, bounded by ctx and
// Config.ConnectAttempts), loads the lock scripts and returns a Dedup. It
// fails with an error matching ErrInvalidOption for a bad Config, or
// ErrUnavailable (wrapping the last Redis error) when Redis does not answer.
//
// rdb may be the same client asynq uses: a single node, Sentinel failover
// or Cluster client. New does not take ownership of it.
func New(ctx context.Context, rdb redis.UniversalClient, cfg Config) (*Dedup, error) {
	if rdb == nil {
		return nil, fmt.Errorf("%w: nil redis client", ErrInvalidOption)
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	rules, err := compileRules(c.Rules)
	if err != nil {
		return nil, err
	}
	if err := connect(ctx, rdb, c.ConnectAttempts, c.ConnectBackoff, c.LockTimeout); err != nil {
		return nil, err
	}
	d := &Dedup{
		rdb:   rdb,
		cfg:   c,
		rules: rules,
		log:   c.Logger,
		insp:  asynq.NewInspectorFromRedisClient(rdb),
	}
	d.hb = newHeartbeater(d, c.Lease/3)
	d.ctxTimeouts = contextTimeouts(rdb)
	if c.MaxBatch > 0 {
		d.batch = newBatcher(rdb, c.MaxBatch, c.LockTimeout, d.ctxTimeouts)
	}
	d.br = &breaker{threshold: c.BreakerThreshold, backoff: c.BreakerBackoff, log: c.Logger, onOpen: func() { d.count("", evBreakerOpen) }}
	lctx, cancel := context.WithTimeout(ctx, c.LockTimeout)
	defer cancel()
	for _, s := range allScripts {
		// Best effort: EVALSHA falls back to EVAL when a script is missing.
		if err := s.Load(lctx, rdb).Err(); err != nil {
			d.log.Debug("dedup: script preload failed", slog.Any("error", err))
		}
	}
	d.warnEviction(lctx)
	return d, nil
}

// warnEviction warns when Redis may evict keys, locks among them.
func (d *Dedup) warnEviction(ctx context.Context) {
	v, err := d.rdb.ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		return // CONFIG may be disabled (managed Redis); nothing to check
	}
	if p, ok := v["maxmemory-policy"]; ok && p != "noeviction" {
		d.log.Warn("dedup: Redis maxmemory-policy may evict locks; use noeviction", slog.String("maxmemory-policy", p))
	}
}

// Close stops the heartbeat. Call it after asynq.Server.Shutdown: handlers
// still running afterwards keep their locks only until their lease runs out.
// It also stops the hot-key reporter (logging its last window) and the stats
// flusher (flushing one last time). It does not close the Redis client.
// Close is idempotent; Middleware after Close logs an error and renews
// nothing.
func (d *Dedup) Close() error {
	d.hb.stop()
	d.stopDiagnostics()
	if d.batch != nil {
		d.batch.stop()
	}
	return nil
}

// ruleFor returns a copy of the effective rule for a task type.
func (d *Dedup) ruleFor(typ string) resolved {
	if r, ok := d.rules[typ]; ok {
		return *r
	}
	return resolved{}
}

// active reports whether a resolved rule deduplicates.
func (d *Dedup) active(r *resolved) bool {
	if r.skip {
		return false
	}
	return !d.cfg.OptIn || r.optedIn
}

func (d *Dedup) ttlOf(r *resolved) time.Duration {
	if r.ttl > 0 {
		return r.ttl
	}
	return d.cfg.TTL
}

// lockRef names one lock and the task that owns or wants it.
type lockRef struct {
	queue string
	key   string // lock key
	idx   string // index key for a caller-chosen task ID, or ""
	fpHex string
	id    string // task ID
	typ   string
}

// stored is the task ID as the lock record stores it (packLockID).
func (r *lockRef) stored() string { return packLockID(r.id, r.fpHex) }

func (r *lockRef) keys() []string {
	if r.idx != "" {
		return []string{r.key, r.idx}
	}
	return []string{r.key}
}

func (d *Dedup) newRef(queue, fpHex, id, typ string, callerID bool) *lockRef {
	r := &lockRef{queue: queue, fpHex: fpHex, id: id, typ: typ}
	r.key = lockKeyHex(d.cfg.Prefix, queue, r.fpHex)
	if callerID {
		r.idx = indexKey(d.cfg.Prefix, queue, id)
	}
	return r
}

func (d *Dedup) graceSeconds() int64 {
	s := int64(d.cfg.HealGrace / time.Second)
	if s < 1 {
		s = 1
	}
	return s
}

// lockCtx bounds one lock call by Config.LockTimeout.
func (d *Dedup) lockCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.cfg.LockTimeout)
}

// acquireArgs are the per-call inputs of the acquire script.
type acquireArgs struct {
	ttl        time.Duration
	conflict   Conflict
	running    Running
	payload    []byte // for Replace and a Defer follow-up
	followID   string // ID a Defer follow-up would get
	max        int    // MaxPending, 0 for none
	msg        []byte // asynq's task message to store with the lock (direct path), or nil
	scheduleAt int64  // for msg: unix seconds it is due, 0 for pending now
}

func asynqPrefix(queue string) string { return "asynq:{" + queue + "}:" }

func (d *Dedup) dedupPrefix(queue string) string { return d.cfg.Prefix + ":{" + queue + "}:" }

func (d *Dedup) acquire(ctx context.Context, r *lockRef, a acquireArgs) (reply, error) {
	policy := "x"
	switch a.conflict {
	case Replace:
		policy = "r"
	case Merge:
		policy = "m"
	}
	// The optional arguments go only as far as the last one that differs
	// from its default (see the script's header): a plain call sends 8.
	args := make([]any, 8, 15)
	args[0], args[1], args[2], args[3] = r.id, r.stored(), time.Now().UnixMilli(), d.graceSeconds()
	args[4], args[5], args[6], args[7] = ms(a.ttl), asynqPrefix(r.queue), r.typ, a.msg
	opt := [...]any{policy, a.running.code(), a.scheduleAt, a.max, a.payload, a.followID, d.parkSeconds()}
	n := 0
	switch {
	case a.followID != "":
		n = 7
	case len(a.payload) > 0:
		n = 5
	case a.max > 0:
		n = 4
	case a.scheduleAt != 0:
		n = 3
	case a.running != RunningReject:
		n = 2
	case policy != "x":
		n = 1
	}
	args = append(args, opt[:n]...)
	v, err := d.run(ctx, acquireScript, r.keys(), args...)
	if err != nil {
		return reply{}, err
	}
	rep, err := parseReply(v)
	if err == nil && rep.status == statusHeldRaw {
		rep.status = statusHeld
		if len(rep.strs) > 0 {
			rep.strs[0] = unpackLockID(rep.strs[0], r.fpHex)
		}
	}
	return rep, err
}

// coalesce writes a merged payload into target if the lock's version is
// still ver. It reports whether it wrote, and the target's asynq state.
func (d *Dedup) coalesce(ctx context.Context, r *lockRef, target, ver string, payload []byte) (bool, string, error) {
	v, err := d.run(ctx, coalesceScript, []string{r.key}, target, ver, payload, asynqPrefix(r.queue), r.fpHex)
	if err != nil {
		return false, "", err
	}
	rep, err := parseReply(v)
	if err != nil {
		return false, "", err
	}
	if rep.status == statusBroken {
		return false, "", fmt.Errorf("%w: %s", ErrIncompatible, rep.str(0))
	}
	return rep.status == 1, rep.str(0), nil
}

// start makes this attempt the lock's running owner; running is the policy
// recorded if start has to create the lock (it was lost or never taken).
func (d *Dedup) start(ctx context.Context, r *lockRef, token string, running Running) (int64, string, error) {
	v, err := d.run(ctx, startScript, r.keys(), r.id, token, ms(d.cfg.Lease), r.typ,
		asynqPrefix(r.queue), d.dedupPrefix(r.queue), d.graceSeconds(), r.fpHex, running.code(), r.stored())
	if err != nil {
		return 0, "", err
	}
	return parsePair(v)
}

// extend renews the lock if (task ID, token) still owns it; token "" means
// the waiting lock.
func (d *Dedup) extend(ctx context.Context, r *lockRef, token string, ttl time.Duration) (bool, error) {
	v, err := d.run(ctx, extendScript, r.keys(), r.stored(), token, ms(ttl), asynqPrefix(r.queue), d.parkSeconds(), d.dedupPrefix(r.queue), r.fpHex)
	if err != nil {
		return false, err
	}
	return parseFlag(v)
}

// finish releases the lock (to the owed follow-up, if any) or holds it for
// a retry. It reports whether the attempt still owned the lock, and the
// follow-up that now holds it, if one was released.
func (d *Dedup) finish(ctx context.Context, r *lockRef, token string, release bool, hold, followTTL time.Duration) (bool, string, error) {
	mode := "hold"
	if release {
		mode = "release"
	}
	v, err := d.run(ctx, finishScript, r.keys(), r.stored(), token, mode, ms(hold),
		asynqPrefix(r.queue), ms(followTTL), d.parkSeconds(), d.dedupPrefix(r.queue), r.fpHex)
	if err != nil {
		return false, "", err
	}
	st, f, err := parsePair(v)
	return st == 1, f, err
}

func (d *Dedup) unlock(ctx context.Context, r *lockRef) (bool, error) {
	v, err := d.run(ctx, unlockScript, r.keys(), r.stored(), d.dedupPrefix(r.queue), r.typ, r.fpHex)
	if err != nil {
		return false, err
	}
	return parseFlag(v)
}
