-- acquire: take the lock for a task about to be enqueued, or name its holder.
--
-- KEYS[1]  lock key            <prefix>:{<queue>}:l:<fingerprint>
-- KEYS[2]  (optional) index    <prefix>:{<queue>}:i:<task ID>, only for a caller-chosen task ID
-- ARGV[1]  task ID that will own the lock
-- ARGV[2]  lifetime, integer milliseconds
-- ARGV[3]  task type (kept for operators)
-- ARGV[4]  asynq task-key prefix   asynq:{<queue>}:t:
-- ARGV[5]  index-key prefix        <prefix>:{<queue>}:i:
-- ARGV[6]  heal grace, integer seconds
-- ARGV[7]  fingerprint hex (the index key's value)
--
-- Reply: {1, ARGV[1]}  taken
--        {0, holder}   held by another live task
--        {2, ARGV[1]}  already held by this task ID; left unchanged
--
-- A lock whose owner task is gone from asynq (or completed or archived) is
-- orphaned and taken over, once it is older than the grace period that
-- covers the gap between taking a lock and asynq storing the task.
local now = tonumber(redis.call('TIME')[1])
local rec = redis.call('HMGET', KEYS[1], 'id', 'c')
local holder = rec[1]
if holder then
  if holder == ARGV[1] then
    return {2, holder}
  end
  if now - (tonumber(rec[2]) or 0) < tonumber(ARGV[6]) then
    return {0, holder}
  end
  local state = redis.call('HGET', ARGV[4] .. holder, 'state')
  if state and state ~= 'completed' and state ~= 'archived' then
    return {0, holder}
  end
  redis.call('DEL', KEYS[1], ARGV[5] .. holder)
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'ty', ARGV[3], 'c', now)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[7], 'PX', ARGV[2])
end
return {1, ARGV[1]}
