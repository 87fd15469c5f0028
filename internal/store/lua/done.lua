-- done: an attempt that holds its lock ended for good (success, revoked,
-- final failure) in the common case: the lock owes no follow-up and has no
-- cooldown. Release it; anything else is left to finish (lua/finish.lua),
-- which this changes nothing for.
--
-- KEYS[1]  the lock
-- ARGV[1]  task ID, as lock records store it
-- ARGV[2]  task ID (a lock of the earlier layout holds it whole)
-- ARGV[3]  attempt token
--
-- Reply: 1  released
--        0  not ours any more (another task or a newer attempt): untouched
--        2  the lock owes a follow-up or has a cooldown: call finish
local rec = call('HMGET', KEYS[1], 'id', 'tok', 'f', 'cd')
if (rec[1] ~= ARGV[1] and rec[1] ~= ARGV[2]) or rec[2] ~= ARGV[3] then
  return 0
end
if rec[3] or rec[4] then
  return 2
end
call('DEL', KEYS[1])
return 1
