package dedup

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// BatchResult is one task's answer in Client.EnqueueBatch: the Result and
// the error Client.Submit would have returned for it alone (a rejected
// task's Err is a *DuplicateTaskError naming the holder).
type BatchResult struct {
	Result       // zero when Err is set
	Err    error // nil, or the task's error as Submit returns it
}

// batchWorkers bounds the tasks of one EnqueueBatch whose steps after the
// pipelined acquire run at once (an asynq enqueue, a merge, a wait for a
// holder being stored).
const batchWorkers = 16

// EnqueueBatch enqueues many tasks, each exactly as Submit would (the same
// keys, policies, outcomes, errors, events), with opts applied to every
// task over its own asynq.NewTask options. It returns one BatchResult per
// task, in order; nil for no tasks.
//
// Each task stands alone: it is created with its lock, folded into the
// key's task (Replace, Merge, Defer), rejected with its holder, or given an
// error, never left half done; bad input for one task (nil, a blank type,
// an invalid option, a payload its key cannot be taken from) gives that
// task an error and locks nothing, and the others go on. The batch is not
// atomic as a whole. Two tasks of one key are answered in order: the first
// takes the key, the later one meets it as its holder (rejected, or folded
// by its policy).
//
// The lock calls are pipelined: one pipeline per Redis node (on Redis
// Cluster, one per queue, sent straight to its slot's master), each
// through the node's circuit breaker and bounded by Config.LockTimeout, at
// most 1,000 calls each (a larger batch sends several, in order). On the
// direct path (NewClient, tasks without asynq's own NewTask options) the
// lock call stores the task too, so a batch of new keys costs one round
// trip per node (plus, once per process, registering each new queue). A
// call that needs another (a key whose holder this process has not met
// yet) makes it in a second pipelined round. What needs more calls after
// that takes them as Submit does, up to 16 tasks at once, the tasks of one
// key one after another, in order: asynq's enqueue (through WrapClient's
// Enqueuer, or of a task with asynq's own NewTask options), a Merge's
// compare-and-set, a wait for a holder not stored yet or for room
// (MaxPending).
//
// A ctx already done gives every task its error (not ErrUnavailable); one
// that ends during the batch ends the calls not yet made. With Redis
// unreachable each task fails or, with Config.FailOpen, is enqueued
// without a lock, as Submit would. It is safe for concurrent use.
func (c *Client) EnqueueBatch(ctx context.Context, tasks []*asynq.Task, opts ...asynq.Option) []BatchResult {
	if len(tasks) == 0 {
		return nil
	}
	out := make([]BatchResult, len(tasks))
	if err := ctx.Err(); err != nil {
		for i, t := range tasks {
			out[i].Err = fmt.Errorf("dedup: enqueue %q: %w", typeOf(t), err)
		}
		return out
	}
	calls := make([]batchCall, len(tasks))
	var acquires []*store.Acquire
	for i, t := range tasks {
		bc := &calls[i]
		bc.locks, bc.err = c.begin(ctx, &bc.k, t, opts)
		if bc.err == nil && bc.locks {
			acquires = append(acquires, &bc.k.acquire)
		}
	}
	if len(acquires) > 0 {
		firsts := c.d.store.AcquireAll(ctx, acquires)
		for i := range calls {
			if bc := &calls[i]; bc.err == nil && bc.locks {
				bc.first, firsts = firsts[0], firsts[1:]
			}
		}
	}
	c.settleBatch(ctx, calls, out)
	return out
}

// batchCall is one task of a batch.
type batchCall struct {
	k     call
	err   error // from begin: the task's answer
	locks bool  // deduplicated: its first acquire went in the batch's pipelines
	first store.AcquireOutcome
}

// settleBatch runs every task's steps after the pipelined acquire and
// writes its answer to out: concurrently (batchWorkers at once), but
// those of one lock in order.
func (c *Client) settleBatch(ctx context.Context, calls []batchCall, out []BatchResult) {
	keys := make([]string, len(calls))
	for i := range calls {
		if bc := &calls[i]; bc.err == nil && bc.locks {
			keys[i] = c.d.lockKey(&bc.k.ref)
		}
	}
	inOrder(keys, batchWorkers, func(i int) {
		res, err := c.settle(ctx, &calls[i])
		out[i] = BatchResult{Result: res, Err: err}
	})
}

// settle finishes one task of a batch, as Submit does after begin.
func (c *Client) settle(ctx context.Context, bc *batchCall) (Result, error) {
	k := &bc.k
	switch {
	case bc.err != nil:
		return Result{}, bc.err
	case !bc.locks:
		return c.enqueueUnlocked(ctx, k)
	}
	var w waits
	res, n, err := c.acquired(ctx, k, bc.first.AcquireResult, bc.first.Err, &w)
	if n == again {
		res, n, err = c.relock(ctx, k, &w)
	}
	return c.complete(ctx, k, res, n, err)
}

// inOrder calls do(i) for every index of keys: those of one non-empty key
// one after another, in order; the others concurrently, at most limit at
// once. It returns when every call has.
func inOrder(keys []string, limit int, do func(i int)) {
	chains := make([][]int, 0, len(keys))
	at := make(map[string]int, len(keys))
	for i, key := range keys {
		if j, ok := at[key]; ok && key != "" {
			chains[j] = append(chains[j], i)
			continue
		}
		if key != "" {
			at[key] = len(chains)
		}
		chains = append(chains, []int{i})
	}
	var next atomic.Int64
	work := func() {
		for j := int(next.Add(1) - 1); j < len(chains); j = int(next.Add(1) - 1) {
			for _, i := range chains[j] {
				do(i)
			}
		}
	}
	var wg sync.WaitGroup
	for range min(limit, len(chains)) - 1 {
		wg.Go(work)
	}
	work() // (the caller's goroutine is one of the workers)
	wg.Wait()
}

// typeOf is a task's type, "" for a nil task.
func typeOf(t *asynq.Task) string {
	if t == nil {
		return ""
	}
	return t.Type()
}
