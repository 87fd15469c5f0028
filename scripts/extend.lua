-- extend: renew a lock's lifetime if its owner (task and attempt) still holds
-- it. The heartbeat renews running attempts; the client lengthens a waiting
-- lock when a task turns out to be scheduled.
--
-- KEYS[1]  lock key
-- KEYS[2]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID, as lock records store it (see id_pack in lib.lua)
-- ARGV[2]  attempt token, or '' to renew a waiting lock (no attempt running)
-- ARGV[3]  lifetime, integer milliseconds
-- ARGV[4]  asynq key prefix    asynq:{<queue>}:
-- ARGV[5]  how long a follow-up stays parked from now, integer seconds
-- ARGV[6]  dedup key prefix    <prefix>:{<queue>}:
-- ARGV[7]  fingerprint hex
--
-- Reply: 1 renewed; 0 the lock is gone or belongs to another task or attempt
--
-- A parked follow-up (Defer) is kept parked for another ARGV[5] seconds.
local rec = redis.call('HMGET', KEYS[1], 'id', 'tok', 'f')
if rec[1] ~= ARGV[1] or (rec[2] or '') ~= ARGV[2] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if KEYS[2] then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
if rec[3] then
  local now = now_parts()
  redis.call('ZADD', ARGV[4] .. 'scheduled', 'XX', now + tonumber(ARGV[5]), rec[3])
  redis.call('PEXPIRE', ARGV[6] .. 'f:' .. ARGV[7], tonumber(ARGV[5]) * 1000)
end
return 1
