package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// Reads and writes outside the scripts, each one Redis command through the
// guarded path.

// Withdraw deletes task id of queue if it waits (pending or scheduled) and
// no worker took it (lua/withdraw.lua): a task an enqueuer stored where
// the call that made it is folded or refused. It reports whether it did.
func (s *Store) Withdraw(ctx context.Context, queue, id string) (bool, error) {
	v, err := s.run(ctx, s.sc.withdraw, []string{TaskKey(queue, id), PendingKey(queue), ScheduledKey(queue)}, id)
	if err != nil {
		return false, err
	}
	return parseFlag(v)
}

// PublishQueue registers queue in asynq's set of queues, as asynq's client
// does before its first enqueue to a queue; once per Store and queue.
func (s *Store) PublishQueue(ctx context.Context, queue string) error {
	if _, ok := s.published.Load(queue); ok {
		return nil
	}
	_, err := s.Do(ctx, QueuesKey, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return nil, rdb.SAdd(c, QueuesKey, queue).Err()
	})
	if err == nil {
		s.published.Store(queue, true)
	}
	return err
}

// Processed reads asynq's count of tasks of queue it completed (kept or
// deleted), 0 if none.
func (s *Store) Processed(ctx context.Context, queue string) (int64, error) {
	v, err := s.Do(ctx, ProcessedKey(queue), func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.Get(c, ProcessedKey(queue)).Int64()
	})
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n, ok := v.(int64)
	if !ok {
		return 0, errors.New("store: unexpected reply to Processed")
	}
	return n, nil
}

// TaskTrace tells whether asynq's record of task id exists, and reads
// asynq's count of tasks of queue it completed: one pipelined round trip
// (both keys are in the queue's slot).
func (s *Store) TaskTrace(ctx context.Context, queue, id string) (exists bool, processed int64, err error) {
	v, err := s.Do(ctx, ProcessedKey(queue), func(c context.Context, rdb redis.Cmdable) (any, error) {
		pipe := rdb.Pipeline()
		ex := pipe.Exists(c, TaskKey(queue, id))
		pr := pipe.Get(c, ProcessedKey(queue))
		if _, err := pipe.Exec(c); err != nil && !errors.Is(err, redis.Nil) {
			return nil, err
		}
		n, err := pr.Int64()
		if errors.Is(err, redis.Nil) {
			n, err = 0, nil
		}
		return [2]int64{ex.Val(), n}, err
	})
	if err != nil {
		return false, 0, err
	}
	r, ok := v.([2]int64)
	if !ok {
		return false, 0, errors.New("store: unexpected reply to TaskTrace")
	}
	return r[0] == 1, r[1], nil
}

// StoredTask reads asynq's record of task id: its type, payload and state;
// found is false when there is none. One single-key command, so it is
// answered during a slot migration too (a script of several keys may be
// refused there).
func (s *Store) StoredTask(ctx context.Context, queue, id string) (typ string, payload []byte, state string, found bool, err error) {
	key := TaskKey(queue, id)
	v, err := s.Do(ctx, key, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.HMGet(c, key, "msg", "state").Result()
	})
	if err != nil {
		return "", nil, "", false, err
	}
	vals, _ := v.([]any)
	if len(vals) != 2 {
		return "", nil, "", false, errors.New("store: unexpected reply to StoredTask")
	}
	msg, _ := vals[0].(string)
	state, _ = vals[1].(string)
	if msg == "" {
		return "", nil, "", false, nil
	}
	typ, payload, ok := decodeTypePayload([]byte(msg))
	if !ok {
		return "", nil, state, true, fmt.Errorf("store: task %s: message not understood", id)
	}
	return typ, payload, state, true, nil
}
