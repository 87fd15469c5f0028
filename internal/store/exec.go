package store

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Config configures a Store. Every field is required (the root package's
// Config supplies the defaults).
type Config struct {
	Prefix      string
	LockTimeout time.Duration // bound of every call
	HealGrace   time.Duration // a lock taken before its task was stored is never orphaned younger
	MaxBatch    int           // most script calls per pipeline; < 0: no batching
	// Recheck bounds how long plain rejections of a key are answered from
	// the lock alone after its holder's record was last read (0:
	// DefaultRecheck; < 0: read it on every rejection).
	Recheck          time.Duration
	BreakerThreshold int // consecutive failures that open the breaker; < 0: no breaker
	// BreakerWait is how long the breaker stays open after opens earlier
	// consecutive openings.
	BreakerWait    func(opens int) time.Duration
	ErrCircuitOpen error  // the error of a call the open breaker refuses
	OnBreakerOpen  func() // called each time the breaker opens
	Logger         *slog.Logger
}

// DefaultRecheck bounds how long a process answers a plain rejection from
// the lock alone after it last read the holder's record (Config.Recheck):
// a hot key's rejections do not each pay for that read, and a holder that
// has gone frees the key within this time.
const DefaultRecheck = time.Second

// Store is the library's one path to Redis: every call goes through the
// circuit breaker of its node and is bounded by Config.LockTimeout;
// concurrent script calls for one node share pipelines (batch.go,
// shard.go). Its client should cut calls at their context's deadline
// (go-redis's ContextTimeoutEnabled), so that every call runs on its
// caller's goroutine and a hung Redis holds none past LockTimeout. It is
// safe for concurrent use.
type Store struct {
	conn      atomic.Pointer[conn] // the client calls go through (swapped by Close)
	keys      Keys
	cfg       Config
	sc        *scriptSet
	sh        *shards
	hints     hintCache
	published sync.Map // queues registered by PublishQueue
	pruned    sync.Map // waiting set → when and on what counts PruneWaiting last checked it (pruneCheck)

}

// conn is a client and whether it cuts a call at its context's deadline
// (bounded); else (a client of a kind the caller could not copy with
// ContextTimeoutEnabled) a call runs on another goroutine that its caller
// leaves at the deadline, and calls are not batched.
type conn struct {
	rdb     redis.UniversalClient
	bounded bool
	watch   *DialWatch // nil: rdb's dials are not watched (reach.go)
}

func newConn(rdb redis.UniversalClient, watch *DialWatch) *conn {
	return &conn{rdb: rdb, bounded: ContextTimeouts(rdb), watch: watch}
}

// New returns a Store over rdb, which should have ContextTimeoutEnabled. It
// does not take ownership of rdb; it watches rdb's dials (WatchDials).
func New(rdb redis.UniversalClient, cfg Config) *Store {
	if cfg.Recheck == 0 {
		cfg.Recheck = DefaultRecheck
	}
	s := &Store{keys: NewKeys(cfg.Prefix), cfg: cfg, sc: scripts()}
	s.conn.Store(newConn(rdb, WatchDials(rdb)))
	s.sh = newShards(rdb, s.newShard)
	return s
}

// newShard makes one node's breaker and batcher.
func (s *Store) newShard() *shard {
	cfg := &s.cfg
	sh := &shard{br: &breaker{threshold: cfg.BreakerThreshold, wait: cfg.BreakerWait, log: cfg.Logger, onOpen: cfg.OnBreakerOpen}}
	if c := s.conn.Load(); cfg.MaxBatch > 0 && c.bounded {
		sh.batch = newBatcher(c.rdb, c.watch, cfg.MaxBatch, cfg.LockTimeout)
	}
	return sh
}

// Close makes later calls go straight to Redis, through fallback (the
// caller may then close the client the Store was made with), whose dials
// it does not watch. It does not close a Redis client.
func (s *Store) Close(fallback redis.UniversalClient) {
	for _, sh := range s.sh.all() {
		if sh.batch != nil {
			sh.batch.stop()
		}
	}
	s.conn.Store(newConn(fallback, nil))
}

// Client is the Store's Redis client.
func (s *Store) Client() redis.UniversalClient { return s.conn.Load().rdb }

// Keys returns the key names of this Store's prefix.
func (s *Store) Keys() Keys { return s.keys }

// BreakerState reports the circuit breakers' state: the worst of the
// nodes' that serve slots now (open, else probing, else closed).
func (s *Store) BreakerState() BreakerState {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.LockTimeout)
	defer cancel()
	worst := BreakerClosed
	for _, sh := range s.sh.live(ctx) {
		switch st := sh.br.current(); {
		case st == BreakerOpen:
			return BreakerOpen
		case st == BreakerProbing:
			worst = BreakerProbing
		}
	}
	return worst
}

// LoadScripts loads the scripts into Redis's cache, best effort: a call
// whose script is missing sends it whole (EVALSHA falls back to EVAL).
func (s *Store) LoadScripts(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
	defer cancel()
	for _, sc := range s.sc.all() {
		if err := sc.Load(ctx, s.Client()).Err(); err != nil {
			return err
		}
	}
	return nil
}

// run executes a script through its node's breaker, batched with
// concurrent calls for that node when batching is on (and straight to
// Redis once the batcher is stopped). Every key of a call is in one slot,
// so its first key names the node.
func (s *Store) run(ctx context.Context, sc *redis.Script, keys []string, args ...any) (any, error) {
	sh := s.sh.forKey(ctx, keys[0])
	return s.guard(ctx, sh, func() (any, error) {
		if sh.batch != nil {
			if v, err, ok := sh.batch.do(ctx, sc, keys, args); ok {
				return v, err
			}
		}
		return s.direct(ctx, func(c context.Context) (any, error) {
			return sc.Run(c, s.Client(), keys, args...).Result()
		})
	})
}

// Do makes a Redis call outside the scripts through the breaker of the node
// serving route (a key of the call; "" for calls on no one node), bounded
// by LockTimeout. fn returns its result rather than writing it to a
// variable of the caller: a call the caller leaves at the deadline goes on
// in its own goroutine.
func (s *Store) Do(ctx context.Context, route string, fn func(ctx context.Context, c redis.Cmdable) (any, error)) (any, error) {
	return s.guard(ctx, s.sh.forKey(ctx, route), func() (any, error) {
		return s.direct(ctx, func(c context.Context) (any, error) { return fn(c, s.Client()) })
	})
}

// Foreign runs fn, a call through a client this package does not drive
// (asynq's Inspector takes no context), through the breaker of route's node
// (as Do), and leaves it running when ctx or LockTimeout ends first, or a
// dial of the Store's client fails (reach.go). Like Do's, fn returns its
// result.
func (s *Store) Foreign(ctx context.Context, route string, fn func() (any, error)) (any, error) {
	return s.guard(ctx, s.sh.forKey(ctx, route), func() (any, error) {
		lctx, cancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
		defer cancel()
		w := s.conn.Load().watch.Enter(ctx, cancel)
		v, err := abandonable(lctx, func(context.Context) (any, error) { return fn() })
		return v, w.Leave(err)
	})
}

// guard runs send through sh's circuit breaker and records its outcome.
//
// A call the open breaker refuses still asks go-redis to reload the
// cluster's slot map (faulted: at most once per reloadEvery): on Redis
// Cluster an open breaker is a master's that failed, and while it stays
// open (BreakerWait, up to half a minute) the refused calls are the only
// traffic for its slots. Without the reload, a replica promoted meanwhile
// would be learnt of only at the breaker's next probe or at go-redis's
// own periodic reload (a minute), and the queue would stay refused, on
// the dead master's shard, until then; with it, the next call after the
// reload finds the slots on the promoted node, whose shard (and breaker)
// is its own.
func (s *Store) guard(ctx context.Context, sh *shard, send func() (any, error)) (any, error) {
	if !sh.br.allow() {
		s.sh.faulted()
		return nil, sh.br.refusal(s.cfg.ErrCircuitOpen)
	}
	v, err := send()
	if sh.br.record(ctx, err) {
		s.sh.faulted()
	}
	return v, err
}

// direct makes one call, bounded by LockTimeout, and ended at once by a
// failed dial (reach.go).
func (s *Store) direct(ctx context.Context, fn func(context.Context) (any, error)) (any, error) {
	return s.watched(ctx, func(c context.Context, _ Watched) (any, error) { return fn(c) })
}

// watched is direct for a call that answers others too (a pipeline's
// callers), which w.explain tells about a failed dial that ended it.
func (s *Store) watched(ctx context.Context, fn func(context.Context, Watched) (any, error)) (any, error) {
	lctx, cancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
	defer cancel()
	c := s.conn.Load()
	w := c.watch.Enter(ctx, cancel)
	call := func(cc context.Context) (any, error) { return fn(cc, w) }
	var (
		v   any
		err error
	)
	if c.bounded {
		v, err = call(lctx)
	} else {
		v, err = abandonable(lctx, call)
	}
	return v, w.Leave(err)
}

// abandonable returns when call does or ctx ends, whichever comes first;
// the call then goes on in its goroutine until the client's own timeouts
// end it.
func abandonable(ctx context.Context, call func(context.Context) (any, error)) (any, error) {
	type result struct {
		v   any
		err error
	}
	ch := make(chan result, 1)
	go func() {
		v, err := call(ctx)
		ch <- result{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Pipelined sends the commands fn queues as one pipeline (one per node on
// Redis Cluster) through the breaker of route's node (as Do), bounded by
// LockTimeout, and returns them, each with its own result. It returns nil
// commands, and the error, when the pipeline did not complete: refused by
// the breaker, or left at the deadline (its commands may still be filled
// in, so they must not be read).
func (s *Store) Pipelined(ctx context.Context, route string, fn func(p redis.Pipeliner)) ([]redis.Cmder, error) {
	p := s.Client().Pipeline()
	fn(p)
	v, err := s.Do(ctx, route, func(c context.Context, _ redis.Cmdable) (any, error) { return p.Exec(c) })
	cmds, _ := v.([]redis.Cmder)
	return cmds, err
}

// Batching reports whether concurrent script calls share pipelines.
func (s *Store) Batching() bool { return s.sh.one.batch != nil }

// ContextTimeouts reports whether a client cuts calls at their context's
// deadline on the socket (go-redis's Options.ContextTimeoutEnabled).
func ContextTimeouts(rdb redis.UniversalClient) bool {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}

// flag encodes a boolean script argument: "1" or "" (boxed once, so that
// passing one allocates nothing).
func flag(b bool) any {
	if b {
		return flagTrue
	}
	return flagFalse
}

var flagTrue, flagFalse any = "1", ""
