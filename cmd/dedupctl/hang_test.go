package main

import (
	"bufio"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// hungRedis is a TCP server that accepts connections and then answers
// nothing (answers, with pong, the handshake and PING only): a Redis that
// hangs, as one swapping, paused (CLIENT PAUSE) or behind a dead link
// does. It stops with the test.
func hungRedis(t *testing.T, pong bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				if pong {
					answerHandshake(c)
				}
				_, _ = io.Copy(io.Discard, c) // read all, answer nothing
			}()
		}
	}()
	return ln.Addr().String()
}

// answerHandshake answers a go-redis connection's handshake (HELLO as a
// Redis 5 would, CLIENT as done) and PING, until any other command, which
// it leaves unanswered.
func answerHandshake(c net.Conn) {
	r := bufio.NewReader(c)
	for {
		args, err := readCommand(r)
		if err != nil {
			return
		}
		var reply string
		switch strings.ToUpper(args[0]) {
		case "HELLO":
			reply = "-ERR unknown command 'HELLO'\r\n"
		case "CLIENT", "SELECT":
			reply = "+OK\r\n"
		case "PING":
			reply = "+PONG\r\n"
		default:
			return // hung from here on
		}
		if _, err := io.WriteString(c, reply); err != nil {
			return
		}
	}
}

// readCommand reads one RESP command (an array of bulk strings).
func readCommand(r *bufio.Reader) ([]string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "*")))
	if err != nil || n < 1 {
		return nil, io.ErrUnexpectedEOF
	}
	args := make([]string, n)
	for i := range args {
		if line, err = r.ReadString('\n'); err != nil {
			return nil, err
		}
		size, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "$")))
		if err != nil || size < 0 {
			return nil, io.ErrUnexpectedEOF
		}
		b := make([]byte, size+2)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, err
		}
		args[i] = string(b[:size])
	}
	return args, nil
}

// Every Redis call of the CLI ends with --timeout against a Redis that
// hangs, not after go-redis's ReadTimeout (3 s, and again on its retry):
// the dial's handshake and ping, the lock's reads and asynq's Inspector
// (which calls Redis without a context deadline), for show, show --task
// (which asks asynq for its queues) and lookup.
func TestHungRedisFailsWithinTheTimeout(t *testing.T) {
	const timeout = 300 * time.Millisecond
	key := "dedup:{q}:u:0123456789abcdef"
	cmds := [][]string{
		{"show", key},
		{"show", "--task", "t-1"},
		{"show", "--task", "t-1", "--queue", "q"},
		{"lookup", "--type", "t", "--field", "user_id=1"},
		{"release", "--yes", key},
		{"doctor"},
		{"list"},
	}
	for _, pong := range []bool{false, true} {
		addr := hungRedis(t, pong)
		for _, cmd := range cmds {
			start := time.Now()
			r := runCmd("", append([]string{"--url", "redis://" + addr + "/0", "--timeout", timeout.String()}, cmd...)...)
			took := time.Since(start)
			if r.code != exitError || r.stdout != "" {
				t.Errorf("%q against a hung Redis (answering PING %v): want exit 1, got %v", cmd, pong, r)
			}
			if took > timeout+time.Second {
				t.Errorf("%q against a hung Redis (answering PING %v) took %v, over --timeout %v: %s", cmd, pong, took.Round(time.Millisecond), timeout, r.stderr)
			}
			if !pong && !strings.Contains(r.stderr, "cannot reach Redis at "+addr+": timed out") {
				t.Errorf("%q against a hung Redis: want it to say it timed out, got %v", cmd, r)
			}
		}
	}
	// The same through the cluster client, whose first call asks for the
	// slots.
	addr := hungRedis(t, false)
	start := time.Now()
	r := runCmd("", "--cluster", "--url", "redis://"+addr, "--timeout", timeout.String(), "show", key)
	if took := time.Since(start); r.code != exitError || took > timeout+time.Second {
		t.Errorf("--cluster show against a hung Redis: %v after %v", r, took.Round(time.Millisecond))
	}
}
