package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Deduplicate on one payload field; a duplicate names the task holding the key.
func Example() {
	mr, _ := miniredis.Run() // any Redis: a single node, Sentinel or Cluster client
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()

	d, err := dedup.New(ctx, rdb, dedup.Config{})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	client := d.WrapClient(asynq.NewClientFromRedisClient(rdb))

	first := asynq.NewTask("user:reindex", []byte(`{"user_id": 42, "trace_id": "a1"}`))
	info, err := client.EnqueueContext(ctx, first, asynq.Queue("critical"), dedup.Fields("user_id"))
	fmt.Println("first enqueued:", err == nil)

	// Other trace ID, other spelling of 42: the same work.
	again := asynq.NewTask("user:reindex", []byte(`{"trace_id":"b2","user_id":42.0}`))
	_, err = client.EnqueueContext(ctx, again, asynq.Queue("critical"), dedup.Fields("user_id"))
	var dup *dedup.DuplicateTaskError
	if errors.As(err, &dup) {
		fmt.Println("duplicate of the first:", dup.Holder == info.ID, "in queue", dup.Queue)
	}
	fmt.Println("matches asynq.ErrDuplicateTask:", errors.Is(err, asynq.ErrDuplicateTask))

	other := asynq.NewTask("user:reindex", []byte(`{"user_id": 7}`))
	_, err = client.EnqueueContext(ctx, other, asynq.Queue("critical"), dedup.Fields("user_id"))
	fmt.Println("user 7 enqueued:", err == nil)
	// Output:
	// first enqueued: true
	// duplicate of the first: true in queue critical
	// matches asynq.ErrDuplicateTask: true
	// user 7 enqueued: true
}

// The middleware releases the lock when the task succeeds, so the same work
// can be enqueued again.
func ExampleDedup_Middleware() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := dedup.New(ctx, rdb, dedup.Config{
		Rules:  map[string]dedup.Rule{"report:send": {Fields: []string{"tenant"}}},
		Logger: quiet,
	})
	if err != nil {
		panic(err)
	}
	client := d.WrapClient(asynq.NewClientFromRedisClient(rdb))

	done := make(chan string, 1)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:       1,
		IsFailure:         dedup.IsFailure, // busy keys are retried without using up retries
		TaskCheckInterval: 10 * time.Millisecond,
		LogLevel:          asynq.FatalLevel,
	})
	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc("report:send", func(ctx context.Context, t *asynq.Task) error {
		done <- string(t.Payload())
		return nil
	})
	if err := srv.Start(mux); err != nil {
		panic(err)
	}

	task := asynq.NewTask("report:send", []byte(`{"tenant": 7}`))
	if _, err := client.EnqueueContext(ctx, task); err != nil {
		panic(err)
	}
	fmt.Println("processed:", <-done)

	// The handler signalled before returning; the middleware releases the
	// lock just after it returns. Until then the key is (rightly) still held.
	for {
		_, err := client.EnqueueContext(ctx, task)
		if err == nil {
			break
		}
		if !errors.Is(err, dedup.ErrDuplicateTask) {
			panic(err)
		}
		time.Sleep(time.Millisecond)
	}
	fmt.Println("processed again:", <-done)
	srv.Shutdown()
	d.Close()
	// Output:
	// processed: {"tenant": 7}
	// processed again: {"tenant": 7}
}

// Mixing asynq's options with this package's in one list.
func ExampleTTL() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, _ := dedup.New(ctx, rdb, dedup.Config{})
	defer d.Close()
	var client dedup.Enqueuer = d.WrapClient(asynq.NewClientFromRedisClient(rdb))

	task := asynq.NewTask("tenant:quota", []byte(`{"tenant": 3, "at": "12:00"}`))
	info, err := client.EnqueueContext(ctx, task,
		asynq.Queue("low"), asynq.ProcessIn(time.Minute), asynq.MaxRetry(3),
		dedup.Fields("tenant"), dedup.TTL(10*time.Minute))
	if err != nil {
		panic(err)
	}
	fmt.Println(info.Queue, info.State, info.MaxRetry)
	// Output: low scheduled 3
}

// OnDecision hears each duplicate and fold (and busy arrival at the
// server), without the payload: for logs, metrics or an audit trail.
func ExampleConfig_onDecision() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()

	d, err := dedup.New(ctx, rdb, dedup.Config{
		Rules:      map[string]dedup.Rule{"profile:sync": {Fields: []string{"user_id"}, OnConflict: dedup.Replace}},
		OnDecision: func(dec dedup.Decision) { fmt.Println("decision:", dec.Event, dec.Type) },
	})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	client := d.NewClient()
	for _, v := range []string{"1", "2"} {
		task := asynq.NewTask("profile:sync", []byte(`{"user_id":42,"v":`+v+`}`))
		res, _ := client.Submit(ctx, task)
		fmt.Println("outcome:", res.Outcome)
	}
	// Output:
	// outcome: created
	// decision: replaced profile:sync
	// outcome: replaced
}

// Rule names match task types as asynq's ServeMux patterns do, and an
// explicit per-call key beats per-call fields whatever their order.
func ExampleRule_prefix() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()

	d, err := dedup.New(ctx, rdb, dedup.Config{Rules: map[string]dedup.Rule{
		"email:": {Fields: []string{"to"}}, // every email:… type without a rule of its own
	}})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	client := d.NewClient()
	_, err = client.EnqueueContext(ctx, asynq.NewTask("email:reset", []byte(`{"to":"a@x","n":1}`)))
	fmt.Println("first reset mail:", err == nil)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("email:reset", []byte(`{"to":"a@x","n":2}`)))
	fmt.Println("second, same address:", errors.Is(err, dedup.ErrDuplicateTask))

	_, err = client.EnqueueContext(ctx, asynq.NewTask("report", []byte(`{"a":1}`)), dedup.Key("tenant-7"), dedup.Fields("a"))
	fmt.Println("tenant 7's report:", err == nil)
	_, err = client.EnqueueContext(ctx, asynq.NewTask("report", []byte(`{"a":2}`)), dedup.Fields("a"), dedup.Key("tenant-7"))
	fmt.Println("another, same tenant:", errors.Is(err, dedup.ErrDuplicateTask))
	// Output:
	// first reset mail: true
	// second, same address: true
	// tenant 7's report: true
	// another, same tenant: true
}

// Code that configures asynq with a RedisConnOpt builds the Dedup from the
// same option; a Client stands where the *asynq.Client stood.
func ExampleNewFromRedisConnOpt() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	ctx := context.Background()
	opt := asynq.RedisClientOpt{Addr: mr.Addr()}

	d, err := dedup.NewFromRedisConnOpt(ctx, opt, dedup.Config{})
	if err != nil {
		panic(err)
	}
	defer d.Close() // closes the client it made from opt
	var client interface {
		dedup.Enqueuer
		Close() error
		Ping() error
	} = d.WrapClient(asynq.NewClient(opt))
	defer client.Close()
	fmt.Println("ping:", client.Ping())
	_, err = client.Enqueue(asynq.NewTask("user:reindex", []byte(`{"user_id":1}`)))
	fmt.Println("enqueued:", err == nil)
	// Output:
	// ping: <nil>
	// enqueued: true
}

// Look up who holds a key, and free it (owner-checked, or forced with "").
func ExampleDedup_Lookup() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, err := dedup.New(ctx, rdb, dedup.Config{Rules: map[string]dedup.Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	task := asynq.NewTask("user:reindex", []byte(`{"user_id":42}`))
	info, _ := d.NewClient().Enqueue(task)

	lock, found, _ := d.Lookup(ctx, task)
	fmt.Println("held:", found, "by the task:", lock.Holder == info.ID, "state:", lock.State)
	released, _ := d.Release(ctx, task, info.ID)
	fmt.Println("released:", released)
	_, found, _ = d.Lookup(ctx, task)
	fmt.Println("held now:", found)
	// Output:
	// held: true by the task: true state: waiting
	// released: true
	// held now: false
}

// At most one weekly digest per user per week: after the digest succeeds,
// the key cools down, and the duplicate says so.
func ExampleRule_cooldown() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, err := dedup.New(ctx, rdb, dedup.Config{
		Rules:  map[string]dedup.Rule{"digest:weekly": {Fields: []string{"user_id"}, Cooldown: 7 * 24 * time.Hour}},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		panic(err)
	}
	client := d.NewClient()
	sent := make(chan struct{}, 1)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{Concurrency: 1, IsFailure: dedup.IsFailure,
		TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel})
	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc("digest:weekly", func(context.Context, *asynq.Task) error { sent <- struct{}{}; return nil })
	if err := srv.Start(mux); err != nil {
		panic(err)
	}

	task := asynq.NewTask("digest:weekly", []byte(`{"user_id": 42}`))
	first, err := client.EnqueueContext(ctx, task)
	if err != nil {
		panic(err)
	}
	<-sent
	var dup *dedup.DuplicateTaskError
	for !errors.As(err, &dup) || !dup.CoolingDown { // the lock turns cooling as the handler returns
		_, err = client.EnqueueContext(ctx, task)
		time.Sleep(time.Millisecond)
	}
	fmt.Println("held by the digest that was sent:", dup.Holder == first.ID)
	fmt.Println("frees within the week:", dup.FreeIn > 6*24*time.Hour && dup.FreeIn <= 7*24*time.Hour)
	srv.Shutdown()
	d.Close()
	// Output:
	// held by the digest that was sent: true
	// frees within the week: true
}

// A burst of profile edits runs one sync, with the last edit, ten seconds
// after the burst ends.
func ExampleRule_debounce() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, err := dedup.New(ctx, rdb, dedup.Config{
		Rules: map[string]dedup.Rule{"profile:sync": {Fields: []string{"user_id"}, OnConflict: dedup.Replace, Debounce: 10 * time.Second}},
	})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	client := d.NewClient()
	var last time.Time
	var res dedup.Result
	for _, name := range []string{"Ada", "Ada L.", "Ada Lovelace"} {
		payload := fmt.Sprintf(`{"user_id": 42, "name": %q}`, name)
		res, err = client.Submit(ctx, asynq.NewTask("profile:sync", []byte(payload)))
		if err != nil {
			panic(err)
		}
		last = time.Now()
		fmt.Println(res.Outcome)
	}
	info, err := asynq.NewInspectorFromRedisClient(rdb).GetTaskInfo("default", res.TaskID)
	if err != nil {
		panic(err)
	}
	fmt.Println("payload:", string(info.Payload))
	wait := info.NextProcessAt.Sub(last)
	fmt.Println("due about 10s after the last edit:", wait > 9*time.Second && wait <= 11*time.Second)
	// Output:
	// created
	// replaced
	// replaced
	// payload: {"user_id": 42, "name": "Ada Lovelace"}
	// due about 10s after the last edit: true
}

// Every replica (pod) runs the same Scheduler with the same entries; each
// firing is enqueued once, and the other replicas' enqueues of it are
// refused. Here two replicas share one process.
func ExampleScheduler() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	d, err := dedup.New(ctx, rdb, dedup.Config{Logger: quiet})
	if err != nil {
		panic(err)
	}
	defer d.Close()

	ran := make(chan *asynq.Task, 10)
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Queues:            map[string]int{"reports": 1},
		IsFailure:         dedup.IsFailure,
		TaskCheckInterval: 10 * time.Millisecond,
		LogLevel:          asynq.FatalLevel,
	})
	mux := asynq.NewServeMux()
	mux.Use(d.Middleware())
	mux.HandleFunc("report:build", func(_ context.Context, t *asynq.Task) error {
		ran <- t
		return nil
	})
	if err := srv.Start(mux); err != nil {
		panic(err)
	}
	defer srv.Shutdown()

	// What each replica's enqueue of each firing came to.
	type outcome struct {
		firing time.Time
		err    error
	}
	outcomes := make(chan outcome, 100)
	task := asynq.NewTask("report:build", []byte(`{"report": "daily"}`))
	var ids []string
	for range 2 { // two replicas, as two pods would each run one
		var firing time.Time // a replica enqueues its firings one after the other
		s := dedup.NewScheduler(d, &dedup.SchedulerOpts{
			Logger:          quiet,
			PreEnqueueFunc:  func(t *asynq.Task, _ []asynq.Option) { _, firing, _ = dedup.SchedulerFiring(t) },
			PostEnqueueFunc: func(_ *asynq.TaskInfo, err error) { outcomes <- outcome{firing, err} },
		})
		id, err := s.Register("@every 1s", task, asynq.Queue("reports"))
		if err != nil {
			panic(err)
		}
		ids = append(ids, id)
		if err := s.Start(); err != nil {
			panic(err)
		}
		defer s.Shutdown()
	}
	fmt.Println("entry:", ids[0], "on both replicas:", ids[0] == ids[1])

	// The first firing both replicas enqueued.
	seen := map[time.Time][]error{}
	var errs []error
	for len(errs) < 2 {
		o := <-outcomes
		seen[o.firing] = append(seen[o.firing], o.err)
		errs = seen[o.firing]
	}
	created, refused := 0, 0
	for _, err := range errs {
		var dup *dedup.DuplicateTaskError
		switch {
		case err == nil:
			created++
		case errors.As(err, &dup):
			refused++
		}
	}
	fmt.Println("created:", created, "refused as a duplicate:", refused)

	t := <-ran
	entry, at, _ := dedup.SchedulerFiring(t)
	fmt.Println("ran a firing of the entry:", entry == ids[0], "on a whole second:", at.Equal(at.Truncate(time.Second)))
	// Output:
	// entry: 31fe77177b1a9cee0cecb823737a5286 on both replicas: true
	// created: 1 refused as a duplicate: 1
	// ran a firing of the entry: true on a whole second: true
}

// Enqueue many tasks in one round trip per Redis node: each gets its own
// answer, in order. This package's options given to asynq.NewTask apply to
// that task alone.
func ExampleClient_EnqueueBatch() {
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	d, err := dedup.New(ctx, rdb, dedup.Config{Rules: map[string]dedup.Rule{"user:reindex": {Fields: []string{"user_id"}}}})
	if err != nil {
		panic(err)
	}
	defer d.Close()
	client := d.NewClient()

	user := func(id int, opts ...asynq.Option) *asynq.Task {
		return asynq.NewTask("user:reindex", fmt.Appendf(nil, `{"user_id":%d}`, id), opts...)
	}
	results := client.EnqueueBatch(ctx, []*asynq.Task{
		user(1),
		user(2),
		user(1),                            // the first task's key
		user(3, dedup.Key("tenant-7")),     // keyed by its own option
		asynq.NewTask("user:reindex", nil), // no user_id: its own error
	}, asynq.Queue("critical"))
	for i, r := range results {
		var dup *dedup.DuplicateTaskError
		switch {
		case errors.As(r.Err, &dup):
			fmt.Printf("%d: duplicate of task 0: %v\n", i, dup.Holder == results[0].TaskID)
		case r.Err != nil:
			fmt.Printf("%d: invalid payload: %v\n", i, errors.Is(r.Err, dedup.ErrInvalidPayload))
		default:
			fmt.Printf("%d: %v in %s\n", i, r.Outcome, r.Info.Queue)
		}
	}
	// Output:
	// 0: created in critical
	// 1: created in critical
	// 2: duplicate of task 0: true
	// 3: created in critical
	// 4: invalid payload: true
}
