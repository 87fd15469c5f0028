package store

import (
	"context"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"

	"github.com/hibiken/asynq"
	"pgregory.net/rapid"
)

// setPayloadBoth runs lib.lua's splice (pb_setpayload) and its general
// rewrite (pb_rewrite) on the same message.
var setPayloadBoth = LibScript(`
return {pb_setpayload(ARGV[1], ARGV[2]) or '<nil>', pb_rewrite(ARGV[1], {[2] = ARGV[2]}) or '<nil>'}
`)

// The payload splice Replace uses gives the same bytes as the general
// protobuf rewrite, on messages asynq itself stored (with and without a
// payload, with options set) and any new payload, empty included.
func TestSetPayloadMatchesRewrite(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	q := redistest.Uniq(t)
	c := asynq.NewClientFromRedisClient(rdb)
	var msgs []string
	for _, tc := range []struct {
		payload []byte
		opts    []asynq.Option
	}{
		{[]byte(`{"user_id":1}`), nil},
		{nil, nil},
		{[]byte(`{"a":"` + string(make([]byte, 300)) + `"}`), []asynq.Option{asynq.MaxRetry(3), asynq.Retention(1e9)}},
	} {
		info, err := c.Enqueue(asynq.NewTask("t", tc.payload), append(tc.opts, asynq.Queue(q))...)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := rdb.HGet(ctx, TaskKey(q, info.ID), "msg").Result()
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, msg)
	}
	rapid.Check(t, func(t *rapid.T) {
		msg := rapid.SampledFrom(msgs).Draw(t, "msg")
		p := rapid.SliceOfN(rapid.Byte(), 0, 400).Draw(t, "payload")
		v, err := setPayloadBoth.Run(ctx, rdb, nil, msg, payloadField(p)).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if v[0] == "<nil>" || v[0] != v[1] {
			t.Fatalf("splice %q, rewrite %q", v[0], v[1])
		}
	})
}
