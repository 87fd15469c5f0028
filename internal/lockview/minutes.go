package lockview

import (
	"context"
	"fmt"
	"reflect"
	"strconv"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/redis/go-redis/v9"
)

// MinuteStats is what every process with a flusher (dedup.Dedup.StartFlusher)
// counted for one task type in one minute, as its flushes added it.
type MinuteStats struct {
	Minute time.Time // the minute's start, UTC
	Stats  dedup.Stats
}

// MaxStatsMinutes is the most minutes ReadMinuteStats reads back: the
// per-minute hashes are kept two hours.
const MaxStatsMinutes = 120

// ReadMinuteStats returns, for each task type with flushed counters under
// prefix ("" means "dedup"), what the flushes added in each of the n
// minutes up to and including the one of end, oldest first: n entries per
// type, zero where nothing was flushed. A flush counts in the minute it ran
// (so with a 10 s interval a count lands at most 10 s late). n is clamped
// to [1, MaxStatsMinutes]. It reads Redis in one pipelined round trip.
// Errors match ErrUnavailable.
func ReadMinuteStats(ctx context.Context, rdb redis.UniversalClient, prefix string, end time.Time, n int) (map[string][]MinuteStats, error) {
	if prefix == "" {
		prefix = "dedup"
	}
	n = min(max(n, 1), MaxStatsMinutes)
	keys := store.NewKeys(prefix)
	types, err := rdb.SMembers(ctx, keys.StatsTypes()).Result()
	if err != nil {
		return nil, fmt.Errorf("%w: read stats: %w", dedup.ErrUnavailable, err)
	}
	last := end.Unix() / 60
	cmds := make([][]*redis.MapStringStringCmd, len(types))
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, typ := range types {
			cmds[i] = make([]*redis.MapStringStringCmd, n)
			for j := range n {
				cmds[i][j] = p.HGetAll(ctx, keys.StatsMinute(typ, last-int64(n-1-j)))
			}
		}
		return nil
	})
	out := make(map[string][]MinuteStats, len(types))
	for i, typ := range types {
		series := make([]MinuteStats, n)
		for j, c := range cmds[i] {
			h, err := c.Result()
			if err != nil {
				return nil, fmt.Errorf("%w: read stats: %w", dedup.ErrUnavailable, err)
			}
			series[j] = MinuteStats{Minute: time.Unix((last-int64(n-1-j))*60, 0).UTC(), Stats: statsOf(h)}
		}
		out[typ] = series
	}
	return out, nil
}

// statsOf reads a per-minute stats hash into a dedup.Stats by its fields'
// "event" tags; fields that are no event's or hold no count are ignored.
func statsOf(h map[string]string) dedup.Stats {
	var s dedup.Stats
	v := reflect.ValueOf(&s).Elem()
	for i, name := range EventNames() {
		if n, err := strconv.ParseUint(h[name], 10, 64); err == nil {
			v.Field(i).SetUint(n)
		}
	}
	return s
}
