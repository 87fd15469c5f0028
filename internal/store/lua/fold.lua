-- fold: write a new payload into the waiting task that holds a key, when the
-- caller knows which task that is: the common Replace, in as few steps as it
-- takes (acquire.lua does the same and everything else). Any other case (another
-- holder or lock form, a follow-up owed, a given-up handler of the holder that may
-- still run, the task not waiting, not of this type, or of a shape pb_splice does
-- not read) changes nothing and says so: the caller runs acquire.lua.
--
-- KEYS[1]  the lock; KEYS[2] the key's mode record; KEYS[3] asynq record of ARGV[1]
-- ARGV[1]  the holder the caller expects (an ID the library made)
-- ARGV[2]  the new payload as an encoded TaskMessage field 2 ('' when empty)
-- ARGV[3]  the task type as an encoded TaskMessage field 1: a payload only
--          lands in a task of its own type
--
-- Reply: {3, holder, state, ''}  written (state: the holder's asynq state),
--                                and counted as acquire.lua's count does
--        {11}                    nothing done: run acquire.lua
if call('GET', KEYS[1]) ~= ARGV[1] then return {11} end
local m = call('HMGET', KEYS[2], 'id', 'f', 'o')
if m[2] or m[3] then return {11} end -- (a follow-up owed, or a given-up handler that may still run)
local t = call('HMGET', KEYS[3], 'state', 'msg')
local state, msg = t[1], t[2]
if not waiting(state) or not msg or string.sub(msg, 1, #ARGV[3]) ~= ARGV[3] or ended(msg) then
  return {11} -- (not waiting, another type's, or put back after its end: it will not run)
end
-- @pb
local new = pb_splice(msg, ARGV[2])
if not new then return {11} end
if new ~= msg then call('HSET', KEYS[3], 'msg', new) end -- (the same payload again, as is common: no write)
if m[1] ~= ARGV[1] then call('HSET', KEYS[2], 'id', ARGV[1], 'n', 1) else call('HINCRBY', KEYS[2], 'n', 1) end
keep(KEYS[1], KEYS[2])
return {3, ARGV[1], state, ''}
