// Package store owns the Redis layout of github.com/asynq-dedup/dedup and
// the one path by which the library reaches Redis.
//
// Layout: every key name (keys.go), the lock's value (value.go), every
// field of the mode record (record.go), the forms of task IDs and the
// task's dedup header (task.go) and
// what this package reads and writes of asynq v0.26.0's own records
// (asynq.go) are written here and nowhere else in Go; the Lua scripts in
// lua/ (one per operation, embedded) are the only other place that knows
// them. Each script has one Go type whose named fields are its arguments
// (acquire.go, attempt.go, release.go); that type alone builds the script's
// KEYS and ARGV. Every key a script reads or writes is passed in KEYS, never
// built inside Lua, so that Redis Cluster refuses a call whose slot is
// moving (TRYAGAIN, ASK) instead of splitting a queue's keys between two
// nodes; see roles.go for how a script asks for keys it could not know in
// advance (the task that holds a lock).
//
// Calls: every Redis call of the library goes through Store (exec.go): the
// circuit breaker, the bound of Config.LockTimeout, and auto-pipelining of
// concurrent script calls (batch.go), including the heartbeat's and the
// stats flusher's pipelines.
package store
