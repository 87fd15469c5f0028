package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
	"github.com/redis/go-redis/v9"
)

// quietRedis silences go-redis's own logger, which prints dial failures to
// stderr: every error reaches the user through the command's message.
var quietRedis sync.Once

type nopLogger struct{}

func (nopLogger) Printf(context.Context, string, ...any) {}

// conn is a connection to one Redis server or to a Redis Cluster.
type conn struct {
	rdb     redis.UniversalClient
	cluster *redis.ClusterClient // nil for one server
	where   string               // the addresses, for messages (never the password)
	limit   *deadlineHook        // bounds the calls made without a deadline
}

// dial parses a Redis URL (see the --url flag) without connecting yet.
// With cluster the URL's host part may list several comma-separated seeds.
// Every call is bounded: by its context's deadline, and one made without
// one by timeout (deadlineHook).
func dial(raw string, cluster bool, timeout time.Duration) (*conn, error) {
	quietRedis.Do(func() { redis.SetLogger(nopLogger{}) })
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return nil, errors.New("bad --url: empty (want redis://host:port/db)")
	}
	scheme, userinfo, hosts, tail, err := splitURL(raw)
	if err != nil {
		return nil, err
	}
	password := ""
	if i := strings.IndexByte(userinfo, ':'); i >= 0 {
		password = strings.TrimSuffix(userinfo[i+1:], "@")
	}
	bad := func(err error) error {
		msg := err.Error()
		if password != "" {
			msg = strings.ReplaceAll(msg, password, "xxxxx")
		}
		return fmt.Errorf("bad --url %s: %s", redact(raw, password), msg)
	}
	if !cluster {
		if len(hosts) > 1 {
			return nil, fmt.Errorf("bad --url %s: it lists %d addresses; pass --cluster for a Redis Cluster", redact(raw, password), len(hosts))
		}
		opt, err := redis.ParseURL(raw)
		if err != nil {
			return nil, bad(err)
		}
		quickFail(&opt.DialTimeout, &opt.MaxRetries, &opt.DialerRetries)
		opt.ContextTimeoutEnabled = true
		return newConn(redis.NewClient(opt), nil, opt.Addr, timeout), nil
	}
	opt, err := clusterOptions(scheme, userinfo, hosts, tail)
	if err != nil {
		return nil, bad(err)
	}
	quickFail(&opt.DialTimeout, &opt.MaxRetries, &opt.DialerRetries)
	opt.ContextTimeoutEnabled = true
	c := redis.NewClusterClient(opt)
	return newConn(c, c, "cluster "+strings.Join(opt.Addrs, ","), timeout), nil
}

// clusterOptions reads a cluster URL split by splitURL: its first host
// goes through go-redis's parser, the others are further seeds.
func clusterOptions(scheme, userinfo string, hosts []string, tail string) (*redis.ClusterOptions, error) {
	if scheme != "redis" && scheme != "rediss" {
		return nil, fmt.Errorf("--cluster needs a redis:// or rediss:// URL, not %s://", scheme)
	}
	path, query, _ := strings.Cut(tail, "?")
	if p := strings.Trim(path, "/"); p != "" && p != "0" {
		return nil, fmt.Errorf("a Redis Cluster has only database 0, the URL selects %q", p)
	}
	first := scheme + "://" + userinfo + hosts[0]
	if query != "" {
		first += "?" + query
	}
	opt, err := redis.ParseClusterURL(first)
	if err != nil {
		return nil, err
	}
	for _, h := range hosts[1:] {
		if _, _, err := net.SplitHostPort(h); err != nil {
			h = net.JoinHostPort(h, "6379")
			if _, _, err := net.SplitHostPort(h); err != nil {
				return nil, fmt.Errorf("seed %q is not host:port", h)
			}
		}
		opt.Addrs = append(opt.Addrs, h)
	}
	return opt, nil
}

// newConn wraps a client the CLI made with ContextTimeoutEnabled (every
// call ends at its context's deadline, not go-redis's ReadTimeout), with
// the hook that bounds the calls made without a deadline by timeout.
func newConn(rdb redis.UniversalClient, cluster *redis.ClusterClient, where string, timeout time.Duration) *conn {
	h := &deadlineHook{each: timeout}
	rdb.AddHook(h)
	return &conn{rdb: rdb, cluster: cluster, where: where, limit: h}
}

// deadlineHook bounds the Redis calls that carry no deadline: asynq's
// Inspector (task states, the queue list) calls Redis with
// context.Background(), which ContextTimeoutEnabled alone leaves to
// go-redis's ReadTimeout, its retries included. Each such call ends after
// each, and at the command's deadline (within) at the latest.
type deadlineHook struct {
	each time.Duration // 0: no bound of its own
	at   atomic.Int64  // the command's deadline, unix nanoseconds; 0 for none
}

// bound gives ctx the hook's deadline if it has none.
func (h *deadlineHook) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	var end time.Time
	if h.each > 0 {
		end = time.Now().Add(h.each)
	}
	if at := h.at.Load(); at != 0 && (end.IsZero() || at < end.UnixNano()) {
		end = time.Unix(0, at)
	}
	if end.IsZero() {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, end)
}

func (h *deadlineHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		ctx, cancel := h.bound(ctx)
		defer cancel()
		return next(ctx, network, addr)
	}
}

func (h *deadlineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		ctx, cancel := h.bound(ctx)
		defer cancel()
		return next(ctx, cmd)
	}
}

func (h *deadlineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		ctx, cancel := h.bound(ctx)
		defer cancel()
		return next(ctx, cmds)
	}
}

// within makes ctx's deadline the latest end of the calls made without a
// context of their own (asynq's Inspector).
func (c *conn) within(ctx context.Context) {
	if d, ok := ctx.Deadline(); ok {
		c.limit.at.Store(d.UnixNano())
	}
}

// splitURL splits scheme://userinfo@host1,host2/path?query by hand, since
// net/url refuses some host lists (IPv6 seeds).
func splitURL(raw string) (scheme, userinfo string, hosts []string, tail string, err error) {
	i := strings.Index(raw, "://")
	if i <= 0 {
		return "", "", nil, "", fmt.Errorf("bad --url %q: want scheme://host:port, such as %s", raw, defaultURL)
	}
	scheme, rest := raw[:i], raw[i+3:]
	switch scheme {
	case "redis", "rediss":
	case "unix":
		return scheme, "", nil, rest, nil
	default:
		return "", "", nil, "", fmt.Errorf("bad --url: scheme %q is not redis, rediss or unix", scheme)
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	auth, tail := rest[:end], rest[end:]
	if at := strings.LastIndexByte(auth, '@'); at >= 0 {
		userinfo, auth = auth[:at+1], auth[at+1:]
	}
	hosts = strings.Split(auth, ",")
	for _, h := range hosts {
		if h == "" && len(hosts) > 1 {
			return "", "", nil, "", fmt.Errorf("bad --url: empty address in the host list %q", auth)
		}
	}
	return scheme, userinfo, hosts, tail, nil
}

// redact hides the password of a URL for messages.
func redact(raw, password string) string {
	if password == "" {
		return fmt.Sprintf("%q", raw)
	}
	return fmt.Sprintf("%q", strings.Replace(raw, ":"+password+"@", ":xxxxx@", 1))
}

// ping checks that Redis (every master of a cluster) answers.
func (c *conn) ping(ctx context.Context) error {
	var err error
	if c.cluster != nil {
		err = c.cluster.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			if err := m.Ping(ctx).Err(); err != nil {
				return fmt.Errorf("master %s: %w", m.Options().Addr, err)
			}
			return nil
		})
	} else {
		err = c.rdb.Ping(ctx).Err()
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("cannot reach Redis at %s: timed out (%v)", c.where, err)
	}
	return fmt.Errorf("cannot reach Redis at %s: %v", c.where, err)
}

// src is the connection as internal/lockview reads it.
func (c *conn) src() lockview.Source { return lockview.Source{RDB: c.rdb, Cluster: c.cluster} }

func (c *conn) close() error { return c.rdb.Close() }

// quickFail sets, where the URL left them unset, a short dial timeout and a
// single retry, so an unreachable Redis is reported at once.
func quickFail(dial *time.Duration, retries, dialerRetries *int) {
	if *dial == 0 {
		*dial = dialTimeout
	}
	if *retries == 0 {
		*retries = 1
	}
	if *dialerRetries == 0 {
		*dialerRetries = 1
	}
}
