-- release: an operator releases a lock (Dedup.Release with a holder,
-- dedupctl release, doctor --fix), if its owner is still the one the
-- operator read, with the lock's entry in its type's waiting set. The
-- owner's index key (a caller-chosen ID) stays: the owner, if it still
-- runs, finds its key by it; and its marker X says it was released, so
-- that, should it meet a task of its type holding the key (which took it
-- since), it gives way (start). doctor's release, of an owner that cannot
-- run ('stuck'), deletes the index instead.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; I  index key of the owner; W  waiting set of the owner's type      always
--   O  the owner's asynq record; P, A, S, Q  its queue's pending list, active list,
--      scheduled set, retry set                                                    with 'stuck', or a follow-up owed
--   F  the key's follow-up pointer; G  the follow-up's asynq record                 with a follow-up owed
--   X  the owner's superseded marker                                                but with 'stuck'
-- ARGV[1]  the roles of KEYS, one letter each
-- ARGV[2]  the owner read before, as the lock stores it
-- ARGV[3]  fingerprint
-- ARGV[4]  the lock's take time read before (field c): a caller-chosen ID can
--          take the key again after the lock was read, under the same owner
-- ARGV[5]  the owner's whole ID
-- ARGV[6]  the follow-up read before ('' for none), ARGV[7] it as locks store it
-- ARGV[8]  'stuck' (dedupctl doctor --fix): release only if the owner still
--          cannot run (no record, completed, archived, or not where its state
--          says), and hand the key to a follow-up that waits; else ''
--
-- A follow-up the lock owes that still waits is queued now: its payload is
-- the newest, and it would otherwise stay parked for the owner's retry
-- delay (or until a run that lost its lock ends). With 'stuck' it takes the
-- key; else the key is free and it takes it when it starts.
--
-- Reply: {1, 1 if the index key was deleted else 0[, follow-up, 'owner' or 'queued']}
--                     released (the follow-up, if named, queued: the key's owner now, or free)
--        {0}          no lock
--        {2, owner}   another owner (as stored), or taken again since
--        {3, state}   ('stuck') the owner can run now: kept
-- @lib: lib.lua is spliced in here.
roles(0)
local rec = call('HMGET', K.L, 'id', 'b', 'c', 'f')
if not rec[1] then
  return {0}
end
if rec[1] ~= ARGV[2] or (rec[3] or '') ~= ARGV[4] or (rec[4] or '') ~= ARGV[6] then
  return {2, rec[1]}
end
local stuck = ARGV[8] == 'stuck'
if stuck then
  local state, there = placed(K.O, K.P, K.A, K.S, K.Q, ARGV[5])
  if state ~= '' and not gone(state) and there then
    return {3, state}
  end
end
local idx = 0
if stuck and call('GET', K.I) == ARGV[3] then
  call('DEL', K.I)
  idx = 1
end
local pttl = call('PTTL', K.L)
if K.X and pttl > 0 then
  local _, now_ms = now_parts()
  call('SET', K.X, 'r:' .. now_ms, 'PX', pttl)
end
local f = rec[4]
if f and K.G then
  local fstate = call('HGET', K.G, 'state')
  if waiting(fstate) then
    local _, _, ns = now_parts()
    queue_now(K.S, K.P, K.G, f, fstate, ns)
    call('DEL', K.F)
    if stuck then
      call('HDEL', K.L, 'tok', 'f')
      call('HSET', K.L, 'id', ARGV[7], 'c', (now_parts()), 'v', '1') -- (its lifetime stays)
      return {1, idx, f, 'owner'}
    end
    call('DEL', K.L) -- (its waiting-set entry stays: the follow-up waits; prune drops it once it starts)
    return {1, idx, f, 'queued'}
  end
end
call('DEL', K.L)
if rec[2] then
  call('ZREM', K.W, ARGV[3])
end
return {1, idx}
