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
// start at the same moment go in one call: a beginner sends one call at a
// time, and every begin that arrived while a call was out goes in the next
// (one per queue: a call's keys share a slot). A lone attempt waits for one
// round trip, as before; under load one call begins tens.
//
// Invariants: a request is handed over by an unbuffered send, so it is
// never queued where the loop will not see it; each request handed over is
// answered exactly once on its buffered channel; after stop, begins go
// straight to Redis.

// maxBegins bounds the attempts of one begin call.
const maxBegins = 128

type beginReq struct {
	queue string
	keys  [2]string
	args  [4]any
	done  chan beginRes // buffered: answering never blocks
}

type beginRes struct {
	ok  bool
	err error
}

type beginner struct {
	s    *Store
	reqs chan *beginReq
	quit chan struct{}
	done chan struct{}
	once sync.Once
	stop sync.Once
}

func newBeginner(s *Store) *beginner {
	return &beginner{s: s, reqs: make(chan *beginReq), quit: make(chan struct{}), done: make(chan struct{})}
}

// begin runs the begin script for one attempt, with the others of the
// moment. It reports whether the attempt holds the lock.
func (b *beginner) begin(ctx context.Context, r *Ref, lock, follow, token string, lease time.Duration) (bool, error) {
	req := &beginReq{queue: r.Queue, keys: [2]string{lock, follow}, args: [4]any{r.stored(), r.ID, token, ms(lease)}, done: make(chan beginRes, 1)}
	b.once.Do(func() { go b.loop() })
	select {
	case b.reqs <- req:
	case <-b.quit:
		return b.s.beginDirect(ctx, req)
	case <-ctx.Done():
		return false, ctx.Err()
	}
	select {
	case res := <-req.done:
		return res.ok, res.err
	case <-ctx.Done():
		return false, ctx.Err() // (its begin may still land: the attempt's retry replaces its token)
	}
}

func (b *beginner) loop() {
	defer close(b.done)
	for {
		var first *beginReq
		select {
		case first = <-b.reqs:
		case <-b.quit:
			return
		}
		b.send(b.collect(first))
	}
}

// collect returns first and every request waiting now, up to maxBegins.
func (b *beginner) collect(first *beginReq) []*beginReq {
	batch := []*beginReq{first}
	for len(batch) < maxBegins {
		select {
		case r := <-b.reqs:
			batch = append(batch, r)
		default:
			return batch
		}
	}
	return batch
}

// send makes one begin call per queue of batch, concurrently, and answers
// every request.
func (b *beginner) send(batch []*beginReq) {
	groups := map[string][]*beginReq{}
	for _, r := range batch {
		groups[r.queue] = append(groups[r.queue], r)
	}
	var wg sync.WaitGroup
	for _, g := range groups {
		if len(groups) == 1 {
			b.s.beginGroup(g)
			break
		}
		wg.Go(func() { b.s.beginGroup(g) })
	}
	wg.Wait()
}

// stopLoop ends the loop and waits for it. Idempotent.
func (b *beginner) stopLoop() {
	b.stop.Do(func() { close(b.quit) })
	b.once.Do(func() { close(b.done) }) // never started: it never will, and there is nothing to wait for
	<-b.done
}

// beginGroup runs the begin script for one queue's requests and answers
// each.
func (s *Store) beginGroup(g []*beginReq) {
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
