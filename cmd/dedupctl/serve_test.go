package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
)

// dedupctl serve, as a real process: it serves the lock browser on the
// address given, shows a lock, refuses a release (read-only by default),
// and stops cleanly on SIGINT.
func TestServeShowsLocksReadOnlyAndStopsOnSIGINT(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info, err := f.client.EnqueueContext(context.Background(), asynq.NewTask("email:serve", []byte(`{"u":1}`)), asynq.Queue(f.qa))
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "dedupctl")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	addr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append(append([]string{}, f.flags...), "serve", "--listen", addr)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	line, err := bufio.NewReader(stdout).ReadString('\n') // the address line: it listens
	if err != nil || !strings.Contains(line, "http://"+addr+"/ (read-only") {
		t.Fatalf("first line %q (%v), want the address and read-only", line, err)
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()

	page := get(t, "http://"+addr+"/lock?key="+url.QueryEscape(f.lockOf(info)))
	if !strings.Contains(page, info.ID) || !strings.Contains(page, "email:serve") {
		t.Errorf("the lock page does not show the lock's holder %s and type", info.ID)
	}
	res, err := http.PostForm("http://"+addr+"/release", url.Values{"key": {f.lockOf(info)}})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusForbidden || !strings.Contains(string(body), "read-only") || !f.exists(f.lockOf(info)) {
		t.Errorf("a release POST to a read-only serve: status %d, lock there %v; want 403 for read-only and the lock kept", res.StatusCode, f.exists(f.lockOf(info)))
	}

	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve after SIGINT: %v, want exit 0", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop within 20 s of SIGINT")
	}
}

func get(t *testing.T, u string) string {
	t.Helper()
	res, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", u, res.StatusCode, err)
	}
	return string(b)
}
