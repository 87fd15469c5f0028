package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// TestCluster runs list, show, release and stats with --cluster against the
// Redis Cluster named by DEDUP_TEST_CLUSTER (seed host:port list, as
// ".ci/cluster.sh start" prints it), with locks in one queue per master.
// Without the variable it skips, unless DEDUP_REQUIRE_CLUSTER is set.
func TestCluster(t *testing.T) {
	seeds := os.Getenv("DEDUP_TEST_CLUSTER")
	if seeds == "" {
		if os.Getenv("DEDUP_REQUIRE_CLUSTER") != "" {
			t.Fatal("DEDUP_REQUIRE_CLUSTER is set but DEDUP_TEST_CLUSTER is not: run eval \"$(.ci/cluster.sh start)\"")
		}
		t.Skip("set DEDUP_TEST_CLUSTER=127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102 (eval \"$(.ci/cluster.sh start)\") to run against a Redis Cluster")
	}
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(seeds, ",")})
	t.Cleanup(func() { _ = rdb.Close() })

	// Map hash slots to masters, and pick one queue per master.
	slots, err := rdb.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatalf("CLUSTER SLOTS on %s: %v", seeds, err)
	}
	masterOf := func(slot int64) string {
		for _, s := range slots {
			if slot >= int64(s.Start) && slot <= int64(s.End) {
				return s.Nodes[0].Addr
			}
		}
		t.Fatalf("slot %d is not served", slot)
		return ""
	}
	masters := map[string]bool{}
	for _, s := range slots {
		masters[s.Nodes[0].Addr] = true
	}
	if len(masters) < 2 {
		t.Fatalf("want a cluster of several masters, CLUSTER SLOTS has %d", len(masters))
	}
	id := randHex(4)
	queueOn := map[string]string{} // master → queue
	for i := 0; len(queueOn) < len(masters); i++ {
		if i > 10000 {
			t.Fatal("found no queue name for every master")
		}
		q := fmt.Sprintf("cq-%s-%d", id, i)
		slot, err := rdb.ClusterKeySlot(ctx, "{"+q+"}").Result()
		if err != nil {
			t.Fatal(err)
		}
		if m := masterOf(slot); queueOn[m] == "" {
			queueOn[m] = q
		}
	}
	t.Logf("queues per master: %v", queueOn)

	f := newFixtureOn(t, rdb, "redis://"+seeds, []string{"--cluster"}, dedup.Config{})
	const perQueue = 40
	want := map[string]string{} // lock key → master
	first := map[string]*asynq.TaskInfo{}
	for m, q := range queueOn {
		for u := range perQueue {
			info := f.enqueue(q, "sync:user", u)
			want[f.lockOf(info)] = m
			if u == 0 {
				first[q] = info
			}
		}
		f.enqueue(q, "sync:user", 0, dedup.OnConflict(dedup.Replace)) // replaced into user 0
	}

	// list: every lock of every master, with the master that holds it.
	out := decode[listOutput](t, f.ok("--json", "list", "--limit", "0"))
	if out.Count != len(want) || !out.Complete {
		t.Fatalf("list --limit 0: %d locks (complete %v), want %d", out.Count, out.Complete, len(want))
	}
	for _, l := range out.Locks {
		if want[l.Key] != l.Node || l.State != "waiting" || l.TaskState != "pending" {
			t.Errorf("lock %s on %q, want on %q: %+v", l.Key, l.Node, want[l.Key], l)
		}
	}
	// Paging goes from master to master.
	seen := map[string]bool{}
	cursor, calls := "", 0
	for {
		args := []string{"--json", "list", "--limit", "25", "--count", "10"}
		if cursor != "" {
			args = append(args, "--cursor", cursor)
		}
		page := decode[listOutput](t, f.ok(args...))
		if page.Count > 25 {
			t.Fatalf("page of %d with --limit 25", page.Count)
		}
		for _, l := range page.Locks {
			seen[l.Key] = true
		}
		if page.Complete {
			break
		}
		if !strings.Contains(page.NextCursor, "/") {
			t.Fatalf("cluster cursor %q does not name a master", page.NextCursor)
		}
		cursor = page.NextCursor
		if calls++; calls > 100 {
			t.Fatal("paging does not end")
		}
	}
	for k := range want {
		if !seen[k] {
			t.Errorf("paging never listed %s", k)
		}
	}
	f.fail(exitError, "which is not a master now", "", "list", "--cursor", "127.0.0.1:1/5")
	f.fail(exitUsage, "with --cluster it is <master address>/<cursor>", "", "list", "--cursor", "5")

	// show, by key and by task ID, one per master.
	for m, q := range queueOn {
		info := first[q]
		o := decode[showOutput](t, f.ok("--json", "show", f.lockOf(info)))
		if o.Node != m || !o.HolderTask.Exists || o.HolderTask.State != "pending" || o.Folds != 1 {
			t.Errorf("show on %s: %+v %+v", m, o.Info, o.HolderTask)
		}
		o = decode[showOutput](t, f.ok("--json", "show", "--task", info.ID))
		if o.Key != f.lockOf(info) || o.TaskRole != "holder" {
			t.Errorf("show --task on %s: %+v", m, o.Info)
		}
	}

	// An orphaned lock.
	var q0 string
	for _, q := range queueOn {
		q0 = q
	}
	orphan := f.orphaned(q0, "email:welcome", 1)
	r := f.ok("show", f.lockOf(orphan))
	if !strings.Contains(r.stdout, "missing (the lock is orphaned; it heals at the next enqueue)") {
		t.Errorf("show orphaned on the cluster:\n%s", r.stdout)
	}

	// stats, after a flush.
	if err := f.d.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	st := decode[statsOutput](t, f.ok("--json", "stats"))
	if st.Types["sync:user"]["locked"] != uint64(len(want)) || st.Types["sync:user"]["replaced"] != uint64(len(queueOn)) ||
		st.Locks.Total != len(want)+1 || st.Locks.ByState["orphaned"] != 1 || len(st.Top) != len(queueOn) {
		t.Errorf("stats on the cluster: %+v", st)
	}

	// release: declined, then one per master with --yes.
	f.fail(exitError, "not released: not confirmed", "n\n", "release", f.lockOf(first[q0]))
	keys := make([]string, 0, len(first))
	for _, info := range first {
		keys = append(keys, f.lockOf(info))
	}
	sort.Strings(keys)
	for _, k := range keys {
		if r := f.ok("release", "--yes", k); !strings.HasPrefix(r.stdout, "released "+k) {
			t.Errorf("release %s: %v", k, r)
		}
		if f.exists(k) {
			t.Errorf("%s still there after release", k)
		}
	}
	f.fail(exitError, "no such lock", "", "release", "--yes", keys[0])
	if out := decode[listOutput](t, f.ok("--json", "list", "--limit", "0", "--type", "sync:user")); out.Count != len(want)-len(keys) {
		t.Errorf("after releasing %d: %d locks, want %d", len(keys), out.Count, len(want)-len(keys))
	}

	// doctor, on every master: one lost task per queue (its pending list
	// dropped it), and the orphan; --fix releases exactly those.
	lostKeys := map[string]bool{f.lockOf(orphan): true}
	for _, q := range queueOn {
		info := f.enqueue(q, "sync:user", 1000)
		if err := rdb.LRem(ctx, "asynq:{"+q+"}:pending", 0, info.ID).Err(); err != nil {
			t.Fatal(err)
		}
		lostKeys[f.lockOf(info)] = true
	}
	fixed := decode[doctorOutput](t, f.ok("--json", "doctor", "--grace", "0", "--fix"))
	if fixed.Released != len(lostKeys) || len(fixed.Findings) != len(lostKeys) || fixed.Checked != len(want)-len(keys)+len(lostKeys) {
		t.Errorf("doctor --fix on the cluster: checked %d, released %d: %+v", fixed.Checked, fixed.Released, fixed.Findings)
	}
	for k := range lostKeys {
		if f.exists(k) {
			t.Errorf("%s still there after doctor --fix", k)
		}
	}
}
