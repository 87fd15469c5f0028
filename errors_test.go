package dedup

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Every invalid rule is reported in one order, the sentinel first, then
// the rule, then what is wrong with it, and still matches ErrInvalidOption.
func TestRuleErrorsNameTheSentinelFirst(t *testing.T) {
	for name, r := range map[string]Rule{
		"bad field path":   {Fields: []string{"a..b"}},
		"negative TTL":     {TTL: -time.Second},
		"cooldown + allow": {Cooldown: time.Minute, OnRunning: RunningAllow},
		"merge, no func":   {OnConflict: Merge},
	} {
		_, err := compileRules(map[string]Rule{"report:build": r})
		if !errors.Is(err, ErrInvalidOption) {
			t.Fatalf("%s: %v, want ErrInvalidOption", name, err)
		}
		msg := err.Error()
		if want := `dedup: invalid option: rule for "report:build": `; !strings.HasPrefix(msg, want) {
			t.Errorf("%s: %q, want it to begin %q", name, msg, want)
		}
		if strings.Count(msg, "dedup:") != 1 {
			t.Errorf("%s: %q names the package twice", name, msg)
		}
	}
}

// Errors: "Errors this package makes match one of them with errors.Is
// and wrap their cause; errors … from a function you gave (MergeFunc,
// KeyFunc) are returned wrapped"; bad input gets ErrInvalidOption "before
// any lock is taken"; "a merge that changes the key's fields is refused
// (ErrInvalidPayload)"; Release "(else ErrNotHolder)"; nothing locked or
// enqueued for any of them.
func TestErrorsMatchTheirSentinels(t *testing.T) {
	errKeyFunc := errors.New("a6: key func failed")
	errMerge := errors.New("a6: merge failed")
	cfg := Config{Rules: map[string]Rule{
		"a6:keyfunc": {KeyFunc: func(string, []byte) (string, error) { return "", errKeyFunc }},
		"a6:defer":   {Fields: []string{"key"}, OnRunning: RunningDefer},
		"counter":    {Fields: []string{"key"}},
	}}
	h := newHarness(t, cfg)
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	p := []byte(`{"key":"k","n":1,"seq":1}`)
	cases := []struct {
		name string
		call func() error
		want []error
	}{
		{"Fields()", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields()); return err }, []error{ErrInvalidOption}},
		{"Fields(\"\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields("")); return err }, []error{ErrInvalidOption}},
		{"Fields(\"a..b\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Fields("a..b")); return err }, []error{ErrInvalidOption}},
		{"Key twice, different", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, Key("a"), Key("b"))
			return err
		}, []error{ErrInvalidOption}},
		{"SharedKey then Key", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, SharedKey("a"), Key("a"))
			return err
		}, []error{ErrInvalidOption}},
		{"Key(\"\")", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Key("")); return err }, []error{ErrInvalidOption}},
		{"TTL(0)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, TTL(0)); return err }, []error{ErrInvalidOption}},
		{"Cooldown(-1)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Cooldown(-1)); return err }, []error{ErrInvalidOption}},
		{"OnConflict(9)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, OnConflict(9)); return err }, []error{ErrInvalidOption}},
		{"MergeWith(nil)", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, MergeWith(nil)); return err }, []error{ErrInvalidOption}},
		{"OnConflict(Replace) then MergeWith", func() error {
			_, err := h.client.Enqueue(counterTask("k", 1, 1), q, OnConflict(Replace), MergeWith(addMerge))
			return err
		}, []error{ErrInvalidOption}},
		{"Debounce with Reject", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, Debounce(time.Second)); return err }, []error{ErrInvalidOption}},
		{"Cooldown on a RunningDefer type", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("a6:defer", p), q, Cooldown(time.Hour))
			return err
		}, []error{ErrInvalidOption}},
		{"Debounce on a RunningDefer type", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("a6:defer", p), q, OnConflict(Replace), Debounce(time.Second))
			return err
		}, []error{ErrInvalidOption}},
		{"Group in the call", func() error { _, err := h.client.Enqueue(counterTask("k", 1, 1), q, asynq.Group("g")); return err }, []error{ErrInvalidOption}},
		{"KeyFunc error", func() error { _, err := h.client.Enqueue(asynq.NewTask("a6:keyfunc", p), q); return err }, []error{ErrInvalidPayload, errKeyFunc}},
		{"not JSON", func() error { _, err := h.client.Enqueue(asynq.NewTask("counter", []byte("{nope")), q); return err }, []error{ErrInvalidPayload}},
		{"field missing", func() error { _, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"n":1}`)), q); return err }, []error{ErrInvalidPayload, ErrFieldMissing}},
		{"huge exponent", func() error {
			_, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"key":1e1000000001}`)), q)
			return err
		}, []error{ErrInvalidPayload}},
		{"Lookup with Skip", func() error { _, _, err := h.d.Lookup(ctx, counterTask("k", 1, 1), q, Skip()); return err }, []error{ErrInvalidOption}},
		{"Lookup, blank queue", func() error { _, _, err := h.d.Lookup(ctx, counterTask("k", 1, 1), asynq.Queue(" ")); return err }, []error{ErrInvalidOption}},
		{"Release, not JSON", func() error {
			_, err := h.d.Release(ctx, asynq.NewTask("counter", []byte("x")), "", q)
			return err
		}, []error{ErrInvalidPayload}},
		{"WaitHolder(nil)", func() error { _, err := h.d.WaitHolder(ctx, nil); return err }, []error{ErrInvalidOption}},
		{"New, brace in prefix", func() error { _, err := New(ctx, h.rdb, Config{Prefix: "a{b"}); return err }, []error{ErrInvalidOption}},
		{"New, Merge rule without MergeFunc", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnConflict: Merge}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, negative Debounce", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnConflict: Replace, Debounce: -time.Second}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, unknown OnBusy", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {OnBusy: 7}}})
			return err
		}, []error{ErrInvalidOption}},
		{"New, blank rule name", func() error {
			_, err := New(ctx, h.rdb, Config{Rules: map[string]Rule{" ": {}}})
			return err
		}, []error{ErrInvalidOption}},
	}
	for _, c := range cases {
		err := c.call()
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		for _, w := range c.want {
			if !errors.Is(err, w) {
				t.Errorf("%s: %v does not match %v", c.name, err, w)
			}
		}
		if errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v matches ErrUnavailable: Redis is fine", c.name, err)
		}
	}
	if l := h.locks(); len(l) != 0 {
		t.Errorf("locks left by refused calls: %v", l)
	}
	if n := h.queueSize(h.queue); n != 0 {
		t.Errorf("%d tasks stored by refused calls", n)
	}
	// With a holder: merge errors, a merge that changes the key, a wrong holder.
	holder := h.enqueue(counterTask("k", 1, 1))
	_, err := h.client.Enqueue(counterTask("k", 2, 2), q, MergeWith(func(_, _ []byte) ([]byte, error) { return nil, errMerge }))
	if !errors.Is(err, errMerge) {
		t.Errorf("MergeFunc's error: %v, want it wrapped", err)
	}
	_, err = h.client.Enqueue(counterTask("k", 2, 2), q, MergeWith(func(_, _ []byte) ([]byte, error) { return []byte(`{"key":"other"}`), nil }))
	if !errors.Is(err, ErrInvalidPayload) {
		t.Errorf("merge that changes the key: %v, want ErrInvalidPayload", err)
	}
	if _, err := h.d.Release(ctx, counterTask("k", 1, 1), "not-the-holder", q); !errors.Is(err, ErrNotHolder) {
		t.Errorf("Release with a wrong holder: %v, want ErrNotHolder", err)
	}
	if _, err := h.client.Enqueue(counterTask("k", 1, 3), q); !errors.Is(err, ErrDuplicateTask) || !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Errorf("duplicate: %v", err)
	}
	ti, err := h.insp.GetTaskInfo(h.queue, holder.ID)
	if err != nil || string(ti.Payload) != string(counterTask("k", 1, 1).Payload()) {
		t.Errorf("the holder's payload changed after refused merges: %v %v", ti, err)
	}
}

// Errors: "ErrUnavailable reports that Redis could not be reached";
// "ErrOutcomeUnknown reports an enqueue that may or may not have stored
// its task: a lock call that carried the task … failed after it was sent";
// "errors … from the context … are returned wrapped". A call whose context
// was cancelled before it was made reached no Redis: it is the caller's
// cancellation, not an outage and not an unknown outcome.
func TestCancelledCallIsNotAnOutage(t *testing.T) {
	bothPaths(t, counterRules(Rule{}), func(t *testing.T, h *harness) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := h.client.Submit(ctx, counterTask("k", 1, 1), asynq.Queue(h.queue))
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled call: %v, want context.Canceled wrapped", err)
		}
		if errors.Is(err, ErrOutcomeUnknown) {
			t.Errorf("cancelled call: %v matches ErrOutcomeUnknown, but it never reached Redis", err)
		}
		if errors.Is(err, ErrUnavailable) {
			t.Errorf("cancelled call: %v matches ErrUnavailable, but Redis is up", err)
		}
		if n := h.queueSize(h.queue); n != 0 {
			t.Errorf("%d tasks stored by a cancelled call", n)
		}
	})
}

// Rule errors read `dedup: invalid option: rule for "x": …` and match
// ErrInvalidOption: every way a Rule can be invalid, with a type name that
// needs quoting.
func TestRuleErrorsNameTheRuleAndMatchErrInvalidOption(t *testing.T) {
	h := newHarness(t, Config{})
	merge := func(_, b []byte) ([]byte, error) { return b, nil }
	many := make([]string, 65) // above jsonkey.MaxFields (64)
	for i := range many {
		many[i] = fmt.Sprintf("f%d", i)
	}
	typ := "a11:\"odd\"\nname"
	for i, r := range []Rule{
		{Fields: []string{""}},
		{Fields: []string{"a..b"}},
		{Fields: many},
		{TTL: -time.Second},
		{MaxPending: -1},
		{OnConflict: 99},
		{OnRunning: 99},
		{OnBusy: 99},
		{OnConflict: Merge},
		{MergeFunc: merge},
		{Cooldown: -time.Second},
		{Cooldown: time.Hour, OnRunning: RunningAllow},
		{Debounce: time.Second},
		{Debounce: time.Second, OnConflict: Replace, OnRunning: RunningDefer},
	} {
		_, err := New(context.Background(), h.rdb, Config{Prefix: h.prefix, Logger: quietLogger(), Rules: map[string]Rule{typ: r}})
		want := fmt.Sprintf("dedup: invalid option: rule for %q: ", typ)
		switch {
		case err == nil:
			t.Errorf("%d: %+v accepted", i, r)
		case !errors.Is(err, ErrInvalidOption):
			t.Errorf("%d: %v does not match ErrInvalidOption", i, err)
		case !strings.HasPrefix(err.Error(), want) || strings.Count(err.Error(), "invalid option") != 1 || strings.HasSuffix(err.Error(), ": "):
			t.Errorf("%d: %q, want %q…", i, err, want)
		}
	}
}

// A lock call (an enqueue, Lookup, Release, Client.Ping) while Redis
// refuses connections (the server is gone) sent nothing: it is ErrUnavailable, not ErrOutcomeUnknown; it says why
// ("connection refused"), keeps the dial error for errors.As, and comes
// back well within LockTimeout, before and after the breaker opens; with
// the caller's client (ContextTimeoutEnabled) and with the library's own
// copy of it alike.
func TestLockCallsWithRedisRefusingConnectionsAreUnavailableAndSayWhy(t *testing.T) {
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", shared), func(t *testing.T) {
			p, rdb := ownRedis(t, func(o *redis.Options) { o.ContextTimeoutEnabled = shared })
			d, err := New(context.Background(), rdb, Config{Logger: quietLogger()}) // LockTimeout 1 s, breaker after 5 failures
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Close() })
			c, q := d.NewClient(), asynq.Queue("q-"+uniq(t))
			if _, err := c.Enqueue(userTask(0, ""), q); err != nil {
				t.Fatal(err) // warm: the queue is registered, connections pooled
			}
			p.Kill() // nothing listens on its port now
			ctx := context.Background()
			calls := []struct {
				name string
				call func(i int) error
			}{
				{"enqueue", func(i int) error { _, err := c.Enqueue(userTask(i, ""), q); return err }},
				{"Lookup", func(i int) error { _, _, err := d.Lookup(ctx, userTask(i, ""), q); return err }},
				{"Release", func(i int) error { _, err := d.Release(ctx, userTask(i, ""), "", q); return err }},
				{"Client.Ping", func(int) error { return c.Ping() }},
			}
			for i := 1; i <= 8; i++ {
				op := calls[(i-1)%len(calls)]
				start := time.Now()
				err := op.call(i)
				took := time.Since(start)
				var dial *net.OpError
				switch {
				case !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown):
					t.Fatalf("%s %d: %v, want ErrUnavailable and not ErrOutcomeUnknown: nothing can have been sent", op.name, i, err)
				case !strings.Contains(err.Error(), "connection refused"):
					t.Fatalf("%s %d: %q does not say the connection was refused", op.name, i, err)
				case !errors.As(err, &dial) || dial.Op != "dial":
					t.Fatalf("%s %d: %v does not keep the dial error (got %#v)", op.name, i, err, dial)
				case strings.Count(err.Error(), "dedup:") != 1:
					t.Fatalf("%s %d: %q names the package more than once", op.name, i, err)
				case took > defaultLockTimeout/2:
					t.Fatalf("%s %d answered after %v: a refused connection is known at once, not at LockTimeout (%v)", op.name, i, took, defaultLockTimeout)
				}
				t.Logf("%s %d: %v after %v", op.name, i, err, took.Round(time.Millisecond))
			}
		})
	}
}

// An enqueue that Redis refuses to authenticate (the password changed)
// sent nothing: it is ErrUnavailable, not ErrOutcomeUnknown, says
// "redis refused authentication" with Redis's own reply, keeps that reply
// for errors.As, and comes back at once.
func TestEnqueueWithAWrongPasswordIsUnavailableAndNamesAuthentication(t *testing.T) {
	_, rdb := ownRedis(t, nil, "--requirepass", "old-secret")
	admin := redis.NewClient(rdb.Options())
	t.Cleanup(func() { _ = admin.Close() })
	ctx := context.Background()
	d, err := New(ctx, rdb, Config{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	c, q := d.NewClient(), asynq.Queue("q-"+uniq(t))
	if _, err := c.Enqueue(userTask(0, ""), q); err != nil {
		t.Fatal(err)
	}
	// The password changes, and every connection but the admin's is cut:
	// the Dedup's next connections log in with the old one.
	if err := admin.ConfigSet(ctx, "requirepass", "new-secret").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		start := time.Now()
		_, err := c.Enqueue(userTask(i, ""), q)
		took := time.Since(start)
		var re redis.Error
		switch {
		case !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown):
			t.Fatalf("enqueue %d: %v, want ErrUnavailable and not ErrOutcomeUnknown", i, err)
		case !strings.HasPrefix(err.Error(), "dedup: redis refused authentication: WRONGPASS"):
			t.Fatalf("enqueue %d: %q, want it to begin \"dedup: redis refused authentication: WRONGPASS\"", i, err)
		case !errors.As(err, &re) || !strings.HasPrefix(re.Error(), "WRONGPASS"):
			t.Fatalf("enqueue %d: %v does not keep Redis's reply", i, err)
		case took > defaultLockTimeout/2:
			t.Fatalf("enqueue %d answered after %v", i, took)
		}
	}
}

// Every error this package makes names it once, at the start of its text
// ("dedup: "), whatever it wraps, and still matches its sentinels (and its
// causes) with errors.Is.
func TestErrorTextsNameThePackageOnce(t *testing.T) {
	t.Parallel()
	cfg := counterRules(Rule{})
	cfg.Rules["cron:job"] = Rule{OnRunning: RunningAllow}
	h := newHarness(t, cfg)
	ctx := context.Background()
	q := asynq.Queue(h.queue)
	check := func(name string, err error, want ...error) {
		t.Helper()
		t.Logf("%s: %v", name, err)
		switch {
		case err == nil:
			t.Errorf("%s: no error", name)
			return
		case !strings.HasPrefix(err.Error(), "dedup: ") || strings.Count(err.Error(), "dedup:") != 1:
			t.Errorf("%s: %q, want \"dedup: \" once, at the start", name, err)
		}
		for _, w := range want {
			if !errors.Is(err, w) {
				t.Errorf("%s: %v does not match %v", name, err, w)
			}
		}
	}
	_, err := h.client.Enqueue(asynq.NewTask("counter", []byte(`{"n":1}`)), q)
	check("field missing", err, ErrInvalidPayload, ErrFieldMissing)
	var pe *PayloadError
	if errors.As(err, &pe) && err.Error() != `dedup: task "counter": field "key": selected field missing` {
		t.Errorf("field missing: %q", err)
	}
	_, err = h.client.Enqueue(asynq.NewTask("counter", []byte(`{nope`)), q)
	check("not JSON", err, ErrInvalidPayload)
	_, err = h.client.Enqueue(counterTask("k", 1, 1), q, Key(""))
	check("Key(\"\")", err, ErrInvalidOption)
	_, err = h.client.Enqueue(asynq.NewTask("counter", []byte(`{"key":"k"}`), Key("")), q)
	check("Key(\"\") given to NewTask", err, ErrInvalidOption)
	_, err = New(ctx, h.rdb, Config{Rules: map[string]Rule{"x": {TTL: -1}}})
	check("negative TTL", err, ErrInvalidOption)
	s := NewScheduler(h.d, nil)
	_, err = s.Register("@every 1m", asynq.NewTask("cron:job", nil))
	check("Scheduler.Register of a RunningAllow type", err, ErrInvalidOption)
	h.enqueue(counterTask("k", 1, 1))
	_, err = h.client.Enqueue(counterTask("k", 1, 2), q)
	check("duplicate", err, ErrDuplicateTask, asynq.ErrDuplicateTask)
	check("busy", &BusyError{TaskID: "a", Holder: "b"}, ErrKeyBusy)

	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { _ = dead.Close() })
	_, err = New(ctx, dead, Config{connectAttempts: 1, Logger: quietLogger()})
	check("New, nothing listening", err, ErrUnavailable)
	var op *net.OpError
	if !errors.As(err, &op) {
		t.Errorf("New, nothing listening: %v does not keep the dial error", err)
	}

	// A stalled Redis: a direct-path call that carried its task times out
	// (outcome unknown), and the breaker (threshold 1) then opens.
	proxy, d, hh := hungDedup(t, Config{BreakerThreshold: 1}, func(o *redis.Options) { o.MaxRetries = -1 })
	t.Cleanup(func() { _ = d.Close() })
	c := d.NewClient()
	if _, err := c.Enqueue(userTask(0, ""), asynq.Queue(hh.queue)); err != nil {
		t.Fatal(err)
	}
	proxy.stall()
	defer proxy.resume()
	_, err = c.Enqueue(userTask(1, ""), asynq.Queue(hh.queue))
	check("outcome unknown", err, ErrOutcomeUnknown, ErrUnavailable, context.DeadlineExceeded)
	_, err = c.Enqueue(userTask(2, ""), asynq.Queue(hh.queue))
	check("circuit open", err, ErrCircuitOpen, ErrUnavailable)
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = d.WaitResult(wctx, hh.queue, "some-task")
	check("WaitResult while Redis stalls", err, context.DeadlineExceeded)
}

// A call that is not deduplicated (OptIn without a rule, dedup.Skip) goes
// to asynq as it would, and its errors keep the package's contract: Redis
// refusing connections is ErrUnavailable, named once, saying why; asynq's
// own answers (a task ID in use) stay matchable.
func TestEnqueueNotDeduplicatedKeepsTheErrorContract(t *testing.T) {
	t.Parallel()
	p, rdb := ownRedis(t, func(o *redis.Options) { o.ContextTimeoutEnabled = true })
	d, err := New(context.Background(), rdb, Config{OptIn: true, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	c, q := d.NewClient(), asynq.Queue("q-"+uniq(t))
	id := asynq.TaskID("id-" + uniq(t))
	if _, err := c.Enqueue(userTask(0, ""), q, id); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Enqueue(userTask(0, ""), q, id); !errors.Is(err, asynq.ErrTaskIDConflict) || strings.Count(err.Error(), "dedup:") != 1 {
		t.Errorf("a task ID in use: %v, want asynq.ErrTaskIDConflict, named once", err)
	}
	p.Kill()
	for _, opts := range [][]asynq.Option{{q}, {q, Skip()}} {
		_, err := c.Enqueue(userTask(1, ""), opts...)
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "connection refused") || strings.Count(err.Error(), "dedup:") != 1 {
			t.Errorf("not deduplicated, Redis refusing connections: %v, want ErrUnavailable saying why, naming the package once", err)
		}
	}
}
