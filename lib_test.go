package dedup

import (
	"context"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"pgregory.net/rapid"
)

// setPayloadBoth runs lib.lua's splice (pb_setpayload) and its general
// rewrite (pb_rewrite) on the same message.
var setPayloadBoth = redis.NewScript(withLib(`
return {pb_setpayload(ARGV[1], ARGV[2]) or '<nil>', pb_rewrite(ARGV[1], {[2] = ARGV[2]}) or '<nil>'}
`))

// The payload splice Replace uses gives the same bytes as the general
// protobuf rewrite, on messages asynq itself stored (with and without a
// payload, with options set) and any new payload, empty included.
func TestSetPayloadMatchesRewrite(t *testing.T) {
	rdb := newRDB(t)
	ctx := context.Background()
	q := uniq(t)
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
		msg, err := rdb.HGet(ctx, asynqPrefix(q)+"t:"+info.ID, "msg").Result()
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, msg)
	}
	rapid.Check(t, func(t *rapid.T) {
		msg := rapid.SampledFrom(msgs).Draw(t, "msg")
		p := rapid.SliceOfN(rapid.Byte(), 0, 400).Draw(t, "payload")
		v, err := setPayloadBoth.Run(ctx, rdb, nil, msg, p).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if v[0] == "<nil>" || v[0] != v[1] {
			t.Fatalf("splice %q, rewrite %q", v[0], v[1])
		}
	})
}
