-- force: release a key's lock whoever holds it (Dedup.Release without a
-- holder), with its entry in its type's waiting set, in one step: a lock
-- that changes hands meanwhile cannot make it miss. The owner's index key
-- (a caller-chosen ID) stays, so the owner, if it still runs, finds its key
-- by it; and the owner the caller expected (read just before) gets its
-- marker X, as release.lua writes it. A follow-up the lock owes that still
-- waits is queued now (the key is free, and it takes it when it starts).
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; W  the waiting set of the caller's type; P, S  asynq's
--      pending list and scheduled set of the queue; F  the key's follow-up pointer   always
--   G  asynq record of the follow-up ARGV[3]                                         with ARGV[3]
--   X  the superseded marker of the owner ARGV[4]                                    with ARGV[4]
-- ARGV[1]  the roles of KEYS, one letter each
-- ARGV[2]  fingerprint (member of W)
-- ARGV[3]  the follow-up the caller expects the lock to owe ('' for none)
-- ARGV[4]  the owner the caller expects, as the lock stores it ('' for none)
--
-- Reply: {1, owner, f}  released; owner: as the lock stored it; f: the follow-up queued now, or ''
--        {0}            no lock
--        {4, f}         the lock owes the follow-up f, not ARGV[3]: call again with its record
-- @lib: lib.lua is spliced in here.
roles(0)
local rec = call('HMGET', K.L, 'id', 'b', 'f')
if not rec[1] then
  return {0}
end
local f = rec[3]
if f and (f ~= ARGV[3] or not K.G) then
  return {4, f}
end
local queued = ''
if f then
  local fstate = call('HGET', K.G, 'state')
  if waiting(fstate) then
    local _, _, ns = now_parts()
    queue_now(K.S, K.P, K.G, f, fstate, ns)
    call('DEL', K.F)
    queued = f
  end
end
local pttl = call('PTTL', K.L)
if K.X and rec[1] == ARGV[4] and pttl > 0 then
  local _, now_ms = now_parts()
  call('SET', K.X, 'r:' .. now_ms, 'PX', pttl)
end
call('DEL', K.L)
if rec[2] and queued == '' then
  call('ZREM', K.W, ARGV[2])
end
return {1, rec[1], queued}
