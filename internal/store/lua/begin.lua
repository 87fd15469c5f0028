-- begin: an attempt of a task begins, in the common case: the lock was
-- written with its task (v) and still names it, and holds nothing else a
-- start must settle. Make the attempt its running owner; anything else is
-- left to start (lua/start.lua), which this changes nothing for.
--
-- KEYS[1]  the lock
-- KEYS[2]  the key's follow-up pointer
-- ARGV[1]  task ID, as lock records store it
-- ARGV[2]  task ID (a lock of the earlier layout holds it whole)
-- ARGV[3]  attempt token (random per attempt)
-- ARGV[4]  lease, integer milliseconds
--
-- Reply: 1  this attempt holds the lock (it owes no follow-up)
--        0  not the common case (no lock, another owner, not written with
--           its task, a follow-up owed or this task the follow-up, a
--           MaxPending entry, a cooldown, RunningAllow): call start
--
-- As start does, a new attempt replaces an older attempt's token.
local rec = call('HMGET', KEYS[1], 'id', 'v', 'f', 'b', 'rp', 'cd', 'k')
if (rec[1] ~= ARGV[1] and rec[1] ~= ARGV[2]) or not rec[2] or rec[3] or rec[4] or rec[6] or rec[7] or rec[5] == 'a' then
  return 0
end
if call('GET', KEYS[2]) == ARGV[2] then
  return 0
end
call('HSET', KEYS[1], 'tok', ARGV[3])
call('PEXPIRE', KEYS[1], ARGV[4])
return 1
