package dedup

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Auto-pipelining. Under load most of Redis's time per lock call goes to
// reading, parsing and answering the request, not to the script: a plain
// asynq enqueue and a lock call each pay one socket read and one write on
// both sides. Lock calls made at the same moment by many goroutines are
// therefore sent together as one pipeline, so they share those costs. A call
// never waits for company: a free sender takes it at once, and only calls
// that arrive while every sender is busy are batched, so one goroutine alone
// sees plain single round trips while 64 see pipelines of tens of calls.
//
// Invariants: the senders are a fixed set of goroutines started by New and
// ended by Close (after Close, calls go straight to Redis); a call hands its
// request to a sender (an unbuffered send, so a request is never queued where
// no sender will see it) and waits for its reply or its own deadline,
// whichever comes first; a request whose caller has given up before its batch
// is sent is not sent.

// Batching defaults.
const (
	// DefaultMaxBatch is Config.MaxBatch's default.
	DefaultMaxBatch = 64
	// senders is how many pipelines may be in flight at once: enough to keep
	// Redis busy while replies travel, few enough that batches stay large.
	senders = 2
)

// batchReq is one script call waiting for a sender.
type batchReq struct {
	ctx  context.Context
	s    *redis.Script
	keys []string
	args []any
	done chan batchRes // buffered: a sender never blocks on an abandoned caller
}

type batchRes struct {
	v   any
	err error
}

type batcher struct {
	rdb     redis.UniversalClient
	max     int
	timeout time.Duration // bounds each pipeline
	reqs    chan *batchReq
	stopped chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
}

func newBatcher(rdb redis.UniversalClient, max int, timeout time.Duration) *batcher {
	b := &batcher{rdb: rdb, max: max, timeout: timeout, reqs: make(chan *batchReq), stopped: make(chan struct{})}
	b.wg.Add(senders)
	for range senders {
		go b.send()
	}
	return b
}

// do runs s through a sender. ok is false when the batcher is stopped: the
// caller must then make the call itself.
func (b *batcher) do(ctx context.Context, s *redis.Script, keys []string, args []any) (v any, err error, ok bool) {
	req := &batchReq{ctx: ctx, s: s, keys: keys, args: args, done: make(chan batchRes, 1)}
	select {
	case b.reqs <- req:
	case <-b.stopped:
		return nil, nil, false
	case <-ctx.Done():
		return nil, ctx.Err(), true
	}
	select {
	case r := <-req.done:
		return r.v, r.err, true
	case <-ctx.Done():
		return nil, ctx.Err(), true
	}
}

// stop ends the senders after they have answered every request handed over.
func (b *batcher) stop() {
	b.once.Do(func() { close(b.stopped) })
	b.wg.Wait()
}

func (b *batcher) send() {
	defer b.wg.Done()
	batch := make([]*batchReq, 0, b.max)
	for {
		select {
		case r := <-b.reqs:
			batch = append(batch[:0], r)
		case <-b.stopped:
			return
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
	}
}

// exec sends one batch as a pipeline and answers each request. Scripts
// missing from the server's cache (NOSCRIPT: Redis restarted or SCRIPT
// FLUSH) are sent again with EVAL, which caches them.
func (b *batcher) exec(batch []*batchReq) {
	live := batch[:0:0]
	for _, r := range batch {
		if err := r.ctx.Err(); err != nil {
			r.done <- batchRes{err: err} // its caller has given up: don't act for it
			continue
		}
		live = append(live, r)
	}
	if len(live) == 0 {
		return
	}
	if len(live) == 1 {
		r := live[0]
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.ctx), b.timeout)
		v, err := r.s.Run(ctx, b.rdb, r.keys, r.args...).Result()
		cancel()
		r.done <- batchRes{v, err}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	cmds := make([]*redis.Cmd, len(live))
	pipe := b.rdb.Pipeline()
	for i, r := range live {
		cmds[i] = r.s.EvalSha(ctx, pipe, r.keys, r.args...)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	var retry []int
	for i, c := range cmds {
		if err := c.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry = append(retry, i)
			continue
		}
		live[i].done <- batchRes{c.Val(), c.Err()}
	}
	if len(retry) == 0 {
		return
	}
	pipe = b.rdb.Pipeline()
	for _, i := range retry {
		r := live[i]
		cmds[i] = r.s.Eval(ctx, pipe, r.keys, r.args...)
	}
	_, _ = pipe.Exec(ctx)
	for _, i := range retry {
		live[i].done <- batchRes{cmds[i].Val(), cmds[i].Err()}
	}
}
