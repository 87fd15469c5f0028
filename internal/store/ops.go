package store

import (
	"context"
	"errors"
	"time"

	"github.com/redis/go-redis/v9"
)

// Reads and writes outside the scripts, each one Redis command through the
// guarded path.

// IndexOf reads the index key of a caller-chosen task ID: the fingerprint
// of its lock, or OptOutMark. found is false when there is none.
func (s *Store) IndexOf(ctx context.Context, queue, id string) (fp string, found bool, err error) {
	v, err := s.Do(ctx, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.Get(c, s.keys.Index(queue, id)).Result()
	})
	if errors.Is(err, redis.Nil) {
		return "", false, nil
	}
	fp, _ = v.(string)
	return fp, err == nil, err
}

// OwnerOf reads the owner of the lock of fp in queue; found is false when
// there is no lock.
func (s *Store) OwnerOf(ctx context.Context, queue, fp string) (id string, found bool, err error) {
	v, err := s.Do(ctx, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return rdb.HGet(c, s.keys.Lock(queue, fp), FieldOwner).Result()
	})
	if errors.Is(err, redis.Nil) {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	stored, _ := v.(string)
	return UnpackOwner(stored, fp), true, nil
}

// MarkOptOut records that the caller-chosen task ID id was enqueued without
// deduplication, for ttl, so the middleware does not lock it when it runs.
func (s *Store) MarkOptOut(ctx context.Context, queue, id string, ttl time.Duration) error {
	_, err := s.Do(ctx, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return nil, rdb.Set(c, s.keys.Index(queue, id), OptOutMark, ttl).Err()
	})
	return err
}

// PublishQueue registers queue in asynq's set of queues, as asynq's client
// does before its first enqueue to a queue; once per Store and queue.
func (s *Store) PublishQueue(ctx context.Context, queue string) error {
	if _, ok := s.published.Load(queue); ok {
		return nil
	}
	_, err := s.Do(ctx, func(c context.Context, rdb redis.Cmdable) (any, error) {
		return nil, rdb.SAdd(c, QueuesKey, queue).Err()
	})
	if err == nil {
		s.published.Store(queue, true)
	}
	return err
}

// TaskSeen tells whether asynq's record of task id exists in this Redis
// (exists), and whether queue is registered in asynq's set of queues here
// (queueKnown): the two facts that say where a client's tasks live. Two
// commands, since asynq's set of queues has no hash tag.
func (s *Store) TaskSeen(ctx context.Context, queue, id string) (exists, queueKnown bool, err error) {
	v, err := s.Do(ctx, func(c context.Context, rdb redis.Cmdable) (any, error) {
		n, err := rdb.Exists(c, TaskKey(queue, id)).Result()
		if err != nil || n == 1 {
			return [2]bool{n == 1, true}, err
		}
		known, err := rdb.SIsMember(c, QueuesKey, queue).Result()
		return [2]bool{false, known}, err
	})
	if err != nil {
		return false, false, err
	}
	r, ok := v.([2]bool)
	if !ok {
		return false, false, errors.New("store: unexpected reply to TaskSeen")
	}
	return r[0], r[1], nil
}
