package dedup

import (
	"context"
	"errors"
	"log/slog"
)

// onRedisError decides what a Redis failure on a lock call means. It counts
// and logs the error and reports whether the caller may go on without the
// lock (fail-open) — never for a context the caller itself cancelled.
func (d *Dedup) onRedisError(ctx context.Context, op, typ string, err error) (proceed bool) {
	d.count(typ, evRedisError)
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return false
	}
	if d.cfg.FailOpen {
		d.count(typ, evFailOpen)
		d.log.Warn("dedup: redis error, continuing without lock (fail-open)", slog.String("op", op), slog.String("type", typ), slog.Any("error", err))
		return true
	}
	d.log.Warn("dedup: redis error (fail-closed)", slog.String("op", op), slog.String("type", typ), slog.Any("error", err))
	return false
}
