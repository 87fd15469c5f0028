package store

// Scripts whose keys depend on the call (acquire, start, finish) name each
// key they are given by a role letter, in ARGV[1]: "LTP" means KEYS[1] is
// the lock, KEYS[2] the new task's asynq record, KEYS[3] asynq's pending
// list. Some keys cannot be known before the script runs: the asynq record
// of the task that holds a lock, or of the follow-up it owes. The caller
// passes them for the holder it expects (a hint, see hints.go); a script
// that finds another holder, or needs a key it was not given, changes
// nothing and replies statusNeed with the roles it lacks and the IDs they
// belong to, and the caller calls again with those keys. Every key a
// script touches is therefore in KEYS, as Redis Cluster requires to refuse
// (TRYAGAIN, ASK) a call whose slot is moving instead of splitting a
// queue's keys between two nodes.
const (
	roleLock        = 'L' // the lock
	roleIndex       = 'I' // index key of the task's caller-chosen ID
	roleTask        = 'T' // asynq record of the new task
	rolePending     = 'P' // asynq pending list of the queue
	roleScheduled   = 'S' // asynq scheduled set of the queue
	roleWait        = 'W' // the task type's waiting set
	roleFollow      = 'F' // the key's follow-up pointer
	roleNewFollow   = 'N' // asynq record of a new follow-up
	roleHolder      = 'H' // asynq record of the lock's holder
	roleHolderIndex = 'J' // index key of the lock's holder
	roleFollowTask  = 'G' // asynq record of the lock's follow-up
)

// keyList is a script's KEYS with the role letter of each, after a head
// the script reads first (acquire's policies).
type keyList struct {
	roles []byte // head, then one letter per key
	head  int
	keys  []string
}

func newKeyList(head string, n int) *keyList {
	k := &keyList{roles: make([]byte, 0, len(head)+n), head: len(head), keys: make([]string, 0, n)}
	k.roles = append(k.roles, head...)
	return k
}

// add appends key under role r, once.
func (k *keyList) add(r byte, key string) {
	for _, have := range k.roles[k.head:] {
		if have == r {
			return
		}
	}
	k.roles = append(k.roles, r)
	k.keys = append(k.keys, key)
}
