package redistest

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) { os.Exit(Main(m, "redistest")) }

// go-redis's complaint about a refused connection lands in Quiet, not in
// the test output.
func TestGoRedisLogsAreKeptOutOfTheOutput(t *testing.T) {
	if os.Getenv(LogEnv) != "" {
		t.Skipf("%s is set: go-redis logs to stderr", LogEnv)
	}
	before := Quiet.Lines()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", DialTimeout: 100 * time.Millisecond, MaxRetries: -1, MinIdleConns: 1})
	defer c.Close()
	if err := c.Ping(context.Background()).Err(); err == nil {
		t.Fatal("ping of 127.0.0.1:1 succeeded")
	}
	Eventually(t, "go-redis logging into Quiet (not stderr)", func() bool { return Quiet.Lines() > before })
}
