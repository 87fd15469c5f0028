package store

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Auto-pipelining. Under load a lock call's cost is mostly fixed per request
// (a socket read and write on both sides, parsing, a goroutine wake-up), so
// lock calls made at the same moment by many goroutines are sent together as
// one pipeline and share it. A call never waits for company: with a free
// pipeline slot it is sent at once, alone; only calls that arrive while every
// slot is busy are batched. One goroutine therefore sees plain single round
// trips, and 64 see pipelines of tens of calls.
//
// The caller that finds a free slot sends the batch itself (its own call
// first, then every call waiting at that moment), so no goroutine is woken
// for a lone call. The Store's client cuts a call off at its context's
// deadline on the socket (ContextTimeoutEnabled), so a stalled Redis holds
// no caller past LockTimeout.
//
// Invariants: at most `slots` batches are in flight; a request is handed
// over by an unbuffered send, so it is never queued where no sender will see
// it; every request handed over is answered exactly once on its buffered
// done channel (a sender never blocks on a caller that left); a request
// whose caller gave up before its batch was sent is not sent. After stop,
// calls go straight to Redis (do reports ok == false).

// slots is how many batches may be in flight at once: enough to keep Redis
// busy while replies travel, few enough that batches stay large.
const slots = 2

// batchReq is one script call waiting to be sent.
type batchReq struct {
	ctx       context.Context
	s         *redis.Script
	keys      []string
	args      []any
	done      chan batchRes // buffered: answering never blocks
	abandoned atomic.Bool   // the caller's deadline passed before it was sent
}

// gone reports why the caller no longer waits, or nil.
func (r *batchReq) gone() error {
	if r.abandoned.Load() {
		return context.DeadlineExceeded
	}
	return r.ctx.Err()
}

type batchRes struct {
	v   any
	err error
}

type batcher struct {
	rdb     redis.UniversalClient
	watch   *DialWatch // nil: rdb's dials are not watched
	max     int
	timeout time.Duration // bounds each call and each pipeline
	slot    chan struct{} // one token per batch in flight
	reqs    chan *batchReq
	stopped chan struct{}
	once    sync.Once
	batches sync.Pool // *[]*batchReq
}

func newBatcher(rdb redis.UniversalClient, watch *DialWatch, max int, timeout time.Duration) *batcher {
	b := &batcher{rdb: rdb, watch: watch, max: max, timeout: timeout, slot: make(chan struct{}, slots),
		reqs: make(chan *batchReq), stopped: make(chan struct{})}
	b.batches.New = func() any { s := make([]*batchReq, 0, max); return &s }
	return b
}

// do runs s, bounded by timeout and ctx. ok is false when the batcher is
// stopped and did not send the call: the caller must then make it itself.
//
// The deadline is a pooled timer rather than a context.WithTimeout per call:
// under load that allocation and its cancellation were a tenth of the
// producer's CPU per enqueue.
func (b *batcher) do(ctx context.Context, s *redis.Script, keys []string, args []any) (v any, err error, ok bool) {
	select {
	case <-b.stopped: // (first: a select picks any of its ready cases)
		return nil, nil, false
	default:
	}
	select {
	case b.slot <- struct{}{}: // a free slot, the common case when calls are few
		v, err := b.lead(ctx, s, keys, args)
		return v, err, true
	default:
	}
	req := &batchReq{ctx: ctx, s: s, keys: keys, args: args, done: make(chan batchRes, 1)}
	t := timers.Get().(*time.Timer)
	t.Reset(b.timeout)
	defer func() {
		t.Stop()
		timers.Put(t)
	}()
	select {
	case b.slot <- struct{}{}:
		v, err := b.lead1(req)
		return v, err, true
	case b.reqs <- req:
	case <-b.stopped:
		return nil, nil, false
	case <-ctx.Done():
		return nil, ctx.Err(), true
	case <-t.C:
		return nil, context.DeadlineExceeded, true
	}
	select {
	case r := <-req.done:
		return r.v, r.err, true
	case <-ctx.Done():
		return nil, ctx.Err(), true
	case <-t.C:
		req.abandoned.Store(true)
		return nil, context.DeadlineExceeded, true
	}
}

// lead sends a call from its caller, which holds a slot, together with
// the requests waiting now, and frees the slot. With none waiting, the
// call is made as it is: no request to hand over, nor channel to answer
// it on.
func (b *batcher) lead(ctx context.Context, s *redis.Script, keys []string, args []any) (v any, err error) {
	var waiting *batchReq
	if b.max > 1 {
		select {
		case waiting = <-b.reqs:
		default:
		}
	}
	if waiting != nil {
		req := &batchReq{ctx: ctx, s: s, keys: keys, args: args, done: make(chan batchRes, 1)}
		b.collect(req, waiting)
		<-b.slot
		res := <-req.done // collect answered it
		return res.v, res.err
	}
	if err = ctx.Err(); err == nil { // (as exec: a call whose caller left is not sent)
		v, err = b.one(ctx, s, keys, args)
	}
	<-b.slot
	return v, err
}

// lead1 sends req's batch from the caller, which holds a slot, and frees
// the slot.
func (b *batcher) lead1(req *batchReq) (any, error) {
	b.collect(req, nil)
	<-b.slot
	r := <-req.done // collect answered it
	return r.v, r.err
}

// timers holds stopped timers for do (since Go 1.23 Stop leaves no stale
// tick in a timer's channel, so Reset on a pooled timer is safe).
var timers = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

// stop makes later calls go straight to Redis.
func (b *batcher) stop() { b.once.Do(func() { close(b.stopped) }) }

// collect sends first, and second if not nil, together with the requests
// waiting now (up to max) and answers them all.
func (b *batcher) collect(first, second *batchReq) {
	bp := b.batches.Get().(*[]*batchReq)
	batch := append((*bp)[:0], first)
	if second != nil {
		batch = append(batch, second)
	}
more:
	for len(batch) < b.max {
		select {
		case r := <-b.reqs:
			batch = append(batch, r)
		default:
			break more
		}
	}
	b.exec(batch)
	clear(batch)
	*bp = batch[:0]
	b.batches.Put(bp)
}

// exec sends one batch as a pipeline and answers each request. Scripts
// missing from the server's cache (NOSCRIPT: Redis restarted, or SCRIPT
// FLUSH) are sent again with EVAL, which caches them.
func (b *batcher) exec(batch []*batchReq) {
	live := batch[:0]
	for _, r := range batch {
		if err := r.gone(); err != nil {
			r.done <- batchRes{err: err} // its caller left: do not act for it
			continue
		}
		live = append(live, r)
	}
	if len(live) == 0 {
		return
	}
	if groups := bySlotTag(b.rdb, live, firstKey); groups != nil {
		for _, g := range groups {
			b.execLive(g)
		}
		return
	}
	b.execLive(live)
}

// bySlotTag splits a batch for a Redis Cluster client by its calls' hash
// tags (a call's keys share one; key returns its first), so that a
// pipeline never spans slots: it goes straight to its slot's master
// (nodeFor). nil: one group will do.
func bySlotTag[T any](rdb redis.UniversalClient, live []T, key func(T) string) [][]T {
	if _, cluster := rdb.(*redis.ClusterClient); !cluster || len(live) < 2 {
		return nil
	}
	idx := map[string]int{}
	var groups [][]T
	for _, r := range live {
		tag := hashTag(key(r))
		i, ok := idx[tag]
		if !ok {
			i = len(groups)
			idx[tag] = i
			groups = append(groups, nil)
		}
		groups[i] = append(groups[i], r)
	}
	if len(groups) == 1 {
		return nil
	}
	return groups
}

// firstKey is a batched call's first key, which names its slot.
func firstKey(r *batchReq) string { return r.keys[0] }

// nodeFor is where a pipeline whose keys share key's hash slot is sent:
// on a Redis Cluster, straight to the slot's master, not through the
// Cluster client's pipeline, whose replies go-redis (v9.23.0) may read on
// two goroutines at once when a redirection meets a pipeline mid-read (a
// data race seen during slot migrations, even within one slot); a
// redirected call is then sent again alone through the Cluster client
// (pipeScripts). Elsewhere it is rdb itself.
func nodeFor(ctx context.Context, rdb redis.UniversalClient, key string) redis.UniversalClient {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return rdb
	}
	n, err := cc.MasterForKey(ctx, key)
	if err != nil {
		return rdb // (the calls then meet the same trouble alone)
	}
	return n
}

// hashTag is the part of key Redis Cluster hashes: the first {…} with
// something in it, else the whole key.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// execLive sends live requests (callers waiting) as one pipeline, or one
// call for one, and answers each (a failed dial ends either at once:
// reach.go).
func (b *batcher) execLive(live []*batchReq) {
	if len(live) == 1 {
		r := live[0]
		v, err := b.one(r.ctx, r.s, r.keys, r.args)
		r.done <- batchRes{v, err}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	w := b.watch.Enter(context.Background(), cancel)
	defer w.Leave(nil)
	pipeScripts(ctx, b.rdb, live, w.explain)
}

// one makes a lone call, bounded by timeout and ctx (its caller's alone:
// its cancellation counts), and ended at once by a failed dial.
func (b *batcher) one(ctx context.Context, s *redis.Script, keys []string, args []any) (any, error) {
	cctx, cancel := context.WithTimeout(ctx, b.timeout)
	w := b.watch.Enter(ctx, cancel)
	v, err := s.Run(cctx, b.rdb, keys, args...).Result()
	err = w.Leave(err)
	cancel()
	return v, err
}

// pipeScripts sends live, script calls whose keys share one hash slot, as
// one pipeline to the slot's node (nodeFor), bounded by ctx, and answers
// each on its done channel. A call whose slot moved or is moving (MOVED,
// ASK) is sent again alone through the Cluster client, which follows the
// redirection; scripts missing from the server's cache (NOSCRIPT: Redis
// restarted, or SCRIPT FLUSH) are sent again whole, with EVAL, which
// caches them. It does not look at the calls' own contexts. Each answer's
// error goes through explain (Watched.explain: the failed dial that ended
// ctx).
func pipeScripts(ctx context.Context, rdb redis.UniversalClient, live []*batchReq, explain func(error) error) {
	node := nodeFor(ctx, rdb, live[0].keys[0])
	cmds := make([]*redis.Cmd, len(live))
	pipe := node.Pipeline()
	for i, r := range live {
		cmds[i] = r.s.EvalSha(ctx, pipe, r.keys, r.args...)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	var retry []int
	for i, c := range cmds {
		switch err := c.Err(); {
		case err != nil && redis.HasErrorPrefix(err, "NOSCRIPT"):
			retry = append(retry, i)
		case err != nil && node != rdb && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK")):
			// The slot moved, or is moving: the Cluster client follows
			// the redirection (and learns the new slot map).
			r := live[i]
			v, err := r.s.Run(ctx, rdb, r.keys, r.args...).Result()
			r.done <- batchRes{v, explain(err)}
		default:
			live[i].done <- batchRes{c.Val(), explain(c.Err())}
		}
	}
	if len(retry) == 0 {
		return
	}
	pipe = node.Pipeline()
	for _, i := range retry {
		r := live[i]
		cmds[i] = r.s.Eval(ctx, pipe, r.keys, r.args...)
	}
	_, _ = pipe.Exec(ctx)
	for _, i := range retry {
		live[i].done <- batchRes{cmds[i].Val(), explain(cmds[i].Err())}
	}
}
