-- coalesce: write a merged payload into the waiting task that holds a key,
-- if nothing changed since acquire read it (compare-and-set on a version).
--
-- KEYS[1]  the lock
-- KEYS[2]  asynq record of the target task
-- KEYS[3]  asynq scheduled set, KEYS[4] index key of the target's ID (if it is
--          caller-chosen), given with ARGV[6]
-- KEYS[5]  the type's waiting set, given with ARGV[6] when the type is bounded
-- ARGV[1]  target task ID: the waiting holder, or the lock's follow-up
-- ARGV[2]  ARGV[1] as lock records store it
-- ARGV[3]  '1' if the target is the lock's follow-up, '' if its holder
-- ARGV[4]  version acquire returned (the lock's fold count n)
-- ARGV[5]  the merged payload as an encoded TaskMessage field 2 ('' when empty)
-- ARGV[6]  debounce: unix seconds a scheduled holder becomes due ['0' none]
-- ARGV[7]  with ARGV[6]: the lock's lifetime from now, integer milliseconds
-- ARGV[8]  with ARGV[6]: the fingerprint (KEYS[5]'s member), ARGV[9] the
--          producer's clock, unix integer milliseconds
--
-- Reply: {1, state}    written; state is the target's asynq state
--        {0}           something changed (another merge, the task started): call acquire again
--        {-1, reason}  asynq's task record is not what this expects
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'tok', 'f', 'n')
if (rec[4] or '0') ~= ARGV[4] then
  return {0}
end
if ARGV[3] == '1' then
  if rec[3] ~= ARGV[1] then return {0} end
elseif (rec[1] ~= ARGV[2] and rec[1] ~= ARGV[1]) or rec[2] then
  return {0}
end
-- (A follow-up pointer of a holder that waits is stale: the follow-up is
-- gone, and acquire named the holder. Any change bumps n or the owner.)
local t = call('HMGET', KEYS[2], 'state', 'msg')
local state = t[1]
if not waiting(state) then
  return {0}
end
local new = t[2] and pb_setpayload(t[2], ARGV[5])
if not new then return {-1, 'malformed task message'} end
if new ~= t[2] then
  call('HSET', KEYS[2], 'msg', new)
end
call('HINCRBY', KEYS[1], 'n', 1)
if ARGV[3] ~= '1' and KEYS[3] then
  debounce(KEYS[1], KEYS[3], ARGV[1], state, ARGV[6], ARGV[7], KEYS[4], KEYS[5], ARGV[8], tonumber(ARGV[9]))
end
return {1, state}
