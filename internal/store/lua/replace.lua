-- replace: write a new payload into the waiting task that holds a key, when
-- the caller knows which task that is: the common Replace, in as few steps
-- as it takes. In any other case (another holder, a follow-up owed, an
-- attempt running, the task not waiting or its record not of asynq's
-- shape) it changes nothing and says so, and the caller runs acquire.
--
-- KEYS[1]  the lock
-- KEYS[2]  asynq record of the holder ARGV[1]
-- ARGV[1]  the holder, as lock records store it
-- ARGV[2]  the new payload as an encoded TaskMessage field 2 ('' when empty)
-- ARGV[3]  the new task's type as an encoded TaskMessage field 1: a payload
--          only lands in a task of its own type
--
-- Reply: {3, state}  replaced; state is the holder's asynq state
--        {0}         not done: run acquire
-- @pb: pb.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'f', 'tok', 'k')
if rec[1] ~= ARGV[1] or rec[2] or rec[3] or rec[4] then -- (k: cooling, acquire answers)
  return {0}
end
local t = call('HMGET', KEYS[2], 'state', 'msg')
local state = t[1]
if state ~= 'pending' and state ~= 'scheduled' and state ~= 'retry' then
  return {0}
end
if not t[2] or string.sub(t[2], 1, #ARGV[3]) ~= ARGV[3] then
  return {0} -- (acquire answers a holder of another type: a duplicate)
end
local new = pb_splice(t[2], ARGV[2])
if not new then
  return {0}
end
if new ~= t[2] then -- the same payload again (common): nothing to write
  call('HSET', KEYS[2], 'msg', new)
end
call('HINCRBY', KEYS[1], 'n', 1)
return {3, state}
