-- start: an attempt of a task begins; make it the lock's running owner.
--
-- KEYS[1]  lock key            <prefix>:{<queue>}:l:<fingerprint>
-- KEYS[2]  (optional) index    <prefix>:{<queue>}:i:<task ID>, only for a caller-chosen task ID
-- ARGV[1]  task ID
-- ARGV[2]  attempt token (random per attempt)
-- ARGV[3]  lease, integer milliseconds
-- ARGV[4]  task type
-- ARGV[5]  asynq task-key prefix   asynq:{<queue>}:t:
-- ARGV[6]  index-key prefix        <prefix>:{<queue>}:i:
-- ARGV[7]  heal grace, integer seconds
-- ARGV[8]  fingerprint hex (the index key's value)
--
-- Reply: {1, ARGV[1]}  this attempt holds the lock (taken, or already the task's)
--        {0, holder}   held by another live task: the attempt must not run
--
-- A new attempt replaces an older attempt's token, so a leftover handler of
-- that attempt can neither renew nor release the lock any more.
local now = tonumber(redis.call('TIME')[1])
local rec = redis.call('HMGET', KEYS[1], 'id', 'c')
local holder = rec[1]
if holder and holder ~= ARGV[1] then
  local orphan = false
  if now - (tonumber(rec[2]) or 0) >= tonumber(ARGV[7]) then
    local state = redis.call('HGET', ARGV[5] .. holder, 'state')
    orphan = (not state) or state == 'completed' or state == 'archived'
  end
  if not orphan then
    return {0, holder}
  end
  redis.call('DEL', KEYS[1], ARGV[6] .. holder)
  holder = false
end
if not holder then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'ty', ARGV[4], 'c', now)
end
redis.call('HSET', KEYS[1], 'tok', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[8], 'PX', ARGV[3])
end
return {1, ARGV[1]}
