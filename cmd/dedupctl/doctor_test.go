package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// doctor finds a lock whose owner is gone and one whose owner's record
// says pending while no list holds it (what a forced slot migration
// leaves), leaves alone a healthy waiting lock, a running one and a
// cooling one, and with --fix releases exactly the two it found.
func TestDoctorFindsAndFixesLocksWhoseOwnerCannotRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{
		"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour},
		"report:build":  {Fields: []string{"user_id"}},
	}})
	ctx := context.Background()
	healthy := f.enqueue(f.qa, "email:welcome", 1)
	orphan := f.enqueue(f.qa, "email:welcome", 2)
	lost := f.enqueue(f.qa, "email:welcome", 3)
	if err := f.insp.DeleteTask(orphan.Queue, orphan.ID); err != nil {
		t.Fatal(err)
	}
	if err := f.rdb.LRem(ctx, store.PendingKey(lost.Queue), 0, lost.ID).Err(); err != nil { // the list lost it
		t.Fatal(err)
	}
	cooling := f.enqueue(f.qb, "digest:weekly", 4)
	started, finish := f.startServer(f.qb)
	<-started
	finish()
	running := f.enqueue(f.qb, "report:build", 5)
	started, _ = f.startServer(f.qb)
	<-started
	f.waitRunning(f.lockOf(running))

	out := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0"))
	got := map[string]string{}
	for _, x := range out.Findings {
		got[x.Owner] = x.Problem
	}
	if len(got) != 2 || got[orphan.ID] != "gone" || got[lost.ID] != "lost" || out.Checked != 5 {
		t.Fatalf("doctor found %v in %d locks; want %s gone and %s lost of 5 (healthy %s, cooling %s, running %s left alone)",
			got, out.Checked, orphan.ID, lost.ID, healthy.ID, cooling.ID, running.ID)
	}
	r := f.ok("doctor", "--grace", "0")
	if !strings.Contains(r.stdout, "but not in asynq's pending list or set") || !strings.Contains(r.stdout, "5 locks checked, 2 locks whose owner cannot run; run with --fix") {
		t.Errorf("doctor text:\n%s", r.stdout)
	}
	// An orphan younger than --grace is left alone (a WrapClient lock), and
	// doctor says so: show calls it orphaned.
	if out := decode[doctorOutput](t, f.ok("--json", "doctor")); len(out.Findings) != 1 || out.Findings[0].Owner != lost.ID ||
		len(out.Young) != 1 || out.Young[0].Owner != orphan.ID {
		t.Errorf("doctor with the default grace: found %+v, left alone %+v; want the lost lock found and the orphan left alone", out.Findings, out.Young)
	}
	r = f.ok("doctor")
	if !strings.Contains(r.stdout, "5 locks checked, 1 lock whose owner cannot run, 1 orphan younger than --grace 1m00s left alone; run with --fix to release it") ||
		!strings.Contains(r.stdout, orphan.ID) {
		t.Errorf("doctor text with the default grace:\n%s", r.stdout)
	}

	fixed := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0", "--fix"))
	if fixed.Released != 2 {
		t.Fatalf("--fix released %d: %+v", fixed.Released, fixed.Findings)
	}
	for _, id := range []string{orphan.ID, lost.ID} {
		if f.exists(f.lockOf(&asynq.TaskInfo{ID: id, Queue: f.qa})) {
			t.Errorf("lock of %s still there after --fix", id)
		}
	}
	for _, ti := range []struct{ id, queue string }{{healthy.ID, f.qa}, {cooling.ID, f.qb}, {running.ID, f.qb}} {
		if !f.exists(f.lockOf(&asynq.TaskInfo{ID: ti.id, Queue: ti.queue})) {
			t.Errorf("lock of %s released by --fix", ti.id)
		}
	}
	if again := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0")); len(again.Findings) != 0 {
		t.Errorf("after --fix: %+v", again.Findings)
	}
}
