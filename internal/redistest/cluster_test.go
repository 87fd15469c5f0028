package redistest

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// OwnCluster returns a cluster whose every node knows every other, as what
// it is: a test may kill any master at once, and its replica's promotion
// reaches the whole cluster (addReplica).
func TestOwnClusterIsFullyMeshed(t *testing.T) {
	procs, _ := OwnCluster(t, 3, true)
	ctx := context.Background()
	want := map[string][2]string{}
	ids := make([]string, len(procs))
	for i, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		_ = c.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = id
		if i < 3 {
			want[id] = [2]string{"master", "-"}
		} else {
			want[id] = [2]string{"slave", ids[i-3]}
		}
	}
	for _, p := range procs {
		c := redis.NewClient(&redis.Options{Addr: p.Addr})
		nodes, err := c.ClusterNodes(ctx).Result()
		_ = c.Close()
		if err != nil {
			t.Fatal(err)
		}
		if gap := meshGap(nodes, want); gap != "" {
			t.Errorf("node %s, as OwnCluster returns: %s\n%s", p.Addr, gap, nodes)
		}
	}
}
