package dedup

import (
	"errors"
	"fmt"
	"maps"
	"testing"

	"github.com/hibiken/asynq"
)

// The root package's tests run on asynq v0.26.0, which has everything
// compat.go looks for; internal/versions runs on the versions without.

func TestAsynqFeaturesAreFoundOnV026(t *testing.T) {
	if !hasHeaders() || !hasRevoke() {
		t.Fatalf("asynq v0.26.0: headers %v, RevokeTask %v; want both found", hasHeaders(), hasRevoke())
	}
	if _, ok := taskOptsOffset(); !ok {
		t.Fatal("asynq.Task's opts field not found")
	}
}

func TestRevokeIsFoundThroughWrapping(t *testing.T) {
	for err, want := range map[error]bool{
		asynq.RevokeTask:                         true,
		fmt.Errorf("stop: %w", asynq.RevokeTask): true,
		errors.Join(errors.New("a"), fmt.Errorf("b: %w", asynq.RevokeTask)): true,
		errors.New("revoke task"): false, // a look-alike: asynq retries it
		asynq.SkipRetry:           false,
		nil:                       false,
	} {
		if got := isRevoke(err); got != want {
			t.Errorf("isRevoke(%v) = %v, want %v", err, got, want)
		}
	}
}

func TestTaskHeadersRoundTripThroughCompat(t *testing.T) {
	h := map[string]string{"a": "1", "b": "2"}
	task := newTask("typ", []byte("p"), h, asynq.MaxRetry(3))
	if got := taskHeaders(task); !maps.Equal(got, h) {
		t.Fatalf("headers %v, want %v", got, h)
	}
	h["a"] = "changed"
	if taskHeaders(task)["a"] != "1" {
		t.Fatal("the task shares the caller's map")
	}
	if opts, _ := taskOpts(task); len(opts) != 1 {
		t.Fatalf("options %v, want MaxRetry(3)", opts)
	}
	ti := &asynq.TaskInfo{}
	setInfoHeaders(ti, h)
	if !maps.Equal(ti.Headers, h) {
		t.Fatalf("TaskInfo.Headers %v, want %v", ti.Headers, h)
	}
}
