package redistest

import (
	"context"
	"fmt"
	"strings"
	"sync"
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
	// One at a time: these clusters lose masters and fail over on purpose,
	// and several failing over at once on a small machine (with the other
	// tests beside them) left a promoted cluster unrecovered for a minute.
	// (Registered first, the unlock runs after the cluster's cleanups.)
	ownClusters.Lock()
	t.Cleanup(ownClusters.Unlock)
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
		if err := addReplica(procs[0], procs[i], r); err != nil {
			t.Fatal(err)
		}
	}
	addrs := make([]string, masters)
	for i, p := range procs[:masters] {
		addrs[i] = p.Addr
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return procs, c
}

// ownClusters runs the tests that own a cluster one at a time.
var ownClusters sync.Mutex

// addReplica makes r a replica of master, introduced through seed, and
// waits until it has synchronised with its master.
func addReplica(seed, master, r *Proc) error {
	ctx := context.Background()
	mc := redis.NewClient(&redis.Options{Addr: master.Addr})
	defer mc.Close()
	id, err := mc.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		return err
	}
	rc := redis.NewClient(&redis.Options{Addr: r.Addr})
	defer rc.Close()
	host, port, _ := strings.Cut(seed.Addr, ":")
	if err := rc.Do(ctx, "CLUSTER", "MEET", host, port, seed.Bus).Err(); err != nil {
		return err
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
