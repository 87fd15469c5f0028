-- start: an attempt that must check its key begins (a task whose mode acts at
-- start, one asynq runs again, one that lost its key, a follow-up, a task that
-- arrived without a lock): make sure the key is its task's.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; M  the key's mode record; T  the task's asynq record;
--   W  the task type's waiting set                                 always
--   H  asynq record of the holder ARGV[6]                          when another task holds the key
-- ARGV[1]  the roles of KEYS; ARGV[2] task ID
-- ARGV[3]  the lock's lifetime while the task runs, integer milliseconds
-- ARGV[4]  '1': RunningAllow (the key is freed as the task starts)
-- ARGV[5]  the key's fingerprint (its member of W)
-- ARGV[6]  the holder H belongs to ('' none); ARGV[7] heal grace, integer seconds
-- ARGV[8]  the attempt's token, in a lock taken as '~a' (value.go's StartValue)
-- ARGV[9] on: the mode record of a lock this takes (the rule of a task that
--          arrived without a lock), as field, value pairs
--
-- Reply: {1, new, value}       the task holds the key (new '1': it took it now), the lock's value
--        {0, holder, run}      held by another live task (run '1': it is running)
--        {14, holder, ms, k}   held after its last task ended (as acquire.lua)
--        {9, new}              RunningAllow: the lock is dropped (new '1': there was none)
--        {11, lacking, holder} nothing done: call again with these keys
--        {13}                  the task has no asynq record here (its server
--                              stores tasks in another Redis)
roles(0)
local A = ARGV
local id, ttl, allow, new, own = A[2], A[3], A[4] == '1', '', '~a' .. A[8] .. ':' .. A[2]
if call('EXISTS', K.T) == 0 then return {13} end
local v = call('GET', K.L)
if not v and not allow and #A < 9 and call('EXISTS', K.M) == 0 then -- a free key, no mode (most arrivals): before lib.lua
  own = call('HGET', K.T, 'unique_key') == K.L and id or own
  call('SET', K.L, own, 'PX', ttl)
  return {1, '1', own}
end
-- @lib: lib.lua is spliced in here.
local holder, kind, at = holder_of(v)
local m = call('HMGET', K.M, 'id', 'f', 'b', 'e', 'o', 'cd')
local f = m[2]
if kind == 'c' then return {14, holder, call('PTTL', K.L), kind} end -- (its own: it succeeded already)
if holder == id then
  -- A handler of an attempt of its own that asynq gave up still runs: it waits.
  if m[1] == id and outlived(m[5]) then return {0, holder, '1'} end
  if m[1] == id and m[4] then -- run again by hand after it failed for good: its own again
    call('HDEL', K.M, 'e')
    call('PEXPIRE', K.L, kind == 'k' and math.max(tonumber(ttl), at - select(2, now_parts())) or ttl) -- (a kept key: its window at least)
  end
  if kind == 'a' then call('SET', K.L, own, 'KEEPTTL') end -- (this attempt's: an earlier one's late release leaves it)
elseif holder then
  if kind == 'x' then return {0, holder, ''} end
  if holder ~= A[6] then K.H = nil end
  if lacks('H') then return {11, lacking, holder} end
  local st = call('HGET', K.H, 'state')
  local moved = st and not belongs(K.H, holder, kind, K.L) -- (another key's task now: this key's is gone)
  if moved then st = nil end
  local runs = m[1] == holder and outlived(m[5])
  local left = cools(kind, at, st)
  if left then return {14, holder, left, 'c'} end
  if not gone(st) or runs or (not st and not moved and kind == 'w' and now_parts() - at < tonumber(A[7])) then
    return {0, holder, (st == 'active' or runs) and '1' or ''}
  end
  if (not st or st == 'archived') and m[1] == holder and m[4] then
    return {14, holder, call('PTTL', K.L), 'f'} -- it failed for good, and holds the key (OnFailure)
  end
  if st == 'archived' or (kind == 'k' and st == 'completed') then mark(K.H, 'healed') end
  call('DEL', K.L)
  holder = nil
end
if not holder then
  new = '1'
  if allow then return {9, new} end
  -- Its own ID, where its record names the lock (asynq releases it), else '~a<token>:':
  -- the task's end releases it. A task whose mode record keeps a cooldown
  -- (or window) not yet over takes it back kept until then ('~k', as it took
  -- it at enqueue): a kept task's success makes no call to cool it.
  local v, cd = id, m[1] == id and m[6] or '0'
  local left = tonumber(cd) - select(2, now_parts())
  if call('HGET', K.T, 'unique_key') ~= K.L then v = own
  elseif left > 0 then v, ttl = '~k' .. cd .. ':' .. id, math.max(tonumber(ttl), left) end
  call('SET', K.L, v, 'PX', ttl)
  if #A > 8 then
    call('DEL', K.M)
    call('HSET', K.M, unpack(A, 9))
    if f then call('HSET', K.M, 'f', f) end -- (a follow-up the key owes runs after this task)
    if f and m[3] then call('HSET', K.M, 'b', m[3]) end -- (and waits, for MaxPending)
    call('PEXPIRE', K.M, ttl)
    m[1], m[3] = id, m[3] or '1' -- (a gone holder's waiting-set entry goes, but for the follow-up's)
  end
end
-- The key waits no more (MaxPending), but for the follow-up it owes; a follow-up
-- that runs is owed no more.
if m[3] and (not f or f == id) then call('ZREM', K.W, A[5]) end
if not f or f == id then call('HDEL', K.M, 'b', 'f') end
if allow then call('DEL', K.L) else lengthen(K.L, ttl) end
return {allow and 9 or 1, new, not allow and call('GET', K.L) or ''}
