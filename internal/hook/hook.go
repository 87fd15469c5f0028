// Package hook gives this module's own packages (dedupotel) what package
// dedup keeps out of its API. Package dedup sets the hooks as it is
// initialised; they are not for the users of package dedup.
package hook

import "github.com/hibiken/asynq"

// BreakerState returns the state of a *dedup.Dedup's circuit breaker:
// "closed", "open" or "probing"; on Redis Cluster, the worst master's.
var BreakerState func(d any) string

// QueueOf returns the queue an enqueue of task with opts through a
// *dedup.Dedup's Client would use, as Client.Submit chooses it.
var QueueOf func(d any, task *asynq.Task, opts ...asynq.Option) string
