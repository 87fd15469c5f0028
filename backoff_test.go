package dedup

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// New against a Redis that refuses the login (a wrong password, or none
// where one is required) fails at its first PING, without the connect
// backoff's retries: Redis answered, and will answer the same again. The
// error matches ErrUnavailable, says "redis refused authentication" with
// Redis's reply, and keeps that reply for errors.As.
func TestNewDoesNotRetryARefusedLogin(t *testing.T) {
	needRealRedis(t)
	p, _ := ownRedis(t, nil, "--requirepass", "secret")
	for name, pw := range map[string]string{"wrong password": "not-the-secret", "no password": ""} {
		t.Run(name, func(t *testing.T) {
			rdb := redis.NewClient(&redis.Options{Addr: p.Addr, Password: pw})
			t.Cleanup(func() { _ = rdb.Close() })
			backoff := backoff{Min: time.Second, Max: time.Second} // a retry would wait up to this
			start := time.Now()
			_, err := New(context.Background(), rdb, Config{connectAttempts: 5, connectBackoff: backoff, Logger: quietLogger()})
			took := time.Since(start)
			var re redis.Error
			switch {
			case !errors.Is(err, ErrUnavailable):
				t.Fatalf("New: %v, want ErrUnavailable", err)
			case !strings.HasPrefix(err.Error(), "dedup: redis refused authentication: "):
				t.Fatalf("New: %q, want it to begin \"dedup: redis refused authentication: \"", err)
			case strings.Contains(err.Error(), "attempts"):
				t.Fatalf("New: %q: a refused login was retried", err)
			case !errors.As(err, &re):
				t.Fatalf("New: %v does not keep Redis's reply", err)
			case took > 500*time.Millisecond:
				t.Fatalf("New failed after %v: a refused login was retried", took)
			}
			t.Logf("New: %v", err)
		})
	}
}

// New over TLS to a server whose certificate the client does not trust
// fails at once, saying the handshake failed (the TLS error kept for
// errors.As), not with the PING's deadline: the dial failed, nothing was
// sent.
func TestNewWithAnUntrustedTLSCertificateSaysTheHandshakeFailed(t *testing.T) {
	t.Parallel()
	srv := httptest.NewUnstartedServer(http.NotFoundHandler()) // on 127.0.0.1, its certificate self-signed
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)           // (the refused handshakes)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Listener.Addr().String(), TLSConfig: &tls.Config{ServerName: "127.0.0.1"}})
	t.Cleanup(func() { _ = rdb.Close() })
	_, err := New(context.Background(), rdb, Config{connectAttempts: 1, Logger: quietLogger()})
	var cv *tls.CertificateVerificationError
	switch {
	case !errors.Is(err, ErrUnavailable):
		t.Fatalf("New: %v, want ErrUnavailable", err)
	case !errors.As(err, &cv) || !strings.Contains(err.Error(), "tls: "):
		t.Fatalf("New: %v, want the TLS handshake's error", err)
	case errors.Is(err, context.DeadlineExceeded):
		t.Fatalf("New: %v: it waited out the PING's deadline, not failed at the handshake", err)
	}
	t.Logf("New: %v", err)
}
