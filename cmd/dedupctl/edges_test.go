package main

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
)

// Releasing an orphaned lock counted in its type's waiting set (MaxPending)
// must drop its entry there, as the release help promises ("and its entry
// in the type's waiting set"). The owner is missing, so the type read from
// its asynq record is "", and the release script is given the waiting set
// of type "".
func TestReleaseOrphanFreesWaitingSlot(t *testing.T) {
	f := newFixture(t, dedup.Config{Rules: map[string]dedup.Rule{"email:welcome": {MaxPending: 1}}})
	ctx := context.Background()
	info := f.enqueue(f.qa, "email:welcome", 1)
	wait := store.NewKeys(f.prefix).Wait(f.qa, "email:welcome")
	if n := f.rdb.ZCard(ctx, wait).Val(); n != 1 {
		t.Fatalf("precondition: waiting set %d", n)
	}
	if err := f.insp.DeleteTask(f.qa, info.ID); err != nil {
		t.Fatal(err)
	}
	key := f.lockOf(info)
	f.ok("release", "--yes", key)
	if n := f.rdb.ZCard(ctx, wait).Val(); n != 0 {
		t.Errorf("after releasing the orphaned lock the waiting set still counts %d key(s)", n)
	}
	if _, err := f.client.Enqueue(asynq.NewTask("email:welcome", []byte(`{"user_id":2}`)), asynq.Queue(f.qa), dedup.Fields("user_id")); err != nil {
		t.Errorf("a new key is refused after the operator released the only waiting lock: %v", err)
	}
}

// The owner changes while the operator is asked: the release must leave
// the new owner's lock alone.
func TestReleaseOwnerChangesDuringPrompt(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	info := f.enqueue(f.qa, "email:welcome", 1)
	key := f.lockOf(info)
	var next *asynq.TaskInfo
	in := &actingReader{act: func() {
		// The owner is deleted and its lock released; new work takes the key.
		_ = f.insp.DeleteTask(f.qa, info.ID)
		f.rdb.Del(context.Background(), key)
		next = f.enqueue(f.qa, "email:welcome", 1)
	}, data: "y\n"}
	r := f.run(in, "release", key)
	if r.code == 0 || !strings.Contains(r.stderr, "changed holder") {
		t.Errorf("release while the owner changed: %v", r)
	}
	if owner := f.rdb.Get(context.Background(), key).Val(); owner == "" || next == nil || !strings.HasSuffix(owner, ":"+next.ID) {
		t.Errorf("the new owner's lock was released (the lock is %q)", owner)
	}
}

type actingReader struct {
	act  func()
	data string
	done bool
}

func (r *actingReader) Read(p []byte) (int, error) {
	if !r.done {
		r.done = true
		r.act()
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	if n == 0 {
		return 0, errEOF
	}
	return n, nil
}

var errEOF = io.EOF

// Queue names with glob and brace characters: list --queue matches exactly
// that queue, show/release parse the key back to it.
func TestOddQueueNames(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	suffix := randHex(3)
	queues := []string{"a*b-" + suffix, "a?b-" + suffix, "x}y-" + suffix, "q[1]-" + suffix, `back\slash-` + suffix, "l}:u:0123456789abcdef-" + suffix, "m}:l:0123456789abcdef-" + suffix}
	infos := map[string]*asynq.TaskInfo{}
	for _, q := range queues {
		infos[q] = f.enqueue(q, "odd", 1)
	}
	for _, q := range queues {
		o := decode[listOutput](t, f.ok("--json", "list", "--queue", q))
		if o.Count != 1 || o.Locks[0].Queue != q || o.Locks[0].Owner != infos[q].ID {
			t.Errorf("list --queue %q: %+v", q, o)
		}
		key := f.lockOf(infos[q])
		s := decode[showOutput](t, f.ok("--json", "show", key))
		if s.Queue != q || s.Owner != infos[q].ID {
			t.Errorf("show %q: queue %q owner %q", key, s.Queue, s.Owner)
		}
		s2 := decode[showOutput](t, f.ok("--json", "show", "--task", infos[q].ID))
		if s2.Key != key {
			t.Errorf("show --task %s (no --queue): key %q, want %q", infos[q].ID, s2.Key, key)
		}
	}
}

// The same work locked in two queues by two tasks: show --task picks the
// lock the task owns; release --task releases only that one.
func TestSameKeyTwoQueues(t *testing.T) {
	f := newFixture(t, dedup.Config{})
	a := f.enqueue(f.qa, "email:welcome", 1)
	b := f.enqueue(f.qb, "email:welcome", 1)
	o := decode[showOutput](t, f.ok("--json", "show", "--task", b.ID))
	if o.Queue != f.qb || o.Owner != b.ID {
		t.Errorf("show --task %s: queue %q owner %q", b.ID, o.Queue, o.Owner)
	}
	f.ok("release", "--yes", "--task", a.ID)
	if f.exists(f.lockOf(a)) || !f.exists(f.lockOf(b)) {
		t.Errorf("release --task %s released the wrong lock", a.ID)
	}
}
