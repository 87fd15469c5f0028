package store

import "sync/atomic"

// Scripts whose keys depend on the call (take, acquire, start, settle,
// release) name each key they are given by a role letter, in ARGV[1]: "LTP"
// means KEYS[1] is the lock, KEYS[2] the new task's asynq record, KEYS[3]
// asynq's pending list. The lock always comes first. Some keys cannot be
// known before the script runs: the asynq record of the task that holds a
// lock, or of the follow-up it owes. The caller passes them for the holder
// it expects (a hint, see hints.go); a script that finds another holder, or
// needs a key it was not given, changes nothing and replies statusNeed
// with the roles it lacks and the IDs they belong to, and the caller calls
// again with those keys. Every key a script touches is therefore in KEYS,
// as Redis Cluster requires to refuse (TRYAGAIN, ASK) a call whose slot is
// moving instead of splitting a queue's keys between two nodes.
const (
	roleLock       = 'L' // the lock
	roleMode       = 'M' // the key's mode record
	roleTask       = 'T' // asynq record of the task (new, or the one starting)
	rolePending    = 'P' // asynq pending list of the queue
	roleScheduled  = 'S' // asynq scheduled set of the queue
	roleRetry      = 'R' // asynq retry set of the queue
	roleActive     = 'A' // asynq active list of the queue (release)
	roleWait       = 'W' // the task type's waiting set
	roleHolder     = 'H' // asynq record of the lock's holder
	roleFollowTask = 'G' // asynq record of the lock's follow-up
	roleNewFollow  = 'N' // asynq record of a new follow-up
)

// keyList is a script's KEYS with the role letter of each, after a head
// the script reads first (acquire's policies). One allocation holds it
// all.
type keyList struct {
	roles []byte // head, then one letter per key
	head  int
	keys  []string

	roleBuf [16]byte
	keyBuf  [8]string // the slow paths that pass more grow keys
}

func newKeyList(head ...byte) *keyList {
	k := &keyList{head: len(head)}
	k.roles = append(k.roleBuf[:0], head...)
	k.keys = k.keyBuf[:0]
	return k
}

// roleArg is ARGV[1]: the head and the role letters, as a script
// argument. The few distinct ones are kept, boxed, so that a call
// allocates none.
func (k *keyList) roleArg() any {
	m := *roleArgs.Load()
	if s, ok := m[string(k.roles)]; ok {
		return s
	}
	s := string(k.roles)
	next := make(map[string]any, len(m)+1)
	for key, v := range m {
		next[key] = v
	}
	next[s] = s
	roleArgs.Store(&next) // a lost race only drops one entry
	return next[s]
}

var roleArgs = func() *atomic.Pointer[map[string]any] {
	var p atomic.Pointer[map[string]any]
	p.Store(&map[string]any{})
	return &p
}()

// has reports whether a key of role r was added.
func (k *keyList) has(r byte) bool {
	for _, have := range k.roles[k.head:] {
		if have == r {
			return true
		}
	}
	return false
}

// add appends key under role r, once.
func (k *keyList) add(r byte, key string) {
	if k.has(r) {
		return
	}
	k.roles = append(k.roles, r)
	k.keys = append(k.keys, key)
}
