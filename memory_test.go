package dedup

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"
)

// What a lock costs in Redis memory (redis-server 7.0, jemalloc, 64-bit),
// in queue "default" under prefix "dedup", for the type "email:welcome"
// keyed on its user_id. A waiting lock is the string
// dedup:{default}:u:<16 hex> whose value is its task's ID (dd-<20 hex>),
// plus what naming it costs in asynq's record of the task: the hash field
// unique_key and the message's UniqueKey (field 10), which asynq's own
// scripts read to release it.
//
// The lease-based layout kept the lock as a hash of its own, 168 bytes by
// MEMORY USAGE (the lock hash alone; its task's record named nothing).
const oldWaitingLock = 168

// Regression bounds, a little above what TestLockMemory measures, so that
// the layout cannot grow unnoticed. MEMORY USAGE is exact for a given
// redis-server build; the lock string is measured as a plain SET writes it
// (stringUsage says why).
const (
	lockKeyCeiling     = 128 // the lock string (measured 120)
	uniqueFieldCeiling = 144 // unique_key field + UniqueKey in the task hash (measured 136)
	waitingLockCeiling = 272 // the two together (measured 256)
	modeRecordCeiling  = 192 // a Cooldown key's mode record (measured 184)
	waitingAvgCeiling  = 320 // the two by used_memory, per lock over many (measured 304)
)

// TestLockMemory takes locks the normal way (NewClient, default Config, the
// default prefix "dedup", queue "default") on a redis-server of its own, so
// that the realistic short key names collide with nothing, measures each
// part with MEMORY USAGE and, over many tasks, with INFO memory, beside
// asynq.Unique's lock and a plain asynq task, and logs it all as a table.
func TestLockMemory(t *testing.T) {
	t.Parallel()
	w := newMemWorld(t)
	w.runningLock() // first: its server must find the queue empty
	lock, field := w.waitingLock()
	uLock, uField := w.uniqueLock()
	mode := w.cooldownLock()
	avg := w.averageRows(4000)
	w.replaceKeepsPayloadOnce()
	w.reductions()
	w.row("old layout: waiting lock hash (lease-based)", oldWaitingLock, "-", "MEMORY USAGE, as the old TestLockMemory reported")
	w.log()

	total, avgTotal := lock+field, int64(avg.lock.keys+avg.field.keys)
	t.Logf("a waiting lock: lock key %d B + unique_key field and UniqueKey %d B = %d B by MEMORY USAGE (%d B by used_memory): %s the old layout's %d B; asynq.Unique's: %d B (%d B)",
		lock, field, total, avgTotal, map[bool]string{true: "within", false: "ABOVE"}[total <= oldWaitingLock], oldWaitingLock,
		uLock+uField, int64(avg.uLock.keys+avg.uField.keys))
	for _, c := range []struct {
		what      string
		got, ceil int64
	}{{"lock key", lock, lockKeyCeiling}, {"unique_key field + UniqueKey", field, uniqueFieldCeiling},
		{"waiting lock", total, waitingLockCeiling}, {"Cooldown's mode record", mode, modeRecordCeiling},
		{"waiting lock by used_memory", avgTotal, waitingAvgCeiling}} {
		if c.got > c.ceil {
			t.Errorf("%s: %d B, over the layout's bound %d B", c.what, c.got, c.ceil)
		}
	}
	if total >= uLock+uField {
		t.Errorf("a waiting lock (%d B) costs no less than asynq.Unique's (%d B)", total, uLock+uField)
	}
}

// memWorld is TestLockMemory's private redis-server, Dedup and clients, and
// the table it fills.
type memWorld struct {
	t      *testing.T
	ctx    context.Context
	rdb    *redis.Client
	d      *Dedup
	client *Client       // NewClient: the direct path
	aq     *asynq.Client // asynq's own
	rows   [][4]string
	user   int // the next user_id
}

const (
	memType  = "email:welcome"
	memQueue = "default"
)

func newMemWorld(t *testing.T) *memWorld {
	_, rdb := ownRedis(t, nil) // MEMORY USAGE: miniredis has none
	ctx := context.Background()
	d, err := New(ctx, rdb, Config{Logger: quietLogger(), heartbeat: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if d.cfg.Prefix != "dedup" || d.cfg.TTL != time.Hour {
		t.Fatalf("defaults: prefix %q, TTL %v", d.cfg.Prefix, d.cfg.TTL)
	}
	return &memWorld{t: t, ctx: ctx, rdb: rdb, d: d, client: d.NewClient(), aq: asynq.NewClientFromRedisClient(rdb), user: 100000}
}

// welcome is the next user's welcome mail.
func (w *memWorld) welcome() *asynq.Task {
	w.user++
	return asynq.NewTask(memType, fmt.Appendf(nil, `{"user_id":%d,"template":"welcome"}`, w.user))
}

// enqueue enqueues one welcome mail through NewClient (keyed on user_id).
func (w *memWorld) enqueue(opts ...asynq.Option) *asynq.TaskInfo {
	w.t.Helper()
	info, err := w.client.EnqueueContext(w.ctx, w.welcome(), append([]asynq.Option{Fields("user_id")}, opts...)...)
	if err != nil {
		w.t.Fatal(err)
	}
	return info
}

func (w *memWorld) row(what string, usage any, avg any, how string) {
	w.rows = append(w.rows, [4]string{what, fmt.Sprint(usage), fmt.Sprint(avg), how})
}

// log logs the table.
func (w *memWorld) log() {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\nwhat\tMEMORY USAGE (B)\tused_memory Δ per task (B)\thow")
	for _, r := range w.rows {
		fmt.Fprintln(tw, strings.Join(r[:], "\t"))
	}
	_ = tw.Flush()
	b.WriteString(`
MEMORY USAGE counts a key's dict entry as 24 B and leaves out its expires entry.
used_memory Δ is jemalloc's: a 24 B dict entry takes 32, and each key with a TTL
has an entry in the expires dict (32). "keys" leaves out what is not the keys'
own (client buffers, script caches, the keyspace's bucket arrays: 8 B a slot,
1-2 slots a key, stepping in powers of two).`)
	w.t.Log(b.String())
}

func (w *memWorld) flush() {
	w.t.Helper()
	if err := w.rdb.FlushDB(w.ctx).Err(); err != nil {
		w.t.Fatal(err)
	}
}

// runningLock measures the lock of a task whose handler runs, once the
// heartbeat has extended it: still the same string.
func (w *memWorld) runningLock() {
	t := w.t
	started, release := make(chan string, 1), make(chan struct{})
	srv := asynq.NewServerFromRedisClient(w.rdb, asynq.Config{Concurrency: 1, Queues: map[string]int{memQueue: 1},
		TaskCheckInterval: 10 * time.Millisecond, LogLevel: asynq.FatalLevel})
	if err := srv.Start(w.d.Middleware()(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-release
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(func() { close(release); srv.Shutdown() }) }
	t.Cleanup(stop)
	info := w.enqueue()
	lock := taskLock(t, w.rdb, memQueue, info.ID)
	waiting := memUsage(t, w.rdb, lock)
	if id := waitFor(t, started, "the handler"); id != info.ID {
		t.Fatalf("ran %s, want %s", id, info.ID)
	}
	expiry := func() int64 { ms, _ := w.rdb.Do(w.ctx, "PEXPIRETIME", lock).Int64(); return ms }
	before := expiry()
	eventually(t, "the heartbeat extending the running lock", func() bool { return expiry() > before })
	running := memUsage(t, w.rdb, lock)
	if v := w.rdb.Get(w.ctx, lock).Val(); v != info.ID || running != waiting {
		t.Errorf("running lock: value %q (want %s), %d B (waiting: %d B)", v, info.ID, running, waiting)
	}
	stop()
	w.row("running lock (heartbeat-extended)", running, "-", "the same string as waiting: nothing added while it runs")
	w.flush()
}

// waitingLock measures one lock NewClient took, and what naming it adds to
// its task's hash, by MEMORY USAGE.
func (w *memWorld) waitingLock() (lock, field int64) {
	t := w.t
	info := w.enqueue()
	key := taskLock(t, w.rdb, memQueue, info.ID)
	if !strings.HasPrefix(key, "dedup:{default}:u:") || len(key) != len("dedup:{default}:u:")+16 || store.KindOf(info.ID) != store.IDPlain {
		t.Fatalf("lock %q of task %q: not the default layout", key, info.ID)
	}
	if v := w.rdb.Get(w.ctx, key).Val(); v != info.ID {
		t.Fatalf("lock value %q, want the task ID %s", v, info.ID)
	}
	if n := w.rdb.Exists(w.ctx, store.ModeOf(key)).Val(); n != 0 {
		t.Fatal("a Reject key has a mode record")
	}
	lock, field = w.lockRows("lock key dedup:{default}:u:<16 hex> = dd-<20 hex>", key, info.ID)
	w.row("  = a waiting lock (NewClient)", lock+field, "-", fmt.Sprintf("old layout %d B", oldWaitingLock))
	return lock, field
}

// lockRows measures the lock at key of task id and what naming it adds to
// the task's hash, and logs them.
func (w *memWorld) lockRows(what, key, id string) (lock, field int64) {
	lock, stored := w.stringUsage(key)
	with, without := w.hashCost(store.TaskKey(memQueue, id), true, "")
	how := memStringModel(key, id)
	if stored != lock {
		how += fmt.Sprintf("; as stored %d B (Lua's argument cache)", stored)
	}
	w.row(what, lock, "-", how)
	w.row("  + unique_key field and UniqueKey in the task hash", with-without, "-", fmt.Sprintf("task hash %d B with them, %d B without", with, without))
	return lock, with - without
}

// stringUsage is the MEMORY USAGE of the string at key as a plain SET
// writes it (a copy, under a name of the same length), and as stored. They
// differ when a script's SET was handed a larger object than its value
// needs: redis-server 7.0 keeps the argument objects of Lua's redis.call
// for the next call, and reuses one that is long enough, so a lock written
// after a longer argument (asynq's uuid task IDs) takes its allocation, up
// to 16 B more.
func (w *memWorld) stringUsage(key string) (fresh, stored int64) {
	t := w.t
	v := w.rdb.Get(w.ctx, key).Val()
	cp := strings.Replace(key, "}:", "};", 1)
	if err := w.rdb.Set(w.ctx, cp, v, time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	defer w.rdb.Del(w.ctx, cp)
	return memUsage(t, w.rdb, cp), memUsage(t, w.rdb, key)
}

// memStringModel explains a string key's MEMORY USAGE: dict entry, key
// sds (jemalloc size class) and the value (embstr up to 44 bytes).
func memStringModel(key, val string) string {
	keySds := jemallocSize(sdsHeader(len(key)) + len(key) + 1)
	obj := jemallocSize(16 + 3 + len(val) + 1) // robj and sds in one allocation
	return fmt.Sprintf("dict entry 24 + key sds %d (%d chars) + value %d (embstr, %d chars) = %d; its expires entry (24) is not counted",
		keySds, len(key), obj, len(val), 24+keySds+obj)
}

func memUsage(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.MemoryUsage(context.Background(), key, 0).Result() // SAMPLES 0: every field
	if err != nil {
		t.Fatalf("MEMORY USAGE %s: %v", key, err)
	}
	return n
}

// hashCost writes two copies of the asynq task hash at key, as asynq
// writes it (its field order, key names of the same length), one whole and
// one without the unique_key field and the message's UniqueKey (unique),
// or without the header named header, and returns their MEMORY USAGE.
func (w *memWorld) hashCost(key string, unique bool, header string) (with, without int64) {
	t := w.t
	h := w.rdb.HGetAll(w.ctx, key).Val()
	if h["msg"] == "" {
		t.Fatalf("no task at %s", key)
	}
	stripped := map[string]string{}
	for f, v := range h {
		stripped[f] = v
	}
	stripped["msg"] = string(memStripMsg(t, []byte(h["msg"]), unique, header))
	if unique {
		delete(stripped, "unique_key")
	}
	copyOf := func(mark string, fields map[string]string) int64 {
		k := strings.Replace(key, "}:t:", "}:"+mark+":", 1)
		var args []any
		for _, f := range []string{"msg", "state", "pending_since", "unique_key"} {
			if v, ok := fields[f]; ok {
				args = append(args, f, v)
			}
		}
		if err := w.rdb.HSet(w.ctx, k, args...).Err(); err != nil {
			t.Fatal(err)
		}
		defer w.rdb.Del(w.ctx, k)
		return memUsage(t, w.rdb, k)
	}
	with, without = copyOf("W", h), copyOf("O", stripped)
	if orig := memUsage(t, w.rdb, key); orig != with {
		t.Logf("NOTE: the copy of %s takes %d B, the original %d B", key, with, orig)
	}
	return with, without
}

// memStripMsg returns an asynq TaskMessage without its UniqueKey (field 10)
// if unique, and without the header named header ("" none).
func memStripMsg(t *testing.T, msg []byte, unique bool, header string) []byte {
	t.Helper()
	var out []byte
	for b := msg; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad task message: %v", protowire.ParseError(n))
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			t.Fatalf("bad task message field %d: %v", num, protowire.ParseError(m))
		}
		field := b[:n+m]
		b = b[n+m:]
		if unique && num == 10 {
			continue
		}
		if header != "" && num == 15 && memHeaderName(field[n:]) == header {
			continue
		}
		out = append(out, field...)
	}
	return out
}

// memHeaderName reads the key of an encoded headers map entry (length
// prefix included).
func memHeaderName(v []byte) string {
	e, n := protowire.ConsumeBytes(v)
	if n < 0 {
		return ""
	}
	if num, typ, n := protowire.ConsumeTag(e); n > 0 && num == 1 && typ == protowire.BytesType {
		s, m := protowire.ConsumeString(e[n:])
		if m > 0 {
			return s
		}
	}
	return ""
}

// memSnap is what INFO says of the server's memory: used_memory, and the
// part its keys take (see snap).
type memSnap struct{ used, keys float64 }

// snap reads INFO memory and keyspace. keys is used_memory_dataset (which
// leaves out client buffers, script caches and the keyspace's dicts) with
// each key's dict entry and object header (24 + 16 B) and each expiring
// key's entry in the expires dict (24 B) added back: what the keys
// themselves cost, without the bucket arrays, whose size steps in powers of
// two (8 B a slot, amortized 8–16 B a key).
func (w *memWorld) snap() memSnap {
	w.t.Helper()
	info, err := w.rdb.Info(w.ctx, "memory", "keyspace").Result()
	if err != nil {
		w.t.Fatal(err)
	}
	var s memSnap
	var dataset, keys, expires float64
	for _, line := range strings.Split(info, "\r\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "used_memory":
			s.used, _ = strconv.ParseFloat(v, 64)
		case "used_memory_dataset":
			dataset, _ = strconv.ParseFloat(v, 64)
		case "db0":
			for _, kv := range strings.Split(v, ",") {
				name, n, _ := strings.Cut(kv, "=")
				switch f, _ := strconv.ParseFloat(n, 64); name {
				case "keys":
					keys = f
				case "expires":
					expires = f
				}
			}
		}
	}
	if s.used == 0 || dataset == 0 {
		w.t.Fatalf("no used_memory in INFO: %q", info)
	}
	s.keys = dataset + keys*(24+16) + expires*24
	return s
}

// memPerTask is the change from a to b per task, for n tasks.
func memPerTask(a, b memSnap, n int) memSnap {
	return memSnap{used: (b.used - a.used) / float64(n), keys: (b.keys - a.keys) / float64(n)}
}

func (s memSnap) String() string { return fmt.Sprintf("%.1f (keys %.1f)", s.used, s.keys) }

// memAvg is what n tasks cost each, from INFO: the whole task, what naming
// its lock adds to its hash (unique_key field and UniqueKey), and its lock
// key.
type memAvg struct{ whole, field, lock memSnap }

// averages enqueues n tasks with enq on an empty database and measures
// what each costs: the whole, then, if locked, what removing each task's
// unique_key field and UniqueKey frees, then what deleting its lock frees.
// check, if given, looks at the tasks first.
func (w *memWorld) averages(n int, locked bool, enq func(*asynq.Task) (*asynq.TaskInfo, error), check func(ids []string)) memAvg {
	t := w.t
	w.flush()
	tasks := make([]*asynq.Task, n)
	for i := range tasks {
		tasks[i] = w.welcome()
	}
	// asynq's client registers the queue and loads its scripts at its first
	// enqueue: before the count.
	if _, err := enq(w.welcome()); err != nil {
		t.Fatal(err)
	}
	s0 := w.snap()
	ids := w.enqueueAll(tasks, enq)
	s1 := w.snap()
	avg := memAvg{whole: memPerTask(s0, s1, n)}
	if !locked {
		return avg
	}
	if check != nil {
		check(ids)
		s1 = w.snap()
	}
	locks := w.stripUnique(ids)
	s2 := w.snap()
	for chunk := range slices.Chunk(locks, 100) { // small commands: no query buffer to grow
		if err := w.rdb.Del(w.ctx, chunk...).Err(); err != nil {
			t.Fatal(err)
		}
	}
	s3 := w.snap()
	avg.field, avg.lock = memPerTask(s2, s1, n), memPerTask(s3, s2, n)
	return avg
}

// enqueueAll enqueues tasks with enq, one after the other (from one
// goroutine, so that no connection's buffers grow with a pipeline), and
// returns their IDs.
func (w *memWorld) enqueueAll(tasks []*asynq.Task, enq func(*asynq.Task) (*asynq.TaskInfo, error)) []string {
	ids := make([]string, len(tasks))
	for i, task := range tasks {
		info, err := enq(task)
		if err != nil {
			w.t.Fatalf("enqueue: %v", err)
		}
		ids[i] = info.ID
	}
	return ids
}

// stripUnique removes the unique_key field and the message's UniqueKey
// from the records of the tasks ids, and returns the locks they named.
func (w *memWorld) stripUnique(ids []string) []string {
	t := w.t
	var locks []string
	for chunk := range slices.Chunk(ids, 100) {
		reads := make([]*redis.SliceCmd, len(chunk))
		_, err := w.rdb.Pipelined(w.ctx, func(p redis.Pipeliner) error {
			for i, id := range chunk {
				reads[i] = p.HMGet(w.ctx, store.TaskKey(memQueue, id), "msg", "unique_key")
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		_, err = w.rdb.Pipelined(w.ctx, func(p redis.Pipeliner) error {
			for i, id := range chunk {
				v := reads[i].Val()
				msg, _ := v[0].(string)
				lock, _ := v[1].(string)
				if lock == "" {
					t.Fatalf("task %s names no lock", id)
				}
				locks = append(locks, lock)
				p.HSet(w.ctx, store.TaskKey(memQueue, id), "msg", memStripMsg(t, []byte(msg), true, ""))
				p.HDel(w.ctx, store.TaskKey(memQueue, id), "unique_key")
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return locks
}

// manyLocks measures n locks NewClient took: each the only key of its lock
// (no mode record, index or waiting set with the default config), all the
// same size, and their average costs by INFO.
func (w *memWorld) manyLocks(n int) memAvg {
	enq := func(task *asynq.Task) (*asynq.TaskInfo, error) {
		return w.client.EnqueueContext(w.ctx, task, Fields("user_id"))
	}
	return w.averages(n, true, enq, func(ids []string) {
		t := w.t
		keys := memScan(t, w.rdb, "dedup:*")
		if len(keys) != len(ids)+1 { // (+1: the warm-up's)
			t.Fatalf("%d dedup keys for %d locks, want one each: %v", len(keys), len(ids)+1, keys[:min(len(keys), 5)])
		}
		for _, k := range keys {
			if !strings.HasPrefix(k, "dedup:{default}:u:") {
				t.Fatalf("unexpected key %q", k)
			}
		}
		sizes := memUsages(t, w.rdb, keys)
		slices.Sort(sizes)
		w.row(fmt.Sprintf("%d waiting locks (NewClient): min / median / max", len(keys)),
			fmt.Sprintf("%d / %d / %d", sizes[0], sizes[len(sizes)/2], sizes[len(sizes)-1]), "-", "MEMORY USAGE of each lock key")
	})
}

// uniqueLock measures the lock asynq.Unique takes through asynq's own
// client: its key asynq:{default}:unique:<type>:<md5 of the payload>, and
// what naming it adds to the task's hash.
func (w *memWorld) uniqueLock() (lock, field int64) {
	t := w.t
	info, err := w.aq.EnqueueContext(w.ctx, w.welcome(), asynq.Unique(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	key := taskLock(t, w.rdb, memQueue, info.ID)
	if !strings.HasPrefix(key, "asynq:{default}:unique:"+memType+":") {
		t.Fatalf("asynq.Unique's key %q", key)
	}
	lock, field = w.lockRows("asynq.Unique key asynq:{default}:unique:"+memType+":<32 hex> = <uuid>", key, info.ID)
	w.row("  = asynq.Unique's lock", lock+field, "-", "")
	return lock, field
}

// averageRows measures n tasks of each kind (NewClient's, asynq.Unique's,
// a plain asynq task's) and logs what each costs.
func (w *memWorld) averageRows(n int) memAvgs {
	nc := w.manyLocks(n)
	unique := w.averages(n, true, func(task *asynq.Task) (*asynq.TaskInfo, error) {
		return w.aq.EnqueueContext(w.ctx, task, asynq.Unique(time.Hour))
	}, nil)
	plain := w.averages(n, false, func(task *asynq.Task) (*asynq.TaskInfo, error) {
		return w.aq.EnqueueContext(w.ctx, task)
	}, nil)
	sum := func(a, b memSnap) memSnap { return memSnap{a.used + b.used, a.keys + b.keys} }
	how := fmt.Sprintf("over %d tasks (see below)", n)
	w.row("NewClient lock key (with its expires entry)", "-", nc.lock, how)
	w.row("  + unique_key field and UniqueKey", "-", nc.field, how)
	w.row("  = a waiting lock (NewClient)", "-", sum(nc.lock, nc.field), how)
	w.row("asynq.Unique key (with its expires entry)", "-", unique.lock, how)
	w.row("  + unique_key field and UniqueKey", "-", unique.field, how)
	w.row("  = asynq.Unique's lock", "-", sum(unique.lock, unique.field), how)
	w.row("whole task: plain asynq.Client (uuid ID, no lock)", "-", plain.whole, how+": task hash, pending list entry")
	w.row("whole task: NewClient (dd- ID, lock)", "-", nc.whole, how)
	w.row("whole task: asynq.Unique (uuid ID, lock)", "-", unique.whole, how)
	if nc.whole.keys >= unique.whole.keys {
		w.t.Errorf("a task NewClient locks costs %.1f B, asynq.Unique's %.1f B: want less", nc.whole.keys, unique.whole.keys)
	}
	return memAvgs{lock: nc.lock, field: nc.field, uLock: unique.lock, uField: unique.field}
}

// memAvgs is what a waiting lock costs by used_memory: NewClient's and
// asynq.Unique's.
type memAvgs struct{ lock, field, uLock, uField memSnap }

// memUsages runs MEMORY USAGE on keys in pipelines.
func memUsages(t *testing.T, rdb *redis.Client, keys []string) []int64 {
	t.Helper()
	ctx := context.Background()
	out := make([]int64, 0, len(keys))
	for chunk := range slices.Chunk(keys, 100) {
		cmds := make([]*redis.IntCmd, len(chunk))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range chunk {
				cmds[i] = p.MemoryUsage(ctx, k, 0)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		for _, c := range cmds {
			out = append(out, c.Val())
		}
	}
	return out
}

func memScan(t *testing.T, rdb *redis.Client, match string) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	iter := rdb.Scan(ctx, 0, match, 1000).Iterator()
	for iter.Next(ctx) {
		out = append(out, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

// cooldownLock measures a lock with a mode record: Cooldown keeps the end
// of its cooldown beside the lock, and its task carries the header that
// tells the middleware to call Redis at its success.
func (w *memWorld) cooldownLock() (mode int64) {
	t := w.t
	w.flush()
	info := w.enqueue(Cooldown(time.Hour))
	key := taskLock(t, w.rdb, memQueue, info.ID)
	lock, _ := w.stringUsage(key)
	mode = memUsage(t, w.rdb, store.ModeOf(key))
	with, withoutHeader := w.hashCost(store.TaskKey(memQueue, info.ID), false, store.HeaderLock)
	_, withoutUnique := w.hashCost(store.TaskKey(memQueue, info.ID), true, "")
	w.row("Cooldown(1h): lock key", lock, "-", "as any lock")
	w.row("  + mode record …:m:<16 hex>", mode, "-", memBreakdown(t, w.rdb, store.ModeOf(key)))
	w.row("  + header "+store.HeaderLock+" in its message", with-withoutHeader, "-", fmt.Sprintf("%q", w.header(info.ID)))
	w.row("  + unique_key field and UniqueKey", with-withoutUnique, "-", "")
	w.row("  = a waiting Cooldown lock", lock+mode+with-withoutHeader+with-withoutUnique, "-", "")
	return mode
}

// header is the lock header task id carries.
func (w *memWorld) header(id string) string {
	return store.MessageHeaders([]byte(w.rdb.HGet(w.ctx, store.TaskKey(memQueue, id), "msg").Val()))[store.HeaderLock]
}

// reductions measures a waiting lock where the deployment differs: a
// keyed fingerprint (32 hex digits), a shorter prefix, and asynq's task
// hashes kept as listpacks (hash-max-listpack-value above the size of
// their message, which is what makes them dict-encoded, with an
// allocation per field, by default).
func (w *memWorld) reductions() {
	t := w.t
	w.flush()
	w.row("what changes it:", "", "", "")
	w.variant("keyed fingerprint (HashKey, 32 hex): lock key", Config{HashKey: []byte("memory-test-secret")})
	w.variant("Prefix \"d\": lock key", Config{Prefix: "d"})
	if err := w.rdb.ConfigSet(w.ctx, "hash-max-listpack-value", "1024").Err(); err != nil {
		t.Fatal(err)
	}
	defer w.rdb.ConfigSet(w.ctx, "hash-max-listpack-value", "64")
	w.variant("hash-max-listpack-value 1024: lock key", Config{})
	w.variant("both (Prefix \"d\", listpack task hashes): lock key", Config{Prefix: "d"})
}

// variant measures one waiting lock a Dedup configured so takes.
func (w *memWorld) variant(what string, cfg Config) {
	t := w.t
	cfg.Logger = quietLogger()
	d, err := New(w.ctx, w.rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	info, err := d.NewClient().EnqueueContext(w.ctx, w.welcome(), Fields("user_id"))
	if err != nil {
		t.Fatal(err)
	}
	lock, field := w.lockRows(what, taskLock(t, w.rdb, memQueue, info.ID), info.ID)
	w.row("  = a waiting lock", lock+field, "-", "")
}

// replaceKeepsPayloadOnce checks that Replace keeps the payload once, in
// asynq's task record: the lock and its mode record (the fold count) are
// the same size whatever the payload.
func (w *memWorld) replaceKeepsPayloadOnce() {
	t := w.t
	w.flush()
	payload := func(user int, fill byte, size int) []byte {
		return fmt.Appendf(nil, `{"user_id":%d,"blob":"%s"}`, user, bytes.Repeat([]byte{fill}, size))
	}
	replaced := func(user, size int) (lock, task int64, first, second []byte) {
		first, second = payload(user, 'a', size), payload(user, 'b', size)
		opts := []asynq.Option{Fields("user_id"), OnConflict(Replace)}
		r1, err := w.client.Submit(w.ctx, asynq.NewTask("profile:update", first), opts...)
		if err != nil || r1.Outcome != Created {
			t.Fatalf("first enqueue: %+v %v", r1, err)
		}
		r2, err := w.client.Submit(w.ctx, asynq.NewTask("profile:update", second), opts...)
		if err != nil || r2.Outcome != Replaced || r2.TaskID != r1.TaskID {
			t.Fatalf("second enqueue: %+v %v, want replaced into %s", r2, err, r1.TaskID)
		}
		key := taskLock(t, w.rdb, memQueue, r1.TaskID)
		lock, _ = w.stringUsage(key)
		lock += memUsage(t, w.rdb, store.ModeOf(key))
		return lock, memUsage(t, w.rdb, store.TaskKey(memQueue, r1.TaskID)), first, second
	}
	smallLock, smallTask, _, _ := replaced(1, 16)
	bigLock, bigTask, oldBig, newBig := replaced(2, 4096)
	w.row("Replace, after one fold: lock key + mode record", smallLock, "-",
		fmt.Sprintf("%d B with a 4 KB payload; asynq's task record %d B vs %d B", bigLock, smallTask, bigTask))
	if bigLock != smallLock {
		t.Errorf("the lock of a 4 KB payload takes %d B, of a 16 B one %d B: the lock must not hold the payload", bigLock, smallLock)
	}
	if grow := bigTask - smallTask; grow < 4096 || grow > 2*4096 {
		t.Errorf("asynq's task record grew by %d B for a 4 KB payload, want it to hold the payload once", grow)
	}
	if c := memCount(t, w.rdb, newBig); c != 1 {
		t.Errorf("the replacing 4 KB payload is stored %d times, want once (asynq's task record)", c)
	}
	if c := memCount(t, w.rdb, oldBig); c != 0 {
		t.Errorf("the replaced 4 KB payload is still stored %d times", c)
	}
}

// memCount counts the values in the whole (private) database that contain b.
func memCount(t *testing.T, rdb *redis.Client, b []byte) int {
	t.Helper()
	ctx := context.Background()
	n := 0
	for _, k := range memScan(t, rdb, "*") {
		var vals []string
		switch typ := rdb.Type(ctx, k).Val(); typ {
		case "string":
			vals = []string{rdb.Get(ctx, k).Val()}
		case "hash":
			for _, v := range rdb.HGetAll(ctx, k).Val() {
				vals = append(vals, v)
			}
		case "list":
			vals = rdb.LRange(ctx, k, 0, -1).Val()
		case "set":
			vals = rdb.SMembers(ctx, k).Val()
		case "zset":
			vals = rdb.ZRange(ctx, k, 0, -1).Val()
		default:
			t.Fatalf("key %s of type %q", k, typ)
		}
		for _, v := range vals {
			if strings.Contains(v, string(b)) {
				n++
			}
		}
	}
	return n
}

// memBreakdown says where a small hash's bytes go (a listpack: Redis 7,
// jemalloc, 64-bit): dict entry 24, object 16, key sds, listpack, and its
// fields.
func memBreakdown(t *testing.T, rdb *redis.Client, key string) string {
	t.Helper()
	ctx := context.Background()
	m := rdb.HGetAll(ctx, key).Val()
	fields := make([]string, 0, len(m))
	for f := range m {
		fields = append(fields, f)
	}
	sort.Strings(fields)
	lp := 6 + 1 // listpack header and end byte
	var parts []string
	for _, f := range fields {
		fe, ve := lpEntrySize(f), lpEntrySize(m[f])
		lp += fe + ve
		parts = append(parts, fmt.Sprintf("%s=%q (%d+%d)", f, m[f], fe, ve))
	}
	keySds := jemallocSize(sdsHeader(len(key)) + len(key) + 1)
	return fmt.Sprintf("%s: 24 + key sds %d + 16 + listpack %d (%d used): %s",
		rdb.ObjectEncoding(ctx, key).Val(), keySds, jemallocSize(lp), lp, strings.Join(parts, ", "))
}

// lpEntrySize is the size of one listpack entry holding s: encoding, data
// and back-length, with strings that are integers stored as integers.
func lpEntrySize(s string) int {
	var n int
	if v, err := strconv.ParseInt(s, 10, 64); err == nil && strconv.FormatInt(v, 10) == s {
		switch {
		case v >= 0 && v <= 127:
			n = 1
		case v >= -4096 && v <= 4095:
			n = 2
		case v >= -1<<15 && v < 1<<15:
			n = 3
		case v >= -1<<23 && v < 1<<23:
			n = 4
		case v >= -1<<31 && v < 1<<31:
			n = 5
		default:
			n = 9
		}
	} else {
		switch l := len(s); {
		case l < 64:
			n = 1 + l
		case l < 4096:
			n = 2 + l
		default:
			n = 5 + l
		}
	}
	switch {
	case n < 128:
		return n + 1
	case n < 16384:
		return n + 2
	default:
		return n + 3
	}
}

func sdsHeader(n int) int {
	switch {
	case n < 1<<5:
		return 1
	case n < 1<<8:
		return 3
	case n < 1<<16:
		return 5
	default:
		return 9
	}
}

// jemallocSize rounds an allocation up to jemalloc's size class.
func jemallocSize(n int) int {
	for _, c := range []int{8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512} {
		if n <= c {
			return c
		}
	}
	return n
}
