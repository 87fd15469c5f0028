-- finish: an attempt ended; release the lock, or hold it for the retry.
--
-- KEYS[1]  lock key
-- KEYS[2]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID, as lock records store it (see id_pack in lib.lua)
-- ARGV[2]  attempt token
-- ARGV[3]  'release' (success, revoked, final failure) or 'hold' (a retry follows)
-- ARGV[4]  for 'hold': lifetime, integer milliseconds
-- ARGV[5]  asynq key prefix    asynq:{<queue>}:
-- ARGV[6]  lock lifetime for a released follow-up, integer milliseconds
-- ARGV[7]  how long a follow-up stays parked without a heartbeat, integer seconds
-- ARGV[8]  dedup key prefix    <prefix>:{<queue>}:
-- ARGV[9]  fingerprint hex
--
-- Reply: {1, ''}        released (or held)
--        {1, followup}  released to the owed follow-up task, now pending and the lock's owner
--        {0, ''}        not ours any more (another task or a newer attempt): untouched
local rec = redis.call('HMGET', KEYS[1], 'id', 'tok', 'f')
if rec[1] ~= ARGV[1] or rec[2] ~= ARGV[2] then
  return {0, ''}
end
local f = rec[3]
if ARGV[3] == 'release' then
  if KEYS[2] then
    redis.call('DEL', KEYS[2])
  end
  if f then
    redis.call('DEL', ARGV[8] .. 'f:' .. ARGV[9])
    local tkey = ARGV[5] .. 't:' .. f
    local state = redis.call('HGET', tkey, 'state')
    if waiting(state) then
      local now, _, ns = now_parts()
      if state == 'scheduled' then
        redis.call('ZREM', ARGV[5] .. 'scheduled', f)
        redis.call('LPUSH', ARGV[5] .. 'pending', f)
        redis.call('HSET', tkey, 'state', 'pending', 'pending_since', ns)
      end
      redis.call('HDEL', KEYS[1], 'tok', 'f')
      redis.call('HSET', KEYS[1], 'id', id_pack(f, ARGV[9]), 'c', now)
      redis.call('PEXPIRE', KEYS[1], ARGV[6])
      return {1, f}
    end
  end
  redis.call('DEL', KEYS[1])
  return {1, ''}
end
redis.call('HDEL', KEYS[1], 'tok')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if KEYS[2] then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
if f then
  -- Parked until the retry has run: the follow-up must come after it.
  local now = now_parts()
  local hold_s = (ARGV[4] - ARGV[4] % 1000) / 1000
  redis.call('ZADD', ARGV[5] .. 'scheduled', 'XX', now + hold_s + tonumber(ARGV[7]), f)
  redis.call('PEXPIRE', ARGV[8] .. 'f:' .. ARGV[9], (hold_s + tonumber(ARGV[7])) * 1000)
end
return {1, ''}
