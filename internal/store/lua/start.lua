-- start: an attempt that must check its key begins (a task whose mode acts
-- at start, one asynq runs again, one that lost its key, a follow-up, a
-- task that arrived without a lock): make sure the key is its task's.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; M  the key's mode record; T  the task's asynq record;
--   W  the task type's waiting set                                 always
--   H  asynq record of the holder ARGV[6]                          when another task holds the key
--   G  asynq record of the follow-up ARGV[8]; S, P, R  asynq's
--      scheduled set, pending list, retry set                      to hand the key to a follow-up
-- ARGV[1]  the roles of KEYS
-- ARGV[2]  task ID
-- ARGV[3]  the lock's lifetime while the task runs, integer milliseconds
-- ARGV[4]  flags: 'a' RunningAllow (the key is freed as the task starts);
--          'r' asynq runs the task again (a retry, a run by hand): a Replace
--          holder whose follow-up waits gives way to it
-- ARGV[5]  the key's fingerprint (its member of W)
-- ARGV[6]  the holder H belongs to ('' none); ARGV[7] heal grace, seconds
-- ARGV[8]  the follow-up G belongs to ('' none)
-- ARGV[9] on: the mode record of a lock this takes (the rule of a task that
--          arrived without a lock), as field, value pairs
--
-- Reply: {1, new}              the task holds the key (new '1': it took it now)
--        {0, holder, run}      held by another live task (run '1': it is running)
--        {14, holder, ms, k}   held after its last task ended (as take.lua)
--        {9, new}              RunningAllow: the lock is dropped (new '1': there was none)
--        {12, followup}        superseded: the key went to the waiting follow-up, which
--                              carries a newer payload; the task must not run
--        {11, lacking, holder, f}  nothing done: call again with these keys
--        {13}                  the task has no asynq record here (its server
--                              stores tasks in another Redis)
-- @lib: lib.lua is spliced in here.
roles(0)
local A = ARGV
local id, ttl, flags = A[2], A[3], A[4]
if call('EXISTS', K.T) == 0 then
  return {13}
end
local holder, kind, at = holder_of(call('GET', K.L))
local m = call('HMGET', K.M, 'id', 'rp', 'f', 'b')
local f = m[3]
local function need()
  return {11, lacking, holder or '', f or ''}
end
local allow, new = string.find(flags, 'a', 1, true), ''
if holder == id then
  if kind == 'f' then
    call('SET', K.L, id, 'PX', ttl) -- run again by hand after it failed for good: its own again
  end
elseif holder then
  if kind == 'c' or kind == 'f' then
    return {14, holder, call('PTTL', K.L), kind}
  end
  if kind == 'x' then
    return {0, holder, ''}
  end
  if holder ~= A[6] then K.H = nil end
  if lacks('H') then return need() end
  local st = call('HGET', K.H, 'state')
  local now = now_parts()
  if (st and not gone(st)) or (not st and kind == 'w' and now - at < tonumber(A[7])) then
    return {0, holder, st == 'active' and '1' or ''}
  end
  if st == 'archived' then
    mark(K.H, 'healed')
  end
  call('DEL', K.L)
  holder = nil
end
if not holder then
  new = '1'
  if allow then
    return {9, new}
  end
  call('SET', K.L, id, 'PX', ttl)
  if #A > 8 then
    call('DEL', K.M)
    call('HSET', K.M, unpack(A, 9))
    call('PEXPIRE', K.M, ttl)
    m, f = {id}, nil
  end
end
if m[4] and (not f or f == id) then
  call('ZREM', K.W, A[5]) -- the key waits no more (MaxPending), but for the follow-up it owes
  call('HDEL', K.M, 'b')
end
if f == id then
  call('HDEL', K.M, 'f') -- the follow-up runs: owed no more
  f = nil
end
if allow then
  call('DEL', K.L)
  return {9, new}
end
if f and m[1] == id and m[2] == 'r' and string.find(flags, 'r', 1, true) then
  if f ~= A[8] then K.G = nil end
  if lacks('GSPR') then return need() end
  local fst = call('HGET', K.G, 'state')
  if waiting(fst) then
    queue_now(K.G, f, fst, K.S, K.R, K.P)
    call('SET', K.L, f, 'PX', ttl)
    call('HSET', K.M, 'id', f, 'n', 0)
    call('HDEL', K.M, 'f')
    keep(K.L, K.M)
    return {12, f}
  end
end
lengthen(K.L, ttl)
return {1, new}
