package dedup

import (
	"fmt"
)

// Adversarial tests, round 10, on the worker's Redis calls, through the
// public API on a real asynq server and redis-server. Each test quotes the
// promise it attacks.

var _ = fmt.Sprint
