-- merge: write a merged payload into the waiting task that holds a key (or into
-- the follow-up it owes), if nothing changed since acquire read it:
-- compare-and-set on the key's fold count.
--
-- KEYS[1]  the lock; KEYS[2] the key's mode record; KEYS[3] asynq record of the target
-- KEYS[4]  asynq scheduled set; KEYS[5] the type's waiting set   with ARGV[5] (KEYS[5]: when counted)
-- ARGV[1]  the target: the waiting holder, or the lock's follow-up
-- ARGV[2]  '1' if the target is the follow-up, '' if the holder
-- ARGV[3]  the version acquire returned (the fold count)
-- ARGV[4]  the merged payload as an encoded TaskMessage field 2 ('' when empty)
-- ARGV[5]  debounce: unix seconds a scheduled holder becomes due ('0' none),
--          ARGV[6] its lock's lifetime from now (integer ms), ARGV[7] the key's
--          fingerprint, ARGV[8] the producer's clock (unix integer ms)
--
-- Reply: {1, state}    written; state: the target's asynq state
--        {0}           something changed meanwhile: call acquire again
--        {-1, reason}  asynq's task record is not what this expects
-- @lib: lib.lua is spliced in here.
local holder, kind = holder_of(call('GET', KEYS[1]))
local m = call('HMGET', KEYS[2], 'id', 'f', 'n', 'o')
if not holder or kind == 'c' or kind == 'x' or (m[1] == holder and m[3] or '0') ~= ARGV[3]
    or (ARGV[2] == '1' and m[2] ~= ARGV[1]) or (ARGV[2] ~= '1' and holder ~= ARGV[1])
    or (ARGV[2] ~= '1' and m[1] == holder and outlived(m[4])) then -- (acquire.lua's zombie)
  return {0}
end
local t = call('HMGET', KEYS[3], 'state', 'msg')
if not waiting(t[1]) then return {0} end
local new = t[2] and pb_setpayload(t[2], ARGV[4])
if not new then return {-1, 'malformed task message'} end
if new ~= t[2] then call('HSET', KEYS[3], 'msg', new) end
count(KEYS[1], KEYS[2], m[1], holder)
if ARGV[2] ~= '1' and KEYS[4] then
  debounce(KEYS[1], KEYS[4], ARGV[1], t[1], ARGV[5], ARGV[6], KEYS[5], ARGV[7], tonumber(ARGV[8]))
end
return {1, t[1]}
