-- start: an attempt of a task begins; make it the lock's running owner.
--
-- KEYS[1]  lock key            <prefix>:{<queue>}:l:<fingerprint>
-- KEYS[2]  (optional) index    <prefix>:{<queue>}:i:<task ID>, only for a caller-chosen task ID
-- ARGV[1]  task ID
-- ARGV[2]  attempt token (random per attempt)
-- ARGV[3]  lease, integer milliseconds
-- ARGV[4]  task type
-- ARGV[5]  asynq key prefix    asynq:{<queue>}:
-- ARGV[6]  dedup key prefix    <prefix>:{<queue>}:
-- ARGV[7]  heal grace, integer seconds
-- ARGV[8]  fingerprint hex
-- ARGV[9]  running policy ('x' reject, 'a' allow, 'd' defer) recorded if this creates the lock
-- ARGV[10] ARGV[1] as lock records store it (see id_pack in lib.lua)
--
-- Reply: {1, ARGV[1]}  this attempt holds the lock (taken, or already the task's)
--        {0, holder}   held by another live task: the attempt must not run
--        {9, ARGV[1]}  the key's running policy is "allow": lock dropped, run unlocked
--
-- A new attempt replaces an older attempt's token, so a leftover handler of
-- that attempt can neither renew nor release the lock any more.
local now = now_parts()
local tprefix = ARGV[5] .. 't:'
local rec = redis.call('HMGET', KEYS[1], 'id', 'c', 'rp', 'b', 'f')
local holder = id_unpack(rec[1], ARGV[8])
if holder and holder ~= ARGV[1] then
  local orphan = false
  if now - (tonumber(rec[2]) or 0) >= tonumber(ARGV[7]) then
    local state = redis.call('HGET', tprefix .. holder, 'state')
    orphan = gone(state)
  end
  if not orphan then
    return {0, holder}
  end
  if rec[5] and rec[5] ~= ARGV[1] then
    return {0, holder} -- an orphan owed a follow-up: acquire or the follow-up settles it
  end
  redis.call('DEL', KEYS[1], ARGV[6] .. 'i:' .. holder)
  holder = false
  rec = {false, false, false, false, false}
end
if rec[4] then
  redis.call('ZREM', ARGV[6] .. 'w:' .. ARGV[4], ARGV[8])
  redis.call('HDEL', KEYS[1], 'b')
end
if holder and redis.call('GET', ARGV[6] .. 'f:' .. ARGV[8]) == ARGV[1] then
  redis.call('DEL', ARGV[6] .. 'f:' .. ARGV[8]) -- the follow-up is running: no longer owed
end
if rec[3] == 'a' or (not holder and ARGV[9] == 'a') then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    redis.call('DEL', KEYS[2])
  end
  return {9, ARGV[1]}
end
if not holder then
  if redis.call('GET', ARGV[6] .. 'f:' .. ARGV[8]) == ARGV[1] then
    redis.call('DEL', ARGV[6] .. 'f:' .. ARGV[8])
  end
  redis.call('HSET', KEYS[1], 'id', ARGV[10], 'c', now)
  if ARGV[9] ~= 'x' then
    redis.call('HSET', KEYS[1], 'rp', ARGV[9])
  end
end
redis.call('HSET', KEYS[1], 'tok', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[8], 'PX', ARGV[3])
end
return {1, ARGV[1]}
