-- release: an operator releases a lock (Dedup.Release, dedupctl release,
-- doctor --fix), if its owner is still the one the operator read, with the
-- lock's entry in its type's waiting set. The owner's index key (a
-- caller-chosen ID) stays: the owner, if it still runs, finds its key by
-- it; doctor's release, of an owner that cannot run, deletes it.
--
-- KEYS[1]  the lock
-- KEYS[2]  index key of the owner
-- KEYS[3]  waiting set of the owner's type
-- KEYS[4]  the owner's asynq record; KEYS[5..8] its queue's pending list,
--          active list, scheduled set, retry set (with ARGV[7] 'stuck', or
--          when the lock owed a follow-up)
-- KEYS[9]  the key's follow-up pointer, KEYS[10] the follow-up's asynq
--          record (when the lock owed a follow-up)
-- ARGV[1]  the owner read before, as the lock stores it
-- ARGV[2]  fingerprint
-- ARGV[3]  the lock's take time read before (field c): a caller-chosen ID can
--          take the key again after the lock was read, under the same owner
-- ARGV[4]  the owner's whole ID
-- ARGV[5]  the follow-up read before ('' for none), ARGV[6] it as locks store it
-- ARGV[7]  'stuck' (dedupctl doctor --fix): release only if the owner still
--          cannot run (no record, completed, archived, or not where its state
--          says), and hand the key to a follow-up that waits; else ''
--
-- A follow-up the lock owes that still waits is queued now, unless an
-- attempt of the owner runs (the run's end queues it): its payload is the
-- newest, and it would otherwise stay parked for the owner's retry delay.
-- With 'stuck' it takes the key; else the key is free and it takes it when
-- it starts.
--
-- Reply: {1, 1 if the index key was deleted else 0[, follow-up, 'owner' or 'queued']}
--                     released (the follow-up, if named, queued: the key's owner now, or free)
--        {0}          no lock
--        {2, owner}   another owner (as stored), or taken again since
--        {3, state}   ('stuck') the owner can run now: kept
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'b', 'c', 'f', 'tok')
if not rec[1] then
  return {0}
end
if rec[1] ~= ARGV[1] or (rec[3] or '') ~= ARGV[3] or (rec[4] or '') ~= ARGV[5] then
  return {2, rec[1]}
end
local stuck = ARGV[7] == 'stuck'
if stuck then
  local state, there = placed(KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], ARGV[4])
  if state ~= '' and not gone(state) and there then
    return {3, state}
  end
end
local idx = 0
if stuck and call('GET', KEYS[2]) == ARGV[2] then
  call('DEL', KEYS[2])
  idx = 1
end
local f = rec[4]
if f and KEYS[9] and not rec[5] then
  local fstate = call('HGET', KEYS[10], 'state')
  if waiting(fstate) then
    local _, _, ns = now_parts()
    queue_now(KEYS[7], KEYS[5], KEYS[10], f, fstate, ns)
    call('DEL', KEYS[9])
    if stuck then
      call('HDEL', KEYS[1], 'tok', 'f')
      call('HSET', KEYS[1], 'id', ARGV[6], 'c', (now_parts()), 'v', '1') -- (its lifetime stays)
      return {1, idx, f, 'owner'}
    end
    call('DEL', KEYS[1])
    if rec[2] then
      call('ZREM', KEYS[3], ARGV[2])
    end
    return {1, idx, f, 'queued'}
  end
end
call('DEL', KEYS[1])
if rec[2] then
  call('ZREM', KEYS[3], ARGV[2])
end
return {1, idx}
