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
-- ARGV[3]  the lock's take time read before (field c): a caller-chosen ID can
--          take the key again after the lock was read, under the same owner
-- KEYS[4]  (optional, dedupctl doctor) the owner's asynq record, KEYS[5..8] its
--          queue's pending list, active list, scheduled set, retry set, and
--          ARGV[4] the owner's whole ID: release only if the owner still
--          cannot run (no record, completed, archived, or not where its state
--          says)
--
-- Reply: {1, 1 if the index key was deleted else 0}  released
--        {0}                                         no lock
--        {2, owner}                                  another owner (as stored), or taken again since
--        {3, state}                                  (with KEYS[4]) the owner can run now: kept
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'b', 'c')
if not rec[1] then
  return {0}
end
if rec[1] ~= ARGV[1] or (rec[3] or '') ~= ARGV[3] then
  return {2, rec[1]}
end
if KEYS[4] then
  local state, there = placed(KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], ARGV[4])
  if state ~= '' and not gone(state) and there then
    return {3, state}
  end
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
