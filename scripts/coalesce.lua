-- coalesce: write a merged payload into the waiting task that holds a key,
-- if nothing changed since acquire read it (compare-and-set on a version).
--
-- KEYS[1]  lock key
-- ARGV[1]  target task ID (the waiting holder, or its follow-up)
-- ARGV[2]  version acquire returned (the lock's fold count n)
-- ARGV[3]  merged payload
-- ARGV[4]  asynq key prefix    asynq:{<queue>}:
-- ARGV[5]  fingerprint hex
--
-- Reply: {1, state}  written; state is the target's asynq state
--        {0, ''}     something changed (another merge, the task started): call acquire again
--        {-1, reason} asynq's task record is not what this expects
local rec = redis.call('HMGET', KEYS[1], 'id', 'tok', 'f', 'n')
if (rec[4] or '0') ~= ARGV[2] then
  return {0, ''}
end
local owner = id_unpack(rec[1], ARGV[5])
local target = rec[3] or owner
if target ~= ARGV[1] or (target == owner and rec[2]) then
  return {0, ''}
end
local tkey = ARGV[4] .. 't:' .. target
local t = redis.call('HMGET', tkey, 'state', 'msg')
local state = t[1]
if not waiting(state) then
  return {0, ''}
end
local new = t[2] and pb_setpayload(t[2], ARGV[3])
if not new then return {-1, 'malformed task message'} end
if new ~= t[2] then
  redis.call('HSET', tkey, 'msg', new)
end
redis.call('HINCRBY', KEYS[1], 'n', 1)
return {1, state}
