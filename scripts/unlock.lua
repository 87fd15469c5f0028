-- unlock: give back a lock whose enqueue asynq refused.
--
-- KEYS[1]  lock key
-- KEYS[2]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID that took the lock, as lock records store it (see id_pack in lib.lua)
-- ARGV[2]  dedup key prefix    <prefix>:{<queue>}:
-- ARGV[3]  task type
-- ARGV[4]  fingerprint hex
--
-- Reply: 1 released; 0 not ours, or the task already started (left alone)
local rec = redis.call('HMGET', KEYS[1], 'id', 'tok', 'b')
if rec[1] ~= ARGV[1] or rec[2] then
  return 0
end
redis.call('DEL', KEYS[1])
if KEYS[2] then
  redis.call('DEL', KEYS[2])
end
if rec[3] then
  redis.call('ZREM', ARGV[2] .. 'w:' .. ARGV[3], ARGV[4])
end
return 1
