-- extend: make a key held by a running (or retrying) task live at least a while
-- more, with its mode record, and keep its follow-up parked: the heartbeat, for
-- handlers that run long enough to come near the lock's expiry.
--
-- KEYS[1]  the lock; KEYS[2] the key's mode record; KEYS[3] asynq's scheduled set;
-- KEYS[4]  the task's asynq record
-- ARGV[1]  task ID
-- ARGV[2]  how long the key stays held from now at least, integer milliseconds
-- ARGV[3]  asynq gave the attempt up while its handler runs: the mode record notes
--          it (field o: until now + ARGV[3] ms; '0' no note; renewed by the heartbeat)
--          until the handler's end, so that the key does not heal under it; the
--          task's record is marked 'outlived' (lib.lua's mark), so that a run of it
--          that asynq put back checks the key. An earlier holder's record becomes its.
-- ARGV[4]  with ARGV[3]: the attempt's token (field oa): only its end clears the note
--
-- Reply: 1 the key is the task's; 0 it is not (gone, or another task's)
-- @lib: lib.lua is spliced in here.
local holder, kind = holder_of(call('GET', KEYS[1]))
if holder ~= ARGV[1] then return 0 end
if kind == 'c' or kind == 'x' then return 1 end
local ms = tonumber(ARGV[2])
lengthen(KEYS[1], ms)
local m = call('HMGET', KEYS[2], 'id', 'f')
if ARGV[3] ~= '0' then
  if m[1] and m[1] ~= holder then hand(KEYS[2], holder, 0) end -- (an earlier holder's)
  call('HSET', KEYS[2], 'id', holder, 'o', select(2, now_parts()) + tonumber(ARGV[3]), 'oa', ARGV[4])
  keep(KEYS[1], KEYS[2]) -- (as long as the lock, a fail hold's with no end included; ms at least, below)
  m[1] = holder
  local msg = call('HGET', KEYS[4], 'msg')
  if msg and not string.find(msg, '\10dedup-lost\18', 1, true) then mark(KEYS[4], 'outlived') end
end
if m[1] == holder then
  lengthen(KEYS[2], ms)
  -- The follow-up stays parked past the key's new lifetime.
  if m[2] then call('ZADD', KEYS[3], 'XX', now_parts() + (ms - ms % 1000) / 1000 + 1, m[2]) end
end
return 1
