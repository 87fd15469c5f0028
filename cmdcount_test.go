package dedup

import (
	"context"
	"net"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// commandHook counts the commands a client sends (pipelines count each).
type commandHook struct{ n atomic.Int64 }

func (h *commandHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) { return next(ctx, network, addr) }
}

func (h *commandHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h *commandHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

var (
	hooksMu sync.Mutex
	hooks   = map[redis.UniversalClient]*commandHook{}
)

// cmdCounter installs (once per client) and returns a command counter.
func cmdCounter(c redis.UniversalClient) *commandHook {
	hooksMu.Lock()
	defer hooksMu.Unlock()
	if h, ok := hooks[c]; ok {
		return h
	}
	h := &commandHook{}
	c.AddHook(h)
	hooks[c] = h
	return h
}
