package dedup

import (
	"context"
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
// atomic as a whole.
//
// Tasks that share a lock key or a caller-chosen task ID (asynq.TaskID,
// deduplicated or not), directly or through other tasks of the batch, form
// a group, answered in batch order as Submits one after the other would
// answer them: only the group's first task is sent with the others; each
// later one is sent, as Submit sends it, once every earlier task of its
// group is answered. So of two tasks of one key the first takes it and the
// later one meets it as its holder (rejected, or folded by its policy);
// of two tasks of one ID the later one gets asynq.ErrTaskIDConflict.
//
// The lock calls of the groups' first tasks are pipelined: one pipeline
// per Redis node (on Redis Cluster, one per queue, sent straight to its
// slot's master), each through the node's circuit breaker and bounded by
// Config.LockTimeout, at most 1,000 calls each (a larger batch sends
// several, in order). On the direct path (NewClient, tasks without asynq's
// own NewTask options) the lock call stores the task too, so a batch of
// new keys costs one round trip per node (plus, once per process,
// registering each new queue). A call that needs another (a key whose
// holder this process has not met yet) makes it in a second pipelined
// round. What needs more calls after that takes them as Submit does, up to
// 16 groups at once: asynq's enqueue (through WrapClient's Enqueuer, or of
// a task with asynq's own NewTask options), a Merge's compare-and-set, a
// wait for a holder not stored yet or for room (MaxPending).
//
// A WrapClient that has not yet found where its Enqueuer stores tasks
// answers the batch's first deduplicated task alone first, as the first
// Submit would be answered; if that task landed in another Redis, every
// other deduplicated task gets ErrTasksElsewhere, as its Submit would.
//
// Config.OnDecision is called on the goroutine that called EnqueueBatch,
// never twice at once: the steps that can decide (a lock call's answer, a
// Merge, a wait) then run there, one at a time, while asynq's enqueues go
// on concurrently. A panic in a task's steps (a MergeFunc, a KeyFunc, the
// Enqueuer) ends that task's group; the other groups are answered, and
// then the panic is raised again on the caller's goroutine, as Submit
// would let it reach its caller.
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
			out[i].Err = errorf("dedup: enqueue %q: %w", typeOf(t), err)
		}
		return out
	}
	b := &batch{c: c, ctx: ctx, calls: make([]batchCall, len(tasks)), out: out}
	for i, t := range tasks {
		bc := &b.calls[i]
		bc.locks, bc.err = c.begin(ctx, &bc.k, t, opts)
	}
	groups := b.groups()
	b.checkPlacement(groups)
	b.acquireFirsts(groups)
	b.settleGroups(groups)
	return out
}

// batch is one EnqueueBatch call.
type batch struct {
	c     *Client
	ctx   context.Context
	calls []batchCall
	out   []BatchResult

	steps chan batchStep // to the caller's goroutine (serve); nil: steps run where they are

	panicOnce sync.Once
	panicked  bool
	panicVal  any
}

// batchCall is one task of a batch.
type batchCall struct {
	k        call
	err      error // from begin: the task's answer
	locks    bool  // deduplicated
	piped    bool  // its first acquire went in the batch's pipelines: first holds its answer
	answered bool  // out holds its answer already (checkPlacement)
	first    store.AcquireOutcome
}

// batchStep is a step a worker hands to the caller's goroutine (f), and
// where it hears that the step ended (a panic in f, or nil). A step
// without f says that a worker has ended.
type batchStep struct {
	f    func()
	done chan any
}

// groups partitions the tasks into groups, each in batch order, the groups
// in the order of their first tasks: the tasks that share a lock key or a
// caller-chosen task ID, directly or through others, are one group.
func (b *batch) groups() [][]int {
	parent := make([]int, len(b.calls))
	root := func(i int) int {
		for parent[i] != i {
			parent[i] = parent[parent[i]]
			i = parent[i]
		}
		return i
	}
	owner := make(map[string]int, len(b.calls))
	for i := range b.calls {
		parent[i] = i
		for _, id := range b.conflictIDs(i) {
			j, seen := owner[id]
			if !seen {
				owner[id] = i
				continue
			}
			if ri, rj := root(i), root(j); ri != rj {
				parent[max(ri, rj)] = min(ri, rj) // a group's root is its first task
			}
		}
	}
	var groups [][]int
	at := make(map[int]int, len(b.calls))
	for i := range b.calls {
		r := root(i)
		g, ok := at[r]
		if !ok {
			g = len(groups)
			at[r] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups
}

// conflictIDs are what task i cannot share with another task of the batch
// without the two being answered one after the other: its lock key, its
// caller-chosen task ID. None for a task begin answered.
func (b *batch) conflictIDs(i int) []string {
	bc := &b.calls[i]
	if bc.err != nil {
		return nil
	}
	var ids []string
	if bc.locks {
		ids = append(ids, "key\x00"+b.c.d.lockKey(&bc.k.ref))
	}
	if bc.k.callerID != "" {
		ids = append(ids, "id\x00"+bc.k.callerID)
	}
	return ids
}

// checkPlacement answers, while the Client has not found yet whether its
// Enqueuer stores tasks in the Dedup's Redis (placement.go), the batch's
// first deduplicated task alone, as the first of Submits one after the
// other would be, so that its enqueue is probed; if its task was found in
// another Redis, every other deduplicated task is refused, as begin would
// refuse it.
func (b *batch) checkPlacement(groups [][]int) {
	c := b.c
	if c.place.state.Load() != placeUnknown {
		return
	}
	for _, g := range groups {
		if bc := &b.calls[g[0]]; bc.err == nil && bc.locks {
			b.settle(g[0])
			bc.answered = true
			break
		}
	}
	if err := c.place.refused(); err != nil {
		for i := range b.calls {
			if bc := &b.calls[i]; bc.err == nil && bc.locks && !bc.answered {
				bc.err, bc.locks = err, false
			}
		}
	}
}

// acquireFirsts sends the first acquire of every group's first task, if
// deduplicated and not answered yet, in the batch's pipelines.
func (b *batch) acquireFirsts(groups [][]int) {
	var acquires []*store.Acquire
	var piped []*batchCall
	for _, g := range groups {
		if bc := &b.calls[g[0]]; bc.err == nil && bc.locks && !bc.answered {
			acquires = append(acquires, &bc.k.acquire)
			piped = append(piped, bc)
		}
	}
	if len(acquires) == 0 {
		return
	}
	for j, o := range b.c.d.store.AcquireAll(b.ctx, acquires) {
		piped[j].first, piped[j].piped = o, true
	}
}

// settleGroups answers every task not answered yet: the groups
// concurrently (batchWorkers at once), the tasks of a group one after
// another, in order. With Config.OnDecision set, the caller's goroutine
// runs the steps that can call it (serve). A panic in a group is raised
// again here once every group has ended.
func (b *batch) settleGroups(groups [][]int) {
	var next atomic.Int64
	work := func() {
		for j := int(next.Add(1) - 1); j < len(groups); j = int(next.Add(1) - 1) {
			b.settleGroup(groups[j])
		}
	}
	n := min(batchWorkers, len(groups))
	if b.c.d.cfg.OnDecision != nil {
		b.steps = make(chan batchStep)
		for range n {
			go func() {
				defer func() { b.steps <- batchStep{} }()
				work()
			}()
		}
		b.serve(n)
	} else {
		var wg sync.WaitGroup
		for range n - 1 {
			wg.Go(work)
		}
		work() // (the caller's goroutine is one of the workers)
		wg.Wait()
	}
	if b.panicked {
		panic(b.panicVal)
	}
}

// settleGroup answers the tasks of one group, in order. A panic ends the
// group (its later tasks were not sent: nothing of theirs is half done)
// and is kept for the caller.
func (b *batch) settleGroup(g []int) {
	defer func() {
		if p := recover(); p != nil {
			b.panicOnce.Do(func() { b.panicked, b.panicVal = true, p })
		}
	}()
	for _, i := range g {
		if !b.calls[i].answered {
			b.settle(i)
		}
	}
}

// serve runs, on the caller's goroutine, the steps the workers hand it,
// until all n workers have ended.
func (b *batch) serve(n int) {
	for n > 0 {
		s := <-b.steps
		if s.f == nil {
			n--
			continue
		}
		s.done <- catch(s.f)
	}
}

// catch runs f and returns what it panicked with, or nil.
func catch(f func()) (p any) {
	defer func() { p = recover() }()
	f()
	return nil
}

// onCaller runs f, a step that can call Config.OnDecision: on the caller's
// goroutine if the batch has it serve, else here. A panic in f is raised
// again here.
func (b *batch) onCaller(f func()) {
	if b.steps == nil {
		f()
		return
	}
	done := make(chan any, 1)
	b.steps <- batchStep{f: f, done: done}
	if p := <-done; p != nil {
		panic(p)
	}
}

// settle answers task i, as Submit does after begin, and writes the answer
// to out.
func (b *batch) settle(i int) {
	res, err := b.answer(&b.calls[i])
	b.out[i] = BatchResult{Result: res, Err: err}
}

// answer is a task's Result and error: from its pipelined first acquire,
// or, for a task not piped, from its own lock calls, as Submit makes them.
func (b *batch) answer(bc *batchCall) (Result, error) {
	c, ctx, k := b.c, b.ctx, &bc.k
	switch {
	case bc.err != nil:
		return Result{}, bc.err
	case !bc.locks:
		return c.enqueueUnlocked(ctx, k)
	case !bc.piped:
		if err := c.place.refused(); err != nil { // as begin, for a Submit made now
			return Result{}, err
		}
	}
	var (
		res Result
		n   next
		err error
	)
	step := func() {
		if !bc.piped {
			res, n, err = c.lock(ctx, k)
			return
		}
		var w waits
		res, n, err = c.acquired(ctx, k, bc.first.AcquireResult, bc.first.Err, &w)
		if n == again {
			res, n, err = c.relock(ctx, k, &w)
		}
	}
	if bc.piped && bc.first.Err != nil {
		step() // a failed call decides nothing (acquireFailed): its look-ups need not wait their turn
	} else {
		b.onCaller(step)
	}
	return c.complete(ctx, k, res, n, err)
}

// typeOf is a task's type, "" for a nil task.
func typeOf(t *asynq.Task) string {
	if t == nil {
		return ""
	}
	return t.Type()
}
