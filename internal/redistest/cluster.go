package redistest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// OwnCluster starts a Redis Cluster of the test's own: masters
// redis-servers on free loopback ports, the 16384 slots split evenly in
// order, node timeout 2 s, cluster-require-full-coverage off (a dead master
// leaves the others serving, as production clusters should be set up), and
// with replicas one replica per master. It is
// for what must not touch a shared cluster (killing a master). It skips
// without a real redis-server, and returns the masters in slot order, then
// their replicas in the same order, with a client of the masters.
func OwnCluster(t *testing.T, masters int, replicas bool) ([]*Proc, *redis.ClusterClient) {
	t.Helper()
	NeedReal(t)
	// Two at a time: these clusters lose masters and fail over on purpose,
	// and several failing over at once on a small machine, beside the
	// other tests, starve each other's failure detection.
	// (Registered first, the release runs after the cluster's cleanups.)
	ownClusters <- struct{}{}
	t.Cleanup(func() { <-ownClusters })
	n := masters
	if replicas {
		n *= 2
	}
	procs := make([]*Proc, n)
	for i := range procs {
		p, err := Spawn("", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
			"--repl-diskless-sync-delay", "0", "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
			"--loglevel", "notice") // (the failover's steps, for Proc.Log)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		procs[i] = p
	}
	if err := formCluster(procs[:masters]); err != nil {
		t.Fatal(err)
	}
	for i, r := range procs[masters:] {
		if err := addReplica(procs[:masters], procs[i], r); err != nil {
			t.Fatal(err)
		}
	}
	if err := awaitMesh(procs, masters); err != nil {
		t.Fatal(err)
	}
	addrs := make([]string, masters)
	for i, p := range procs[:masters] {
		addrs[i] = p.Addr
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return procs, c
}

// ownClusters lets two tests at a time own a cluster.
var ownClusters = make(chan struct{}, 2)

// addReplica makes r a replica of master, introduced to every one of
// masters, and waits until it has synchronised with its master.
//
// Introduced to one seed alone, a replica learns the other nodes, and
// they learn it, only by gossip, which on a loaded machine takes seconds:
// a test that killed the seed, its master, before then left a replica
// that knew no live node and that no live node knew. Its election could
// not be won, and once it was made to take over (CLUSTER FAILOVER
// TAKEOVER) its claim of the slots reached no one: it said it was the
// master while every other node (and so the client) still gave the slots
// to the dead one, and a client that loaded the slot map from it found
// the other masters' slots on no node.
func addReplica(masters []*Proc, master, r *Proc) error {
	ctx := context.Background()
	mc := redis.NewClient(&redis.Options{Addr: master.Addr})
	defer mc.Close()
	id, err := mc.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		return err
	}
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer rc.Close()
	for _, m := range masters {
		host, port, _ := strings.Cut(m.Addr, ":")
		if err := rc.Do(ctx, "CLUSTER", "MEET", host, port, m.Bus).Err(); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	replicating := false
	for { // gossip and replication have no signal to wait on
		var err error
		if !replicating { // until the replica has learnt the master's ID by gossip
			err = rc.Do(ctx, "CLUSTER", "REPLICATE", id).Err()
			replicating = err == nil
		}
		info, _ := rc.Info(ctx, "replication").Result()
		if replicating && strings.Contains(info, "master_link_status:up") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replica %s of %s: %v %q", r.Addr, master.Addr, err, info)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// formCluster gives each node its share of the slots, introduces them to
// each other, and waits until every node says the cluster is ok.
func formCluster(procs []*Proc) error {
	ctx := context.Background()
	per := 16384 / len(procs)
	for i, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		last := (i+1)*per - 1
		if i == len(procs)-1 {
			last = 16383
		}
		err := c.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", i*per, last).Err()
		if err == nil && i > 0 {
			host, port, _ := strings.Cut(procs[0].Addr, ":")
			err = c.Do(ctx, "CLUSTER", "MEET", host, port, procs[0].Bus).Err()
		}
		_ = c.Close()
		if err != nil {
			return fmt.Errorf("cluster node %s: %w", p.Addr, err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		for {
			info, err := c.ClusterInfo(ctx).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d", len(procs))) {
				break
			}
			if time.Now().After(deadline) {
				_ = c.Close()
				return fmt.Errorf("cluster node %s never ok: %v %q", p.Addr, err, info)
			}
			time.Sleep(50 * time.Millisecond) // gossip has no signal to wait on
		}
		_ = c.Close()
	}
	return nil
}

// awaitMesh waits until every node of procs (masters first, then a
// replica of each in the same order) knows every other one as what it is,
// each link connected, none failing or in handshake, and says the cluster
// is ok: until a master can be killed and its replica promoted with the
// whole cluster hearing of it (see addReplica).
func awaitMesh(procs []*Proc, masters int) error {
	ctx := context.Background()
	ids := make([]string, len(procs))
	for i, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		_ = c.Close()
		if err != nil {
			return fmt.Errorf("cluster node %s: %w", p.Addr, err)
		}
		ids[i] = id
	}
	// want is what a node's CLUSTER NODES must say of each node: its role
	// and its master ("-" for a master).
	want := map[string][2]string{}
	for i, id := range ids {
		if i < masters {
			want[id] = [2]string{"master", "-"}
		} else {
			want[id] = [2]string{"slave", ids[i-masters]}
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		for {
			nodes, err := c.ClusterNodes(ctx).Result()
			why := meshGap(nodes, want)
			if err != nil {
				why = err.Error()
			} else if why == "" {
				info, _ := c.ClusterInfo(ctx).Result()
				if !strings.Contains(info, "cluster_state:ok") {
					why = "cluster state not ok"
				}
			}
			if why == "" {
				break
			}
			if time.Now().After(deadline) {
				_ = c.Close()
				return fmt.Errorf("cluster node %s never knew the whole cluster: %s\n%s", p.Addr, why, nodes)
			}
			time.Sleep(50 * time.Millisecond) // gossip has no signal to wait on
		}
		_ = c.Close()
	}
	return nil
}

// meshGap says what CLUSTER NODES output nodes lacks of want (node ID →
// role and master ID), or "".
func meshGap(nodes string, want map[string][2]string) string {
	seen := 0
	for line := range strings.Lines(nodes) {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		w, ok := want[f[0]]
		switch flags := "," + f[2] + ","; {
		case !ok:
			return "an unknown node " + f[0]
		case !strings.Contains(flags, ","+w[0]+",") || f[3] != w[1]:
			return fmt.Sprintf("node %s is %s of %s, want %s of %s", f[1], f[2], f[3], w[0], w[1])
		case strings.Contains(flags, "fail") || strings.Contains(flags, "handshake") || strings.Contains(flags, "noaddr"):
			return fmt.Sprintf("node %s is %s", f[1], f[2])
		case f[7] != "connected":
			return fmt.Sprintf("node %s's link is %s", f[1], f[7])
		}
		seen++
	}
	if seen != len(want) {
		return fmt.Sprintf("%d nodes known of %d", seen, len(want))
	}
	return ""
}
