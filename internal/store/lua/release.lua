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
-- KEYS[9]  (with KEYS[4], when the lock owed a follow-up) the key's follow-up
--          pointer, KEYS[10] the follow-up's asynq record; ARGV[5] the
--          follow-up read before ('' for none), ARGV[6] it as locks store it:
--          a follow-up that still waits takes the lock and is queued now, so
--          the newest payload runs now and not when its parked time comes
--
-- Reply: {1, 1 if the index key was deleted else 0[, follow-up]}  released (to the follow-up)
--        {0}                                         no lock
--        {2, owner}                                  another owner (as stored), or taken again since
--        {3, state}                                  (with KEYS[4]) the owner can run now: kept
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'b', 'c', 'f')
if not rec[1] then
  return {0}
end
if rec[1] ~= ARGV[1] or (rec[3] or '') ~= ARGV[3] or (KEYS[4] and (rec[4] or '') ~= (ARGV[5] or '')) then
  return {2, rec[1]}
end
if KEYS[4] then
  local state, there = placed(KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], ARGV[4])
  if state ~= '' and not gone(state) and there then
    return {3, state}
  end
end
local idx = 0
if call('GET', KEYS[2]) == ARGV[2] then
  call('DEL', KEYS[2])
  idx = 1
end
if KEYS[9] and rec[4] then
  local f = rec[4]
  local fstate = call('HGET', KEYS[10], 'state')
  if waiting(fstate) then
    if fstate == 'scheduled' then
      local _, _, ns = now_parts()
      call('ZREM', KEYS[7], f)
      call('LPUSH', KEYS[5], f)
      call('HSET', KEYS[10], 'state', 'pending', 'pending_since', ns)
    end
    call('DEL', KEYS[9])
    call('HDEL', KEYS[1], 'tok', 'f')
    call('HSET', KEYS[1], 'id', ARGV[6], 'c', (now_parts()), 'v', '1') -- (its lifetime stays)
    return {1, idx, f}
  end
end
call('DEL', KEYS[1])
if rec[2] then
  call('ZREM', KEYS[3], ARGV[2])
end
return {1, idx}
