-- done: attempts that hold their locks ended for good (success, revoked,
-- final failure), in the common case: a lock that owes no follow-up and has
-- no cooldown. Release them; anything else is left to finish
-- (lua/finish.lua), which this changes nothing for. One call settles the
-- attempts of many tasks (one node's, one slot's on a Cluster).
--
-- KEYS[i]      the lock of the i-th attempt
-- ARGV[3i-2]   its task ID, as lock records store it
-- ARGV[3i-1]   its task ID (a lock of the earlier layout holds it whole)
-- ARGV[3i]     its attempt token ('' for an attempt that ran without a
--              start: its lock holds no token)
--
-- Reply: one integer per lock, in order:
--   1  released
--   0  not ours any more (another task, or another attempt's token): untouched
--   2  the lock owes a follow-up or has a cooldown: call finish
local out = {}
for i = 1, #KEYS do
  local rec = call('HMGET', KEYS[i], 'id', 'tok', 'f', 'cd')
  local a = 3 * i
  if (rec[1] ~= ARGV[a - 2] and rec[1] ~= ARGV[a - 1]) or (rec[2] or '') ~= ARGV[a] then
    out[i] = 0
  elseif rec[3] or rec[4] then
    out[i] = 2
  else
    call('DEL', KEYS[i])
    out[i] = 1
  end
end
return out
