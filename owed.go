package dedup

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// owedSignal lets a RunningDefer attempt succeed with no Redis call when
// no follow-up is owed to its key. acquire.lua publishes a running holder's
// ID on the prefix's owed channel (store.Keys.Owed) as it makes it a
// follow-up; one subscriber per Dedup listens. An attempt whose handler
// began with the subscription up for owedLookback, which is still up in
// the same generation, and for which no message came, ends with no call:
// asynq's done releases its key. Every other attempt settles as before.
//
// A message that arrives just after such a quiet end (the follow-up was
// made after the handler returned, before asynq's done) is settled by the
// subscriber, for quietLife, once asynq's done has released the lock
// (store.Settle.Late). Should the subscription drop, the quiet ends of the
// last moments (since the last proof that it was alive) are settled again,
// in case their message was lost (sweep). Quiet ends are known by task ID:
// a later attempt of the task that begins here drops its quiet end, and a
// late settle waits while the lock names the task, whatever attempt holds it.
type owedSignal struct {
	d        *Dedup
	channel  string
	interval time.Duration // a silent subscription is pinged after this long

	mu        sync.Mutex
	up        bool                  // the subscription is confirmed
	gen       uint64                // bumped at every (re)subscribe and every loss
	alive     time.Time             // when the subscription last proved alive (confirmed, pong)
	since     time.Time             // when the current generation was confirmed
	running   map[string]*owedEntry // watched attempts, by task ID
	recent    map[string]time.Time  // messages for IDs not running here (yet): asynq marks a task active before the middleware sees it
	recentAt  []quietOrder          // recent's entries, oldest first, for pruning
	quiet     map[string]quietEnd   // attempts that ended with no call, by task ID
	order     []quietOrder          // quiet's entries, oldest first, for pruning
	started   bool
	quit      chan struct{}
	done      chan struct{}
	wg        sync.WaitGroup // sweeps under way
	subscribe func(ctx context.Context) *redis.PubSub
}

// owedEntry is what the subscriber knows of a task running here.
type owedEntry struct {
	n    int  // its attempts running here (a given-up handler may run beside its retry)
	owed bool // a follow-up was made of it
}

// quietEnd is an attempt that succeeded with no call.
type quietEnd struct {
	ref store.Ref
	ttl time.Duration
	at  time.Time
}

// quietOrder is one entry of quiet, in the order they were made.
type quietOrder struct {
	id string
	at time.Time
}

const (
	// owedPing is how long a silent subscription waits before it is pinged;
	// an unanswered ping within as long again remakes it.
	owedPing = 2 * time.Second
	// quietLife is how long a quiet end is remembered: an owed message for
	// it settles it; a message later than that is not expected (it would
	// need asynq's done to lag that long behind the handler's return). It
	// covers the sweep's reach too (at most about 3 owedPing). Memory: one
	// entry (about 200 B) per quiet success of that long.
	quietLife = 8 * time.Second
	// owedLookback is how long the subscription must have been up, unbroken,
	// when an attempt's handler begins for its success to end quietly: asynq
	// marks a task active (and an enqueue may make it a follow-up, publishing
	// then) before the middleware sees it, so a drop just before the handler
	// began may have lost its message. (A handler that begins later than
	// that after asynq took its task, behind a slower middleware, across a
	// drop, is not covered.)
	owedLookback = 2 * time.Second
	// recentLife is how long a message for a task not running here is kept,
	// for an attempt whose handler has not begun yet (messages are few: one
	// per follow-up made).
	recentLife = 5 * time.Minute
)

func newOwedSignal(d *Dedup, rdb redis.UniversalClient) *owedSignal {
	o := &owedSignal{d: d, channel: d.store.Keys().Owed(), interval: owedPing,
		running: map[string]*owedEntry{}, recent: map[string]time.Time{}, quiet: map[string]quietEnd{},
		quit: make(chan struct{}), done: make(chan struct{})}
	o.subscribe = func(ctx context.Context) *redis.PubSub { return rdb.Subscribe(ctx, o.channel) }
	return o
}

// run starts the subscriber once; later calls, and calls after stop, do
// nothing.
func (o *owedSignal) run() {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case <-o.quit:
		return
	default:
	}
	if !o.started {
		o.started = true
		go o.loop()
	}
}

// stop ends the subscriber and waits for it and its sweeps. Idempotent.
func (o *owedSignal) stop() {
	o.mu.Lock()
	select {
	case <-o.quit:
	default:
		close(o.quit)
	}
	o.up = false // (no attempt ends quietly after Close: no message would be heard)
	o.gen++
	started := o.started
	o.mu.Unlock()
	if started {
		<-o.done
	}
	o.wg.Wait()
}

func (o *owedSignal) loop() {
	defer close(o.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-o.quit:
			cancel()
		case <-ctx.Done():
		}
	}()
	for i := 0; ; i++ {
		if o.listen(ctx) {
			i = 0
		}
		if ctx.Err() != nil { // (Close: no attempt ends quietly after it)
			return
		}
		o.lost(ctx)
		t := time.NewTimer(owedBackoff.delay(i))
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
}

// owedBackoff paces the remaking of a subscription that keeps failing.
var owedBackoff = backoff{Min: 10 * time.Millisecond, Max: 2 * time.Second}

// listen subscribes and receives until the subscription fails or ctx
// ends; it reports whether the subscription was confirmed.
func (o *owedSignal) listen(ctx context.Context) (confirmed bool) {
	ps := o.subscribe(ctx)
	defer ps.Close()
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() }) // (a read under way does not watch ctx)
	defer stop()
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(ctx, o.interval)
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind != "subscribe" {
				break
			}
			if confirmed { // go-redis reconnected under it: messages may be lost meanwhile
				o.lost(ctx)
			}
			confirmed = true
			o.confirmed(true)
		case *redis.Message:
			o.confirmed(false)
			o.arrived(ctx, m.Payload)
		case *redis.Pong:
			pinged = false
			o.confirmed(false)
		}
		var ne net.Error
		switch {
		case ctx.Err() != nil:
			return confirmed
		case err == nil:
		case errors.As(err, &ne) && ne.Timeout() && !pinged:
			if ps.Ping(ctx) != nil {
				return confirmed
			}
			pinged = true
		default: // a receive error, or a ping unanswered: the connection is not trusted
			return confirmed
		}
	}
}

// confirmed records a proof that the subscription is alive; sub: a
// (re)subscribe, which starts a generation.
func (o *owedSignal) confirmed(sub bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.alive = time.Now()
	if sub {
		o.up = true
		o.gen++
		o.since = o.alive
	}
}

// lost marks the subscription down (a new generation) and settles again
// the quiet ends since it last proved alive: their message may be lost.
func (o *owedSignal) lost(ctx context.Context) {
	o.mu.Lock()
	was := o.up
	o.up = false
	o.gen++
	from := o.alive.Add(-o.interval)
	var ends []quietEnd
	for id, q := range o.quiet {
		if q.at.After(from) {
			ends = append(ends, q)
			delete(o.quiet, id)
		}
	}
	o.mu.Unlock()
	if was {
		o.d.log.Warn("dedup: the owed-follow-up subscription dropped; RunningDefer successes call Redis until it is back", slog.String("channel", o.channel), slog.Int("rechecked", len(ends)))
	}
	if len(ends) == 0 {
		return
	}
	o.wg.Go(func() { o.sweep(context.WithoutCancel(ctx), ends) })
}

// sweep settles the given quiet ends, as many at once as the heartbeat
// reads locks.
func (o *owedSignal) sweep(ctx context.Context, ends []quietEnd) {
	slots := make(chan struct{}, lookupConcurrency)
	var wg sync.WaitGroup
	for _, q := range ends {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			o.settle(ctx, q)
		})
	}
	wg.Wait()
}

// arrived handles an owed message for task id: a quiet end is settled
// now; a running attempt will call at its end; any other is kept a while,
// for an attempt about to start.
func (o *owedSignal) arrived(ctx context.Context, id string) {
	o.mu.Lock()
	now := time.Now()
	q, quiet := o.quiet[id]
	delete(o.quiet, id)
	if e := o.running[id]; e != nil {
		// An attempt of the task runs here now: the message is its own
		// (begin dropped the task's earlier quiet end).
		e.owed, quiet = true, false
	} else {
		// Kept for an attempt about to begin here, and for a quiet end's
		// task that asynq puts back (a shutdown) and runs again here.
		o.recent[id] = now
		o.recentAt = append(o.recentAt, quietOrder{id: id, at: now})
	}
	o.prune(now)
	o.mu.Unlock()
	if quiet {
		o.wg.Go(func() { o.settle(context.WithoutCancel(ctx), q) })
	}
}

// prune drops the messages kept for IDs not running here that are older
// than recentLife, oldest first (amortized O(1) per message). Called with
// mu held.
func (o *owedSignal) prune(now time.Time) {
	i := 0
	for ; i < len(o.recentAt) && now.Sub(o.recentAt[i].at) > recentLife; i++ {
		if at, ok := o.recent[o.recentAt[i].id]; ok && at.Equal(o.recentAt[i].at) {
			delete(o.recent, o.recentAt[i].id)
		}
	}
	o.recentAt = o.recentAt[i:]
}

// pruneQuiet drops the quiet ends older than quietLife, oldest first
// (amortized O(1) per end). Called with mu held.
func (o *owedSignal) pruneQuiet(now time.Time) {
	i := 0
	for ; i < len(o.order) && now.Sub(o.order[i].at) > quietLife; i++ {
		if q, ok := o.quiet[o.order[i].id]; ok && q.at.Equal(o.order[i].at) {
			delete(o.quiet, o.order[i].id)
		}
	}
	o.order = o.order[i:] // (append's next growth copies only what is left)
}

// settle settles a quiet end late, as a success: once asynq's done has
// released the lock, settle.lua hands the key to the follow-up the mode
// record still says the task owes. While the lock names the task (asynq's
// done has not run yet; or asynq runs the task again, or a new task took
// its caller-chosen ID, which then holds the key and settles its own end)
// it waits, for quietLife at most.
func (o *owedSignal) settle(ctx context.Context, q quietEnd) {
	d := o.d
	var res store.SettleResult
	var err error
	st := &store.Settle{Ref: q.ref, End: store.EndSuccess, TTL: q.ttl, Late: true}
	for i, last := 0, false; ; i++ {
		res, err = d.store.Settle(ctx, st)
		if last || err != nil || !res.Waits || time.Since(q.at) > quietLife {
			break
		}
		// Close (after the server's Shutdown, which let asynq record the
		// task's end) cuts the pause short: one last try.
		last = !o.pause(lateBackoff.delay(i))
	}
	switch {
	case err != nil:
		d.count(q.ref.Type, evRedisError)
		d.log.Warn("dedup: could not hand a key to the follow-up owed after a quiet success; it runs when its parking time ends", slog.String("task_id", q.ref.ID), slog.Any("error", err))
	case res.Follow != "":
		d.log.Debug("dedup: follow-up queued", slog.String("type", q.ref.Type), slog.String("task_id", res.Follow))
	}
}

// lateBackoff paces a late settle waiting for asynq's done.
var lateBackoff = backoff{Min: 5 * time.Millisecond, Max: 500 * time.Millisecond}

// pause waits d, reporting false if the subscriber stops first.
func (o *owedSignal) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-o.quit:
		return false
	case <-t.C:
		return true
	}
}

// watches reports whether an attempt may end with no call: a RunningDefer
// task whose success calls for that alone, under this Dedup's prefix, and
// that made no start call (a retry, a follow-up, ...: a message about an
// earlier attempt of the task, or its key's earlier holder, was not heard
// by this one; those keep their call at the end).
func (o *owedSignal) watches(l *lease) bool {
	f := l.flags
	if !f.Has(store.FlagDefer) || f.Has(store.FlagCool) || f.Has(store.FlagKept) || f.Has(store.FlagRelease) || l.ref.Lock == "" || l.mustStart() {
		return false
	}
	prefix, _, _, ok := store.ParseLockKey(l.ref.Lock)
	return ok && prefix == o.d.store.Keys().Prefix()
}

// begin registers a watched attempt as its handler starts.
func (o *owedSignal) begin(l *lease) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := l.ref.ID
	e := o.running[id]
	if e == nil {
		e = &owedEntry{}
		o.running[id] = e
	}
	e.n++
	if _, ok := o.recent[id]; ok {
		e.owed = true
		delete(o.recent, id)
	}
	delete(o.quiet, id) // (an earlier attempt's, or an earlier task's under the same ID: this one holds the key now)
	sure := o.up && time.Since(o.since) >= owedLookback
	l.watched, l.owedSure, l.owedGen = true, sure, o.gen
}

// end unregisters a watched attempt and reports whether it may end with no
// call (eligible: its end asks for none but the owed check): the
// subscription was up as it started and still is, unbroken, and no
// follow-up was made of it. Such an end is remembered (quietLife).
func (o *owedSignal) end(l *lease, eligible bool) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := l.ref.ID
	e := o.running[id]
	owed := e != nil && e.owed
	if e != nil {
		if e.n--; e.n <= 0 {
			delete(o.running, id)
		}
	}
	if !eligible || owed || !l.owedSure || !o.up || o.gen != l.owedGen {
		return false
	}
	now := time.Now()
	o.pruneQuiet(now)
	o.quiet[id] = quietEnd{ref: l.ref, ttl: l.ttl, at: now}
	o.order = append(o.order, quietOrder{id: id, at: now})
	return true
}
