// Package asynqconn makes asynq clients and inspectors over a Redis client
// their caller keeps, on every asynq version this module builds against
// (v0.24.1 on): what asynq's NewClientFromRedisClient and
// NewInspectorFromRedisClient do from v0.25.0 on. What it makes must never
// be closed: its Close would close the caller's client.
package asynqconn

import (
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// opt hands asynq a client as an asynq.RedisConnOpt.
type opt struct{ rdb redis.UniversalClient }

// MakeRedisClient implements asynq.RedisConnOpt.
func (o opt) MakeRedisClient() any { return o.rdb }

// Client returns an asynq client over rdb.
func Client(rdb redis.UniversalClient) *asynq.Client { return asynq.NewClient(opt{rdb}) }

// Inspector returns an asynq inspector over rdb.
func Inspector(rdb redis.UniversalClient) *asynq.Inspector { return asynq.NewInspector(opt{rdb}) }
