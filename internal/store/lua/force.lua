-- force: release a key's lock whoever holds it (Dedup.Release without a
-- holder), with its entry in its type's waiting set, in one step: a lock
-- that changes hands meanwhile cannot make it miss. The owner's index key
-- (a caller-chosen ID) stays, so the owner, if it still runs, finds its
-- key by it. A follow-up the lock owes that still waits is queued now,
-- unless an attempt of the owner runs (the run's end queues it); the key
-- is free, and it takes it when it starts.
--
-- KEYS[1]  the lock
-- KEYS[2]  the waiting set of the caller's type (MaxPending)
-- KEYS[3]  asynq pending list, KEYS[4] asynq scheduled set, of the queue
-- KEYS[5]  the key's follow-up pointer
-- KEYS[6]  asynq record of the follow-up ARGV[2], if ARGV[2] is not ''
-- ARGV[1]  fingerprint (member of KEYS[2])
-- ARGV[2]  the follow-up the caller expects the lock to owe ('' for none)
--
-- Reply: {1, owner, f}  released; owner: as the lock stored it; f: the follow-up queued now, or ''
--        {0}            no lock
--        {4, f}         the lock owes the follow-up f, not ARGV[2]: call again with its record
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'b', 'f', 'tok')
if not rec[1] then
  return {0}
end
local f = rec[3]
local queued = ''
if f and not rec[4] then
  if f ~= ARGV[2] or not KEYS[6] then
    return {4, f}
  end
  local fstate = call('HGET', KEYS[6], 'state')
  if waiting(fstate) then
    local _, _, ns = now_parts()
    queue_now(KEYS[4], KEYS[3], KEYS[6], f, fstate, ns)
    call('DEL', KEYS[5])
    queued = f
  end
end
call('DEL', KEYS[1])
if rec[2] then
  call('ZREM', KEYS[2], ARGV[1])
end
return {1, rec[1], queued}
