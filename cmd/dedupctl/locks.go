package main

import (
	"time"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

// Reading, paging, describing, checking and releasing locks is
// internal/lockview's, shared with the dedupweb handler; dedupctl only
// parses command lines and prints.

type (
	lockInfo      = lockview.Info
	showOutput    = lockview.Detail
	doctorOutput  = lockview.Report
	doctorFinding = lockview.Finding
)

// notLockKey explains why key is not a lock key of prefix.
func notLockKey(prefix, key string) error { return lockview.NotLockKey(prefix, key) }

// fmtDuration prints a TTL the way people read it: 1d02h, 1h05m, 4m09s,
// 12s, 850ms.
func fmtDuration(d time.Duration) string { return lockview.FmtDuration(d) }
