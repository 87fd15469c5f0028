package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// doctor --fix runs Diagnose, then releases each lock found, "owner
// checked". With a caller-chosen task ID, a producer that enqueues the key
// again under the same ID between the two (the old owner's record was lost,
// so the next enqueue heals the lock and takes it again, under the same
// owner ID) must not have its live lock released: its task is pending and
// will run, and a release would let the key's next enqueue in, a duplicate.
// This test performs runDoctor's two steps with the enqueue between them.
func TestAdversary5DoctorFixReleasesALockRetakenUnderTheSameCallerChosenID(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	direct := f.d.NewClient()
	id := "job-" + randHex(4)
	task := asynq.NewTask("email:welcome", []byte(`{"user_id":7}`))
	opts := []asynq.Option{asynq.Queue(f.qa), dedup.Fields("user_id")}
	if _, err := direct.EnqueueContext(ctx, task, append(opts, asynq.TaskID(id))...); err != nil {
		t.Fatal(err)
	}
	// A lossy failover lost the task (record and list), not its lock.
	if err := f.rdb.Del(ctx, store.TaskKey(f.qa, id)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := f.rdb.LRem(ctx, store.PendingKey(f.qa), 0, id).Err(); err != nil {
		t.Fatal(err)
	}
	// doctor --fix, first step: find.
	ls, err := store.ReadLocks(ctx, f.rdb, store.NewKeys(f.prefix), f.lockKeys())
	if err != nil {
		t.Fatal(err)
	}
	ds, _, err := store.Diagnose(ctx, f.rdb, ls, 0, time.Now())
	if err != nil || len(ds) != 1 || ds[0].Problem != store.ProblemGone {
		t.Fatalf("diagnose: %+v %v, want the one lock gone", ds, err)
	}
	// Meanwhile the producer enqueues the key again, under the same ID.
	res, err := direct.EnqueueContext(ctx, task, append(opts, asynq.TaskID(id))...)
	if err != nil {
		t.Fatalf("re-enqueue under the same ID: %v", err)
	}
	t.Logf("re-enqueue: %+v", res)
	// doctor --fix, second step: release, as runDoctor does (since this
	// test found the race: ReleaseStuck, which re-checks the owner).
	l := ds[0].Lock
	rr, err := store.ReleaseKey(ctx, f.rdb, &store.Release{Lock: l.Key, Queue: l.Queue, Type: l.WaitType(), How: store.ReleaseStuck, Holder: l.Owner})
	if err != nil {
		t.Fatal(err)
	}
	if rr.Released {
		// Show the consequence: the key's duplicate is admitted while its task waits.
		_, derr := direct.EnqueueContext(ctx, task, opts...)
		t.Fatalf("doctor --fix released the live lock of task %s, re-enqueued after the diagnosis under the same ID "+
			"(release checks only the owner ID, not the lock's creation); a duplicate of the waiting task then gets: %v", id, derr)
	}
}

// doctor reports no lock whose owner can run: a scheduled task, a task
// with a caller-chosen ID (WrapClient and NewClient), a grouped
// (aggregating) task, a task in retry, and a task that is running.
func TestAdversary5DoctorNoFalsePositives(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{})
	ctx := context.Background()
	type one struct {
		name string
		id   string
	}
	var made []one
	add := func(name string, c interface {
		EnqueueContext(context.Context, *asynq.Task, ...asynq.Option) (*asynq.TaskInfo, error)
	}, user int, opts ...asynq.Option) {
		opts = append([]asynq.Option{asynq.Queue(f.qa), dedup.Fields("user_id")}, opts...)
		info, err := c.EnqueueContext(ctx, asynq.NewTask("email:welcome", fmt.Appendf(nil, `{"user_id":%d}`, user)), opts...)
		if err != nil {
			t.Logf("%s: enqueue refused: %v (left out)", name, err)
			return
		}
		made = append(made, one{name, info.ID})
	}
	add("scheduled", f.client, 1, asynq.ProcessIn(time.Hour))
	add("caller ID (wrap)", f.client, 2, asynq.TaskID("wrap-"+randHex(4)))
	add("caller ID (direct)", directEnq{f.d.NewClient()}, 3, asynq.TaskID("direct-"+randHex(4)))
	add("grouped", f.client, 4, asynq.Group("g1"))
	add("direct scheduled", directEnq{f.d.NewClient()}, 5, asynq.ProcessIn(time.Hour))
	add("wrap retention", f.client, 6, asynq.Retention(time.Hour))
	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0"))
	if len(out.Findings) > 0 {
		t.Fatalf("doctor reported locks whose owner can run: %+v (made %+v)", out.Findings, made)
	}
	if out.Checked != len(made) {
		t.Errorf("doctor checked %d locks, want %d (%+v)", out.Checked, len(made), made)
	}
}

type directEnq struct{ c *dedup.Client }

func (d directEnq) EnqueueContext(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return d.c.EnqueueContext(ctx, t, opts...)
}
