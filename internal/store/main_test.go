package store

import (
	"os"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

func TestMain(m *testing.M) {
	os.Setenv(CheckKeysEnv, "1") // every script refuses a key it was not given
	os.Exit(redistest.Main(m, "store"))
}
