package store

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Unreached holds for the errors that prove a call never reached Redis
// (a failed dial, however wrapped), and for none that a call which may
// have reached it can end with.
func TestUnreachedOnlyForCallsThatNeverReachedRedis(t *testing.T) {
	dial := func(err error) error { return &net.OpError{Op: "dial", Net: "tcp", Err: err} }
	never := map[string]error{
		"connection refused":  dial(errors.New("connect: connection refused")),
		"name not resolved":   dial(&net.DNSError{Err: "no such host", Name: "redis.invalid", IsNotFound: true}),
		"bare DNS error":      &net.DNSError{Err: "no such host", Name: "redis.invalid"},
		"certificate refused": &tls.CertificateVerificationError{Err: errors.New("x509: certificate signed by unknown authority")},
		"not a TLS server":    tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"},
		"dial watch":          &unreachable{dial(errors.New("connect: connection refused"))},
		"closed client":       redis.ErrClosed,
		"wrapped":             fmt.Errorf("acquire: %w", dial(errors.New("connect: connection refused"))),
	}
	for name, err := range never {
		if !Unreached(err) {
			t.Errorf("%s (%v): not Unreached", name, err)
		}
	}
	maybe := map[string]error{
		"deadline":          context.DeadlineExceeded,
		"cancelled":         context.Canceled,
		"connection lost":   io.EOF,
		"read reset":        &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")},
		"Redis's own reply": redis.Nil,
		"no error":          nil,
	}
	for name, err := range maybe {
		if Unreached(err) {
			t.Errorf("%s (%v): Unreached, but the call may have reached Redis", name, err)
		}
	}
}

// A call waiting for a connection to a port where nothing listens ends at
// the first failed dial, with that dial's error, not when go-redis has
// spent its dial retries (5 per attempt, 100 ms apart) and MaxRetries.
func TestDialWatchEndsACallWaitingForARefusedConnection(t *testing.T) {
	addr, err := redistest.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	w := WatchDials(rdb)
	if again := WatchDials(rdb); again != w {
		t.Fatal("a second watch of one client: its dials would go through two hooks")
	}
	parent := context.Background()
	ctx, cancel := context.WithTimeout(parent, 10*time.Second)
	defer cancel()
	start := time.Now()
	call := w.Enter(parent, cancel)
	err = call.Leave(rdb.Ping(ctx).Err())
	took := time.Since(start)
	var op *net.OpError
	switch {
	case !Unreached(err):
		t.Fatalf("PING: %v, want Unreached", err)
	case !errors.As(err, &op) || op.Op != "dial":
		t.Fatalf("PING: %v does not keep the dial error", err)
	case took > time.Second:
		t.Fatalf("PING ended after %v, not at the first failed dial", took)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}})
	defer cc.Close()
	if WatchDials(cc) != nil {
		t.Error("a Cluster client's dials are watched: its node clients dial, not it")
	}
}
