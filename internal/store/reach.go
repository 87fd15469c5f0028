package store

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	"github.com/redis/go-redis/v9"
)

// Calls that cannot reach Redis. A call that needs a new connection while
// nothing listens (or the name does not resolve, or the TLS handshake
// fails) has sent nothing; but go-redis dials again and again (its
// DialerRetries, then its MaxRetries, with backoffs), well past a
// LockTimeout of a second, and the call then ends with nothing but its
// deadline to say, which proves nothing: the caller would have to answer
// "outcome unknown". A dial watch, a hook on a single-node client (a
// *redis.Client; its own Sentinel lookups included), sees go-redis's
// dials fail as they happen. When one fails while the client holds no
// connection at all (so no call has a command on the wire), it ends every
// call of the Stores over that client that is under way, at once, with
// the dial's error as its cause (an *unreachable). Other clients (Cluster,
// Ring) are not watched: their calls end when go-redis gives up, or at
// LockTimeout.

// unreachable is the error of a call ended by a failed dial: it waited
// for a connection that could not be made. It reads, and matches with
// errors.Is and errors.As, as the dial's error.
type unreachable struct{ err error }

func (e *unreachable) Error() string { return e.err.Error() }
func (e *unreachable) Unwrap() error { return e.err }

// Unreached reports whether err proves that the call it ended did not
// reach Redis on its last attempt, and so was never sent unless go-redis
// had sent it on an earlier one (a retry after a connection lost mid-call,
// which then met Redis gone): a dial that failed (nothing listening, a
// name that does not resolve, a refused TLS handshake), a call the dial
// watch ended, a closed client.
func Unreached(err error) bool {
	if err == nil {
		return false
	}
	var (
		u   *unreachable
		op  *net.OpError
		dns *net.DNSError
		crt *tls.CertificateVerificationError
		rec tls.RecordHeaderError
	)
	switch {
	case errors.As(err, &u), errors.As(err, &dns), errors.As(err, &crt), errors.As(err, &rec):
		return true
	case errors.As(err, &op) && op.Op == "dial":
		return true
	}
	return errors.Is(err, redis.ErrClosed)
}

// LoginRefused reports whether err is Redis refusing a connection's login
// (WRONGPASS, NOAUTH): Redis answers, and will answer the same until the
// credentials change.
func LoginRefused(err error) bool {
	return isReply(err) && (redis.HasErrorPrefix(err, "WRONGPASS") || redis.HasErrorPrefix(err, "NOAUTH"))
}

// PermissionRefused reports whether err is Redis refusing a call the
// user's ACL does not allow (NOPERM).
func PermissionRefused(err error) bool {
	return isReply(err) && redis.HasErrorPrefix(err, "NOPERM")
}

// DialWatch watches one client's dials (see above). gen is the current
// generation: calls under way register on its context, which a failed
// dial cancels (cause: an *unreachable) after putting a new one in its
// place.
type DialWatch struct {
	client weak.Pointer[redis.Client] // weak: the registry must not keep a client alive
	gen    atomic.Pointer[dialGen]
}

type dialGen struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
}

func newDialGen() *dialGen {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &dialGen{ctx: ctx, cancel: cancel}
}

// watches holds the dial watch of each watched client, so that a client
// gets one hook however many Stores (Dedups) are made over it, and any
// number of failed New calls (go-redis offers no way to remove a hook).
var watches sync.Map // weak.Pointer[redis.Client] → *DialWatch

// WatchDials returns the dial watch of rdb, adding its hook to rdb the
// first time; nil for a client of a kind it does not watch.
func WatchDials(rdb redis.UniversalClient) *DialWatch {
	c, ok := rdb.(*redis.Client)
	if !ok || c == nil {
		return nil
	}
	key := weak.Make(c)
	if w, ok := watches.Load(key); ok {
		return w.(*DialWatch)
	}
	w := &DialWatch{client: key}
	w.gen.Store(newDialGen())
	if prev, loaded := watches.LoadOrStore(key, w); loaded {
		return prev.(*DialWatch)
	}
	c.AddHook(w)
	runtime.AddCleanup(c, func(k weak.Pointer[redis.Client]) { watches.Delete(k) }, key)
	return w
}

// DialHook implements redis.Hook: it passes every dial through, and ends
// the calls under way when one fails while the client holds no
// connection. (A dial its waiter gave up on, or that timed out, says
// nothing new: the calls waiting have ended or end by their own deadline.)
func (w *DialWatch) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil && ctx.Err() == nil && w.idle() {
			old := w.gen.Swap(newDialGen())
			old.cancel(&unreachable{err})
		}
		return conn, err
	}
}

// ProcessHook implements redis.Hook; it adds nothing to a command.
func (w *DialWatch) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

// ProcessPipelineHook implements redis.Hook; it adds nothing to a pipeline.
func (w *DialWatch) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// idle reports whether the client holds no connection (in its pipeline
// pool either): no command of it is on the wire.
func (w *DialWatch) idle() bool {
	c := w.client.Value()
	if c == nil {
		return false
	}
	st := c.PoolStats()
	return st.TotalConns == 0 && (st.PipelineStats == nil || st.PipelineStats.TotalConns == 0)
}

// Watched is one call under a dial watch (the zero Watched: none).
type Watched struct {
	parent context.Context
	gen    *dialGen
	stop   func() bool
}

// Enter puts a call whose context (a child of parent) cancel ends under
// the watch: a failed dial then cancels it. A nil w watches nothing.
func (w *DialWatch) Enter(parent context.Context, cancel context.CancelFunc) Watched {
	if w == nil {
		return Watched{}
	}
	g := w.gen.Load()
	return Watched{parent: parent, gen: g, stop: context.AfterFunc(g.ctx, cancel)}
}

// Leave takes the call out of the watch and returns its error: err, or,
// for a call a failed dial ended, that dial's failure (an *unreachable).
func (c Watched) Leave(err error) error {
	if c.stop == nil {
		return err
	}
	c.stop()
	return c.explain(err)
}

// explain returns err, or, for a call a failed dial ended (err is the
// cancellation of its context, not its caller's), that dial's failure.
func (c Watched) explain(err error) error {
	if c.gen == nil || err == nil || c.parent.Err() != nil || !errors.Is(err, context.Canceled) {
		return err
	}
	if cause := context.Cause(c.gen.ctx); cause != nil {
		return cause
	}
	return err
}
