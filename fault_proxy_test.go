package dedup

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// A TCP proxy in a process of its own (this test binary, re-executed), so a
// fault test can SIGKILL the path from a Dedup to Redis while asynq's
// clients talk to the same Redis directly: locks and tasks stay in one
// Redis, as the library requires, and only the lock calls lose it.

const faultProxyEnv = "DEDUP_FAULT_PROXY" // "listen>target" in the child

// runFaultProxy forwards every connection on listen to target until killed.
func runFaultProxy(spec string) error {
	listen, target, ok := strings.Cut(spec, ">")
	if !ok {
		return fmt.Errorf("bad %s %q", faultProxyEnv, spec)
	}
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer c.Close()
			up, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer up.Close()
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			_, _ = io.Copy(c, up)
		}()
	}
}

// proxyProc is a running proxy process.
type proxyProc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startFaultProxy starts a proxy process listening on listen ("" for a
// free loopback port) and returns it once the port accepts connections.
func startFaultProxy(t *testing.T, listen, target string) (*proxyProc, string) {
	t.Helper()
	if listen == "" {
		var err error
		if listen, err = freeAddr(); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.count=1")
	cmd.Env = append(os.Environ(), faultProxyEnv+"="+listen+">"+target)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start proxy: %v", err)
	}
	p := &proxyProc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(p.kill)
	faultPoll(t, 10*time.Second, "proxy listening", func() bool {
		c, err := net.DialTimeout("tcp", listen, 100*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return p, listen
}

// kill sends SIGKILL and waits until the process is gone; every connection
// through it dies with it.
func (p *proxyProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}
