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
// port order, no replicas, node timeout 2 s. It is for what must not touch
// a shared cluster (killing a master). It skips without a real
// redis-server, and returns the processes in slot order with a client.
func OwnCluster(t *testing.T, masters int) ([]*Proc, *redis.ClusterClient) {
	t.Helper()
	NeedReal(t)
	procs := make([]*Proc, masters)
	for i := range procs {
		p, err := Spawn("", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		procs[i] = p
	}
	if err := formCluster(procs); err != nil {
		t.Fatal(err)
	}
	addrs := make([]string, masters)
	for i, p := range procs {
		addrs[i] = p.Addr
	}
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	return procs, c
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
			err = c.Do(ctx, "CLUSTER", "MEET", host, port).Err()
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
