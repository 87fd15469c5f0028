-- release: an operator force-releases a lock (dedupctl release), if its
-- owner is still the one the operator confirmed, with the owner's index key
-- (when it points to this lock) and the lock's entry in its type's waiting
-- set.
--
-- KEYS[1]  the lock
-- KEYS[2]  index key of the owner
-- KEYS[3]  waiting set of the owner's type
-- ARGV[1]  the owner read before, as the lock stores it
-- ARGV[2]  fingerprint
--
-- Reply: {1, 1 if the index key was deleted else 0}  released
--        {0}                                         no lock
--        {2, owner}                                  another owner now (as stored)
local rec = call('HMGET', KEYS[1], 'id', 'b')
if not rec[1] then
  return {0}
end
if rec[1] ~= ARGV[1] then
  return {2, rec[1]}
end
call('DEL', KEYS[1])
local idx = 0
if call('GET', KEYS[2]) == ARGV[2] then
  call('DEL', KEYS[2])
  idx = 1
end
if rec[2] then
  call('ZREM', KEYS[3], ARGV[2])
end
return {1, idx}
