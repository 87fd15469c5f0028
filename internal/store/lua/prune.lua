-- prune: drop from a type's waiting set (MaxPending) the entries of keys
-- that wait no more, which the caller found when the set was full: their
-- lock is gone or not counted, or neither its owner nor its follow-up can
-- run (an operator deleted or archived the task, purged or deleted the
-- queue). An entry goes only if its lock still reads as the caller saw it,
-- so a key taken again meanwhile stays counted.
--
-- KEYS[1]    the waiting set
-- KEYS[1+i]  the lock of the i-th candidate
-- ARGV[4i-3] the i-th candidate's fingerprint (its member of KEYS[1])
-- ARGV[4i-2] its lock's owner as the caller read it, as stored ('' for no lock)
-- ARGV[4i-1] its lock's follow-up as the caller read it ('' for none)
-- ARGV[4i]   its lock's take time as the caller read it ('' for none)
--
-- Reply: the number of entries removed
local n = 0
for i = 1, #KEYS - 1 do
  local rec = call('HMGET', KEYS[i + 1], 'id', 'f', 'c')
  if (rec[1] or '') == ARGV[4 * i - 2] and (rec[2] or '') == ARGV[4 * i - 1] and (rec[3] or '') == ARGV[4 * i] then
    n = n + call('ZREM', KEYS[1], ARGV[4 * i - 3])
  end
end
return n
