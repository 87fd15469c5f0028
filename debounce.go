package dedup

import (
	"fmt"
	"time"

	"github.com/hibiken/asynq"
)

// Debounce (BullMQ's debounce mode): with Replace or Merge, a burst of
// enqueues of one key runs once, with the burst's last payload (or all of
// them merged), about d after the burst's last enqueue. The task the
// first enqueue creates is due d later (the call's own ProcessIn or
// ProcessAt is overridden, and not named in Result.NotApplied of later
// folds); each enqueue folded into it while it is still scheduled moves
// its due time to d after that enqueue, in the same atomic step as the
// fold. asynq moves due tasks to pending every few seconds (5 s by
// default, asynq.Config.DelayedTaskCheckInterval), so the run comes up to
// that much after the due time. Once the task is due (pending) a fold
// still lands in it but no longer delays it; once it runs, enqueues meet
// the running policy (RunningReject or RunningAllow; RunningDefer is
// refused, its follow-up's due time belongs to the running task).

// Debounce sets this call's debounce delay (see Rule.Debounce), overriding
// the type's rule. The call's policy must fold (Replace or Merge). Above
// 100 years it is 100 years. With Config.OptIn it opts the call in.
func Debounce(d time.Duration) asynq.Option {
	return option{desc: fmt.Sprintf("dedup.Debounce(%v)", d), apply: func(r *resolved) error {
		if d <= 0 {
			return errorf("%w: Debounce %v is not positive", ErrInvalidOption, d)
		}
		r.debounce, r.optedIn = lifetime(d), true
		return nil
	}}
}

// debounce makes a debounced call due d from now: the task it may create
// (through asynq's options, last wins) and the one it may fold into. asynq
// keeps due times in whole seconds and runs a task once its second has
// begun, so the due time is rounded up: never before d has passed.
func (k *call) debounce(now time.Time) {
	d := k.rule.debounce
	if d <= 0 {
		return
	}
	due := now.Add(d)
	if s := due.Truncate(time.Second); !s.Equal(due) {
		due = s.Add(time.Second)
	}
	k.processAt = due
	k.pass = append(k.pass, asynq.ProcessAt(k.processAt))
}
