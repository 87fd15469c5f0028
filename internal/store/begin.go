package store

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Begins. Every attempt of a task locked at enqueue whose lock holds nothing
// else calls the begin script before its handler runs. A call's cost is
// mostly fixed (a round trip, a script run), so the begins of attempts that
// start at the same moment go in one call: each queue has a loop that sends
// one call at a time (a call's keys share the queue's slot), and every begin
// of the queue that arrived while a call was out goes in the next. A lone
// attempt waits for one round trip, as before; under load one call begins
// many. One queue's calls never wait for another's, so a Cluster master that
// hangs holds up only its own queues.
//
// Invariants: a request is handed over by an unbuffered send, so it is
// never queued where its loop will not see it; each request handed over is
// answered exactly once on its buffered channel; a request whose caller has
// gone before its call is sent is answered, not sent (its attempt's outcome
// stays known: it did not begin); after stop, begins go straight to Redis.

// maxBegins bounds the attempts of one begin call.
const maxBegins = 128

type beginReq struct {
	ctx  context.Context // the caller's: once done, the request is not sent
	keys [2]string
	args [4]any
	done chan beginRes // buffered: answering never blocks
}

type beginRes struct {
	ok  bool
	err error
}

// beginner holds a loop per queue.
type beginner struct {
	s       *Store
	mu      sync.Mutex
	queues  map[string]chan *beginReq // a loop's requests, by queue
	quit    chan struct{}
	stopped bool
	wg      sync.WaitGroup
}

func newBeginner(s *Store) *beginner {
	return &beginner{s: s, queues: map[string]chan *beginReq{}, quit: make(chan struct{})}
}

// begin runs the begin script for one attempt, with the others of its queue
// of the moment. It reports whether the attempt holds the lock.
func (b *beginner) begin(ctx context.Context, r *Ref, lock, follow, token string, lease time.Duration) (bool, error) {
	req := &beginReq{ctx: ctx, keys: [2]string{lock, follow}, args: [4]any{r.stored(), r.ID, token, ms(lease)}, done: make(chan beginRes, 1)}
	reqs := b.loopOf(r.Queue)
	if reqs == nil {
		return b.s.beginDirect(ctx, req)
	}
	select {
	case reqs <- req:
	case <-b.quit:
		return b.s.beginDirect(ctx, req)
	case <-ctx.Done():
		return false, ctx.Err()
	}
	select {
	case res := <-req.done:
		return res.ok, res.err
	case <-ctx.Done():
		// Not sent yet: it never will be. Sent: it may still land, and the
		// caller, not knowing, settles the attempt as given up.
		return false, ctx.Err()
	}
}

// loopOf returns the requests channel of queue's loop, starting it; nil
// after stop.
func (b *beginner) loopOf(queue string) chan *beginReq {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return nil
	}
	reqs, ok := b.queues[queue]
	if !ok {
		reqs = make(chan *beginReq)
		b.queues[queue] = reqs
		b.wg.Go(func() { b.loop(reqs) })
	}
	return reqs
}

func (b *beginner) loop(reqs chan *beginReq) {
	for {
		var first *beginReq
		select {
		case first = <-reqs:
		case <-b.quit:
			return
		}
		b.s.beginGroup(collect(reqs, first))
	}
}

// collect returns first and every request waiting now, up to maxBegins.
func collect(reqs chan *beginReq, first *beginReq) []*beginReq {
	batch := []*beginReq{first}
	for len(batch) < maxBegins {
		select {
		case r := <-reqs:
			batch = append(batch, r)
		default:
			return batch
		}
	}
	return batch
}

// stopLoop ends the loops and waits for them. Idempotent.
func (b *beginner) stopLoop() {
	b.mu.Lock()
	if !b.stopped {
		b.stopped = true
		close(b.quit)
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// beginGroup runs the begin script for one queue's requests and answers
// each; a request whose caller has gone is answered without being sent.
func (s *Store) beginGroup(all []*beginReq) {
	g := all[:0:0]
	for _, r := range all {
		if err := r.ctx.Err(); err != nil {
			r.done <- beginRes{err: err}
			continue
		}
		g = append(g, r)
	}
	if len(g) == 0 {
		return
	}
	keys := make([]string, 0, 2*len(g))
	args := make([]any, 0, 4*len(g))
	for _, r := range g {
		keys = append(keys, r.keys[:]...)
		args = append(args, r.args[:]...)
	}
	oks, err := s.runBegin(context.Background(), keys, args, len(g))
	for i, r := range g {
		if err != nil {
			r.done <- beginRes{err: err}
			continue
		}
		r.done <- beginRes{ok: oks[i]}
	}
}

// beginDirect runs the begin script for one request, alone.
func (s *Store) beginDirect(ctx context.Context, r *beginReq) (bool, error) {
	oks, err := s.runBegin(ctx, r.keys[:], r.args[:], 1)
	if err != nil {
		return false, err
	}
	return oks[0], nil
}

// runBegin runs the begin script and reads its reply for n attempts.
func (s *Store) runBegin(ctx context.Context, keys []string, args []any, n int) ([]bool, error) {
	v, err := s.run(ctx, s.sc.begin, keys, args...)
	if err != nil {
		return nil, err
	}
	a, ok := v.([]any)
	if !ok || len(a) != n {
		return nil, fmt.Errorf("dedup: unexpected begin reply %T (%d attempts)", v, n)
	}
	out := make([]bool, n)
	for i, e := range a {
		c, ok := e.(int64)
		if !ok || (c != 0 && c != 1) {
			return nil, fmt.Errorf("dedup: unexpected begin reply %v for attempt %d", e, i)
		}
		out[i] = c == 1
	}
	return out, nil
}
