package dedup

import (
	"context"
	"errors"
	"log/slog"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup/internal/asynqconn"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Dedup holds the configuration and Redis client shared by the client
// wrapper (WrapClient) and the server middleware (Middleware). It is safe for
// concurrent use. Create one per process with New and Close it on shutdown.
type Dedup struct {
	rdb             redis.UniversalClient // the caller's client, which asynq's client and Inspector use
	own             redis.UniversalClient // the library's own copy of rdb with ContextTimeoutEnabled; nil: rdb has it
	cfg             Config
	rules           map[string]*resolved
	prefixes        []string // the rule names, longest first, for ruleFor's prefix match
	ownsRDB         bool     // made by NewFromRedisConnOpt: Close closes rdb
	closed          atomic.Bool
	foldOnce        sync.Once
	folder          *Client // enqueues busy arrivals of BusyFold types
	log             *slog.Logger
	store           *store.Store     // the Redis layout, and every call to Redis
	insp            *asynq.Inspector // called through store.Foreign
	hb              *heartbeater
	owed            *owedSignal // tells a RunningDefer success whether it owes a follow-up (owed.go)
	releases        *releases   // releases the locks of arrivals' successes together (releases.go)
	stats           metrics
	warnedElsewhere atomic.Bool // the middleware met a task stored in another Redis (logged once)
	here            sync.Map    // queues whose tasks the middleware found stored in the Dedup's Redis

	// queues remembers, per task type, the queue its tasks landed in when the
	// call named none (a queue set in asynq.NewTask is invisible before the
	// enqueue), so the next lock is taken in the right queue at once.
	queues sync.Map // string → string
}

// New checks that Redis answers (PING with backoff, at most 5 times,
// bounded by ctx), loads the lock scripts and returns a Dedup. It
// fails with an error matching ErrInvalidOption for a bad Config, or
// ErrUnavailable (wrapping the last Redis error) when Redis does not answer
// or refuses the login (not retried).
//
// rdb may be the same client asynq uses: a single node, Sentinel failover
// or Cluster client. New does not take ownership of it. On a
// *redis.Client (rdb, or the library's copy of it) it adds a hook that
// watches the client's dials, once per client, and changes no command: a
// library call waiting for a connection that Redis refuses then ends at
// once, with the dial's error.
//
// With the zero Config every task type that passes through a Client is
// deduplicated on its whole payload: identical enqueues of any type are
// refused while the first waits or runs. Set Config.OptIn to limit it to
// types with a Rule (or calls with a key option).
//
// NewClient's direct path writes asynq v0.26.0's task layout; if the
// binary's build information names another asynq version, or the linked
// asynq has no task headers (before v0.26.0), New logs a warning and turns
// the direct path off: enqueues then go through asynq's own client
// (docs/versions.md).
func New(ctx context.Context, rdb redis.UniversalClient, cfg Config) (*Dedup, error) {
	if isNil(rdb) {
		return nil, errorf("%w: nil redis client", ErrInvalidOption)
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	rules, err := compileRules(c.Rules)
	if err != nil {
		return nil, err
	}
	lib, own := rdb, boundedCopy(rdb) // (every call of the library's is bounded by LockTimeout)
	if own != nil {
		lib = own
	}
	if err := connect(ctx, lib, c.connectAttempts, c.connectBackoff, c.LockTimeout); err != nil {
		if own != nil {
			_ = own.Close()
		}
		return nil, err
	}
	if v, ok := linkedAsynq(); ((ok && !knownLayout(v)) || !hasHeaders()) && !c.noDirectEnqueue {
		c.Logger.Warn("dedup: linked asynq is not the version whose task layout this package writes; enqueues go through asynq's client",
			slog.String("asynq", v), slog.String("known", store.AsynqVersion))
		c.noDirectEnqueue = true
	}
	d := &Dedup{rdb: rdb, own: own, cfg: c, rules: rules, prefixes: longestFirst(rules), log: c.Logger, insp: asynqconn.Inspector(rdb)}
	d.store = store.New(lib, d.storeConfig())
	d.hb = newHeartbeater(d, c.heartbeat)
	d.owed = newOwedSignal(d, lib)
	d.releases = newReleases(d)
	if err := d.store.LoadScripts(ctx); err != nil {
		// Best effort: a call whose script is missing sends it whole.
		d.log.Debug("dedup: script preload failed", slog.Any("error", err))
	}
	d.warnEviction(ctx)
	return d, nil
}

// isNil reports whether a client is nil, or an interface holding a nil
// pointer.
func isNil(rdb redis.UniversalClient) bool {
	if rdb == nil {
		return true
	}
	v := reflect.ValueOf(rdb)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// storeConfig is the part of the Config the Redis layer needs.
func (d *Dedup) storeConfig() store.Config {
	c := d.cfg
	return store.Config{
		Prefix: c.Prefix, LockTimeout: c.LockTimeout, HealGrace: c.healGrace,
		MaxBatch: c.MaxBatch, BreakerThreshold: c.BreakerThreshold,
		BreakerWait: func(opens int) time.Duration {
			if opens == 0 {
				return c.breakerBackoff.Min
			}
			return max(c.breakerBackoff.delay(opens), c.breakerBackoff.Min)
		},
		ErrCircuitOpen: ErrCircuitOpen,
		OnBreakerOpen:  func() { d.count("", evBreakerOpen) },
		Logger:         c.Logger,
	}
}

// warnEviction warns when Redis may evict keys, locks among them.
func (d *Dedup) warnEviction(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.LockTimeout)
	defer cancel()
	v, err := d.store.Client().ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		return // CONFIG may be disabled (managed Redis); nothing to check
	}
	if p, ok := v["maxmemory-policy"]; ok && p != "noeviction" {
		d.log.Warn("dedup: Redis maxmemory-policy may evict locks; use noeviction", slog.String("maxmemory-policy", p))
	}
}

// Close stops the heartbeat. Call it after asynq.Server.Shutdown: the locks
// of handlers still running afterwards are no longer extended, and last
// their TTL.
// It also stops the hot-key reporter (logging its last window) and the stats
// flusher (flushing one last time); a failure of that last flush is
// returned, wrapped, after everything else is closed all the same. It does
// not close the Redis client, unless NewFromRedisConnOpt made it.
// Close is idempotent; Middleware after Close logs an error and renews
// nothing.
func (d *Dedup) Close() error {
	d.hb.stop()
	d.owed.stop()
	d.releases.close()
	err := d.stopDiagnostics() // (nil but for the call that flushed)
	d.store.Close(d.rdb)       // (later calls go through the caller's client)
	if !d.closed.CompareAndSwap(false, true) {
		return err
	}
	if d.own != nil {
		err = errors.Join(err, d.own.Close())
	}
	if d.ownsRDB {
		err = errors.Join(err, d.rdb.Close())
	}
	return err
}

// boundedCopy returns a copy of rdb, over the same options, that cuts its
// calls at their context's deadline (ContextTimeoutEnabled), or nil when
// rdb does so already or is of a kind it cannot copy (whose calls the
// Store then abandons at the deadline).
func boundedCopy(rdb redis.UniversalClient) redis.UniversalClient {
	if store.ContextTimeouts(rdb) {
		return nil
	}
	switch c := rdb.(type) {
	case *redis.Client:
		o := *c.Options()
		o.ContextTimeoutEnabled = true
		// What NewClient derived for c stays c's: its push processor (shared,
		// a second client would register its handlers twice), its cache.
		o.PushNotificationProcessor, o.ClientSideCache, o.ClientSideCacheConfig = nil, nil, nil
		return redis.NewClient(&o)
	case *redis.ClusterClient:
		o := *c.Options()
		o.ContextTimeoutEnabled = true
		o.PushNotificationProcessor = nil
		return redis.NewClusterClient(&o)
	case *redis.Ring:
		o := *c.Options()
		o.ContextTimeoutEnabled = true
		return redis.NewRing(&o)
	}
	return nil
}

// NewFromRedisConnOpt is New over a Redis client made from an asynq
// connection option (asynq.RedisClientOpt, RedisFailoverClientOpt,
// RedisClusterClientOpt), for code that configures asynq that way. The
// Dedup owns that client: Close closes it. Give asynq's client and server
// the same option (or, to share one connection pool, build a go-redis
// client yourself and use New with asynq.NewClientFromRedisClient).
func NewFromRedisConnOpt(ctx context.Context, opt asynq.RedisConnOpt, cfg Config) (*Dedup, error) {
	if opt == nil {
		return nil, errorf("%w: nil asynq.RedisConnOpt", ErrInvalidOption)
	}
	rdb, ok := opt.MakeRedisClient().(redis.UniversalClient)
	if !ok || isNil(rdb) {
		return nil, errorf("%w: %T does not make a go-redis v9 client", ErrInvalidOption, opt)
	}
	d, err := New(ctx, rdb, cfg)
	if err != nil {
		_ = rdb.Close()
		return nil, err
	}
	d.ownsRDB = true
	return d, nil
}

// ruleFor returns the rule of a task type, matched as asynq's ServeMux
// matches handlers: the rule named exactly the type, else the one with the
// longest name the type begins with ("email:" covers "email:welcome").
func (d *Dedup) ruleFor(typ string) resolved {
	if r, ok := d.rules[typ]; ok {
		return *r
	}
	for _, p := range d.prefixes {
		if strings.HasPrefix(typ, p) {
			return *d.rules[p]
		}
	}
	return resolved{}
}

// longestFirst lists the rules' names, longest first (ties by name, so the
// match does not depend on map order).
func longestFirst(rules map[string]*resolved) []string {
	names := make([]string, 0, len(rules))
	for n := range rules {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		if len(names[i]) != len(names[j]) {
			return len(names[i]) > len(names[j])
		}
		return names[i] < names[j]
	})
	return names
}

// active reports whether a resolved rule deduplicates.
func (d *Dedup) active(r *resolved) bool {
	if r.skip || r.typeOff {
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

// lockKey is the Redis key of ref's lock, as errors report it.
func (d *Dedup) lockKey(ref *store.Ref) string {
	if ref.Lock != "" {
		return ref.Lock
	}
	return d.store.Keys().Lock(ref.Queue, ref.FP)
}
