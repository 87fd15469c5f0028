-- prune: drop from a type's waiting set (MaxPending) the entries of keys
-- that wait no more, which the caller found when the set was full (no
-- lock, or a holder that cannot run: deleted, archived, its queue purged),
-- if each lock's value is still what the caller read, so that a key taken
-- again meanwhile stays counted.
--
-- KEYS[1]    the waiting set; KEYS[1+i] the lock of the i-th candidate
-- ARGV[2i-1] the i-th candidate's fingerprint (its member of KEYS[1])
-- ARGV[2i]   its lock's value as the caller read it ('' for no lock)
--
-- Reply: the number of entries removed
local n = 0
for i = 1, #KEYS - 1 do
  if (call('GET', KEYS[i + 1]) or '') == ARGV[2 * i] then
    n = n + call('ZREM', KEYS[1], ARGV[2 * i - 1])
  end
end
return n
