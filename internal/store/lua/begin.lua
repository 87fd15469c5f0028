-- begin: attempts of tasks begin, in the common case: the lock was written
-- with its task (v) and still names it, and holds nothing else a start must
-- settle. Make each attempt its running owner; anything else is left to
-- start (lua/start.lua), which this changes nothing for. One call begins
-- the attempts of many tasks (one queue's: its keys share a slot).
--
-- KEYS[2i-1]  the i-th attempt's lock
-- KEYS[2i]    the key's follow-up pointer
-- ARGV[4i-3]  its task ID, as lock records store it
-- ARGV[4i-2]  its task ID (a lock of the earlier layout holds it whole)
-- ARGV[4i-1]  its attempt token (random per attempt)
-- ARGV[4i]    lease, integer milliseconds
--
-- Reply: one integer per attempt, in order:
--   1  this attempt holds the lock (it owes no follow-up)
--   0  not the common case (no lock, another owner, not written with its
--      task, a follow-up owed or this task the follow-up, a MaxPending
--      entry, a cooldown, RunningAllow): call start
--
-- As start does, a new attempt replaces an older attempt's token.
local out = {}
for i = 1, #KEYS / 2 do
  local lock, a = KEYS[2 * i - 1], 4 * i
  local rec = call('HMGET', lock, 'id', 'v', 'f', 'b', 'rp', 'cd', 'k')
  if (rec[1] ~= ARGV[a - 3] and rec[1] ~= ARGV[a - 2]) or not rec[2] or rec[3] or rec[4] or rec[6] or rec[7]
      or rec[5] == 'a' or call('GET', KEYS[2 * i]) == ARGV[a - 2] then
    out[i] = 0
  else
    call('HSET', lock, 'tok', ARGV[a - 1])
    call('PEXPIRE', lock, ARGV[a])
    out[i] = 1
  end
end
return out
