// Package dedup deduplicates asynq tasks by a key drawn from the task type
// and chosen payload fields, with a Redis lock that follows the task through
// its whole life.
//
// A Client (Dedup.NewClient, or Dedup.WrapClient around any Enqueuer)
// fingerprints each task — its type plus the
// selected JSON fields (canonicalised: member order, white space, string
// escapes and number spelling do not matter), an explicit key, or the raw
// payload — with xxhash, and takes the lock in one atomic Redis script. A
// duplicate gets a *DuplicateTaskError carrying the ID of the task that holds
// the key; it matches asynq.ErrDuplicateTask too, so code written for
// asynq.Unique keeps working. By policy (Conflict, Running) the new payload
// can instead replace or be merged into the waiting task's, in place, or be
// folded into one follow-up of a running task; Client.Submit says which.
// A Cooldown keeps the key held for a while after its task succeeds
// (throttle); a Debounce delays a task and pushes its due time back with
// every payload folded into it, so a burst runs once, after it ends.
//
// The lock of a task NewClient stores is its asynq UniqueKey: asynq's own
// scripts release it when the task succeeds, is revoked or is deleted, and
// keep it across retries, so the key's state is asynq's record of its
// holder, and a key whose holder is gone or archived heals at its next
// enqueue. The server middleware (Dedup.Middleware) makes no Redis call for
// such a task unless its policy acts at start or end (a cooldown, a failure
// hold, a follow-up), and extends the lock of a handler that runs long.
// Tasks that reach the server without a lock (asynq.Scheduler, other
// services) take one when they start.
//
// Locks live in their queue's Redis Cluster hash slot, beside asynq's own
// keys, so deduplication is per queue, as with asynq.Unique, and works on a
// single node, Sentinel and Cluster. The tasks must be stored in the same
// Redis as the locks, since each lock is checked against asynq's record of
// its holder task (ErrTasksElsewhere otherwise). The lock is an efficiency measure, not
// an exactly-once guarantee: a Redis failover can lose a lock written just
// before it. Make handlers idempotent where effects must happen once.
//
// # The API by task
//
// Set up: New (or NewFromRedisConnOpt) with a Config, whose Rules hold a
// Rule per task type; Dedup.Close.
//
// Enqueue: Dedup.NewClient or Dedup.WrapClient (over any Enqueuer) make a
// Client; Client.Enqueue, EnqueueContext, Submit (its Result says the
// Outcome: Created, Replaced, Merged, Deferred) and EnqueueBatch
// (BatchResult); Client.Ping, Client.Close. Per-call options: Key,
// SharedKey, Fields, Skip, TTL, OnConflict, MergeWith (a MergeFunc),
// Cooldown, Debounce, Period, OnFailure, WaitForRoom, Headers. The
// policies: Conflict (Reject, Replace, Merge), Running (RunningReject,
// RunningDefer, RunningAllow), Busy (BusyRetry, BusyDrop, BusyFold),
// Failure (FailRelease, FailHold, FailHoldUntilReleased); one table of
// them is in docs/glossary.md. A duplicate is a *DuplicateTaskError
// naming its Holder; Dedup.WaitHolder and Dedup.WaitResult wait for a
// task's result. Errors match the Err* sentinels (a bad payload is a
// *PayloadError).
//
// Serve: Dedup.Middleware on the asynq server, with IsFailure as its
// asynq.Config.IsFailure; a task that meets its key busy gets a
// *BusyError (ErrKeyBusy). NewScheduler (SchedulerOpts) enqueues one task
// per firing across replicas; SchedulerFiring reads which firing a task
// is.
//
// Operate: Dedup.Lookup (a KeyLock) and Dedup.Release; counters:
// Dedup.Stats, Dedup.StatsByType (Stats, Stats.Map), Dedup.StartFlusher,
// Dedup.FlushStats and ReadStats across processes; Dedup.StartReporter
// (ReportConfig) logs the hot keys; Config.OnDecision sees each Decision.
// Beside the package: dedupctl, dedupweb, dedupprom and dedupotel.
package dedup
