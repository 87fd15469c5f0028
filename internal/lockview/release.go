package lockview

import (
	"context"
	"fmt"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Released is what a release did.
type Released struct {
	Notes []string // what releasing leaves behind
}

// Release deletes the lock l, read before, only if its holder is still the
// one l names (store.ReleaseKey, compare-and-delete), with its entry in its
// type's waiting set.
func Release(ctx context.Context, src Source, prefix string, l *Info) (*Released, error) {
	res, err := store.ReleaseKey(ctx, src.RDB, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.lock.WaitType(), How: store.ReleaseHolder, Holder: l.Holder})
	switch {
	case err != nil:
		return nil, fmt.Errorf("release %s: %w", l.Key, err)
	case !res.Released && res.Holder == "":
		return nil, fmt.Errorf("%w: %s (released or expired meanwhile)", ErrNoLock, l.Key)
	case !res.Released:
		return nil, fmt.Errorf("not released: %s changed holder from %s to %s since it was read; run again to release the new holder's lock", l.Key, l.Holder, res.Holder)
	}
	return &Released{Notes: ReleaseNotes(l, res.Queued != "")}, nil
}

// ReleaseNotes says what releasing leaves behind; queued: the follow-up
// the lock owed was queued.
func ReleaseNotes(l *Info, queued bool) []string {
	var notes []string
	switch {
	case l.State == "running" && l.FollowUp != "":
		notes = append(notes, fmt.Sprintf("holder %s is running: its handler goes on without the lock", l.Holder))
	case l.State == "running":
		notes = append(notes, fmt.Sprintf("holder %s is running: its handler goes on without the lock; the key's next enqueue creates a new task, which may run alongside it", l.Holder))
	case l.TaskState == "pending" || l.TaskState == "scheduled" || l.TaskState == "retry" || l.TaskState == "active" || l.TaskState == "aggregating":
		notes = append(notes, fmt.Sprintf("holder %s is still %s in asynq: releasing deletes no task; it still runs, checking the key first (it takes it if free, else gives way)", l.Holder, l.TaskState))
	}
	switch {
	case queued:
		notes = append(notes, fmt.Sprintf("follow-up task %s, which carries the newest payload, is queued now; it takes the key when it starts", l.FollowUp))
	case l.FollowUp != "":
		notes = append(notes, fmt.Sprintf("follow-up task %s stays owed: it runs when its parking time ends, or the key's next deferring enqueue queues it", l.FollowUp))
	}
	return notes
}
