package store

import (
	"context"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"google.golang.org/protobuf/encoding/protowire"

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

// The splice agrees with the general rewrite on every well-formed message
// whose fields 1 and 2 (type and payload) come before its others, in any
// order and repeated, as asynq's always do, whatever the rest holds. A
// message cut short is refused by the rewrite; the splice, which reads no
// further than the field after the payload, may instead copy the broken
// tail untouched, but never fails.
func TestSetPayloadAnyMessage(t *testing.T) {
	rdb := redistest.Client(t)
	ctx := context.Background()
	field := func(t *rapid.T, msg []byte, num protowire.Number) []byte {
		if rapid.Bool().Draw(t, "varint") {
			msg = protowire.AppendTag(msg, num, protowire.VarintType)
			return protowire.AppendVarint(msg, rapid.Uint64Range(0, 1<<40).Draw(t, "v"))
		}
		msg = protowire.AppendTag(msg, num, protowire.BytesType)
		return protowire.AppendBytes(msg, rapid.SliceOfN(rapid.Byte(), 0, 200).Draw(t, "bytes"))
	}
	rapid.Check(t, func(t *rapid.T) {
		var msg []byte
		for range rapid.IntRange(0, 3).Draw(t, "head") {
			msg = field(t, msg, protowire.Number(rapid.IntRange(1, 2).Draw(t, "num")))
		}
		for range rapid.IntRange(0, 6).Draw(t, "tail") {
			msg = field(t, msg, protowire.Number(rapid.IntRange(3, 16).Draw(t, "num")))
		}
		if cut := rapid.IntRange(0, len(msg)).Draw(t, "cut"); rapid.Bool().Draw(t, "truncate") {
			msg = msg[:cut]
		}
		p := rapid.SliceOfN(rapid.Byte(), 0, 300).Draw(t, "payload")
		v, err := setPayloadBoth.Run(ctx, rdb, nil, string(msg), payloadField(p)).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if v[1] != "<nil>" && v[0] != v[1] {
			t.Fatalf("message %x: splice %x, rewrite %x", msg, v[0], v[1])
		}
	})
}
