package store

import (
	"context"
	"errors"
	"sync"

	"github.com/redis/go-redis/v9"
)

// AcquireOutcome is one Acquire's answer in AcquireAll: what Acquire would
// have returned for it.
type AcquireOutcome struct {
	AcquireResult       // with Err: only Sent holds
	Err           error // Acquire's error
}

// maxAcquirePipeline bounds the calls of one AcquireAll pipeline: a node's
// larger share of a round is sent as several pipelines, one after another,
// in order, each bounded by LockTimeout on its own.
const maxAcquirePipeline = 1000

// AcquireAll runs many Acquires, each exactly as Acquire does (the same
// calls, answers and errors), but with their calls pipelined. The calls go
// in rounds: a round sends the next call of every Acquire not yet answered,
// in one pipeline per node (on Redis Cluster, one per hash slot, that is
// per queue, sent straight to the slot's master; at most maxAcquirePipeline
// calls each), through that node's circuit breaker, bounded by LockTimeout
// and ctx; the nodes' pipelines go concurrently. An Acquire whose reply
// asks for another call (the script wants more keys, or found the key
// free after a hint said held) makes it in the next round. A round trip per node answers a batch of new keys.
//
// Calls of one lock are sent in the order of as, so of two Acquires of one
// key the first takes it and the second meets it held. (Only where the
// first needs another call and the second does not is the second answered
// first.) Client.EnqueueBatch relies on none of this: it never gives one
// AcquireAll two Acquires of one key or one caller-chosen task ID. A call
// whose pipeline failed after it was sent reports Sent as Acquire does. It
// returns one outcome per Acquire, in order.
func (s *Store) AcquireAll(ctx context.Context, as []*Acquire) []AcquireOutcome {
	out := make([]AcquireOutcome, len(as))
	steps := make([]acquireStep, len(as))
	pending := make([]int, len(as))
	for i, a := range as {
		steps[i] = s.newAcquireStep(a)
		pending[i] = i
	}
	for len(pending) > 0 {
		pending = s.acquireRound(ctx, as, steps, pending, out)
	}
	return out
}

// acquireCall is one step's call in a round, and its answer.
type acquireCall struct {
	req  batchReq
	res  batchRes
	sent bool // it may have reached Redis
}

// acquireRound sends the next call of the Acquires idx (pipelined per node),
// writes the outcome of those answered to out and returns the others.
func (s *Store) acquireRound(ctx context.Context, as []*Acquire, steps []acquireStep, idx []int, out []AcquireOutcome) []int {
	calls := make([]acquireCall, len(idx))
	groups := map[*shard][]int{} // positions in calls, in order
	for j, i := range idx {
		sc, keys, args := steps[i].next(s, as[i])
		calls[j].req = batchReq{ctx: ctx, s: sc, keys: keys, args: args, done: make(chan batchRes, 1)}
		sh := s.sh.forKey(ctx, keys[0])
		groups[sh] = append(groups[sh], j)
	}
	eachGroup(groups, func(g []int) { s.acquireGroup(ctx, calls, g) })
	var more []int
	for j, i := range idx {
		c := &calls[j]
		res, again, err := steps[i].read(s, as[i], c.res.v, c.res.err)
		if again {
			more = append(more, i)
			continue
		}
		res.Sent = res.Sent && c.sent
		out[i] = AcquireOutcome{AcquireResult: res, Err: err}
	}
	return more
}

// acquireGroup sends the calls g of one node: a pipeline per hash slot
// (bySlotTag), and per maxAcquirePipeline calls.
func (s *Store) acquireGroup(ctx context.Context, calls []acquireCall, g []int) {
	sh := s.sh.forKey(ctx, calls[g[0]].req.keys[0])
	mine := make([]*acquireCall, len(g))
	for j, i := range g {
		mine[j] = &calls[i]
	}
	parts := bySlotTag(s.Client(), mine, func(c *acquireCall) string { return c.req.keys[0] })
	if parts == nil {
		parts = [][]*acquireCall{mine}
	}
	for _, part := range parts {
		for len(part) > 0 {
			n := min(len(part), maxAcquirePipeline)
			s.acquirePipeline(ctx, sh, part[:n])
			part = part[n:]
		}
	}
}

// acquirePipeline sends calls as one pipeline through sh's breaker,
// bounded by LockTimeout and ctx, and records each call's answer. A
// pipeline left at the deadline answers every call with the deadline's
// error (its replies may still come, unread); one the breaker refused, or
// that ctx ended before it was sent, was not sent.
func (s *Store) acquirePipeline(ctx context.Context, sh *shard, calls []*acquireCall) {
	if err := ctx.Err(); err != nil {
		for _, c := range calls {
			c.res = batchRes{err: err}
		}
		return
	}
	live := make([]*batchReq, len(calls))
	for j, c := range calls {
		live[j] = &c.req
	}
	v, err := s.guard(ctx, sh, func() (any, error) {
		return s.watched(ctx, func(c context.Context, w Watched) (any, error) {
			pipeScripts(c, s.Client(), live, w.explain)
			rs := make([]batchRes, len(live))
			for j, r := range live {
				rs[j] = <-r.done // (pipeScripts answered every call)
			}
			return rs, pipeFault(rs)
		})
	})
	rs, _ := v.([]batchRes)
	sent := !errors.Is(err, s.cfg.ErrCircuitOpen) && !Unreached(err)
	for j, c := range calls {
		if rs != nil {
			c.res, c.sent = rs[j], true
			continue
		}
		c.res, c.sent = batchRes{err: err}, sent
	}
}

// pipeFault is the first failure among a pipeline's answers that was not
// Redis's own reply (for the breaker: a reply proves Redis up), or nil.
func pipeFault(rs []batchRes) error {
	for _, r := range rs {
		if r.err != nil && !errors.Is(r.err, redis.Nil) && !isReply(r.err) {
			return r.err
		}
	}
	return nil
}

// eachGroup calls do for every group, concurrently when there are several
// (so that one node's slow call delays only its own group), and returns
// when all are done.
func eachGroup[K comparable](groups map[K][]int, do func(idx []int)) {
	if len(groups) == 1 {
		for _, idx := range groups {
			do(idx)
		}
		return
	}
	var wg sync.WaitGroup
	for _, idx := range groups {
		wg.Go(func() { do(idx) })
	}
	wg.Wait()
}
