package lockview

import (
	"context"
	"fmt"

	"github.com/asynq-dedup/dedup/internal/store"
)

// Released is what a release did.
type Released struct {
	IndexKey string   // the owner's index key, deleted with the lock
	Notes    []string // what releasing leaves behind
}

// Release deletes the lock l, read before, only if its owner is still the
// one l names and has not taken it again since (store.ReleaseLock,
// compare-and-delete), with its entry in its type's waiting set.
func Release(ctx context.Context, src Source, prefix string, l *Info) (*Released, error) {
	res, err := store.ReleaseLock(ctx, src.RDB, store.NewKeys(prefix), l.lock)
	switch {
	case err != nil:
		return nil, fmt.Errorf("release %s: %w", l.Key, err)
	case res.Gone:
		return nil, fmt.Errorf("%w: %s (released or expired meanwhile)", ErrNoLock, l.Key)
	case !res.Released && res.Owner == l.Owner:
		return nil, fmt.Errorf("not released: %s was taken again by %s since it was read; run again to release it", l.Key, l.Owner)
	case !res.Released:
		return nil, fmt.Errorf("not released: %s changed owner from %s to %s since it was read; run again to release the new owner's lock", l.Key, l.Owner, res.Owner)
	}
	return &Released{IndexKey: res.Index, Notes: ReleaseNotes(l, res.FollowUp != "")}, nil
}

// ReleaseNotes says what releasing leaves behind; queued: the follow-up
// the lock owed was queued.
func ReleaseNotes(l *Info, queued bool) []string {
	var notes []string
	switch {
	case l.State == "running" && l.FollowUp != "":
		notes = append(notes, fmt.Sprintf("owner %s is running: its handler goes on without the lock (its heartbeat logs the loss)", l.Owner))
	case l.State == "running":
		notes = append(notes, fmt.Sprintf("owner %s is running: its handler goes on without the lock (its heartbeat logs the loss); the key's next enqueue creates a new task, which may run alongside it", l.Owner))
	case l.TaskState == "pending" || l.TaskState == "scheduled" || l.TaskState == "retry" || l.TaskState == "active" || l.TaskState == "aggregating":
		notes = append(notes, fmt.Sprintf("owner %s is still %s in asynq: releasing deletes no task; it still runs, and takes the lock again when it starts if the key is free", l.Owner, l.TaskState))
	}
	switch {
	case queued:
		notes = append(notes, fmt.Sprintf("follow-up task %s, which carries the newest payload, is queued now; it takes the key when it starts", l.FollowUp))
	case l.FollowUp != "":
		notes = append(notes, fmt.Sprintf("follow-up task %s stays owed: it runs when its parking time ends, or the key's next deferring enqueue queues it", l.FollowUp))
	}
	return notes
}
