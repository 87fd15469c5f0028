// Package versions holds the tests of the promises this module keeps on
// every asynq version it builds against (v0.24.1, v0.25.1, v0.26.0;
// docs/versions.md). They use only what all of those versions have, so CI
// runs them against each; the root package's tests run on v0.26.0.
package versions

import (
	"os"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "versions")) }
