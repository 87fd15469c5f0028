-- release: delete a key's lock for an operator (Dedup.Release, dedupctl release,
-- doctor --fix) or for a producer whose enqueue asynq refused. A holder still
-- waiting or running is marked (lib.lua's mark): should it run (again), it checks
-- the key first. A follow-up the key owes that waits is queued now: its payload
-- is the newest.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock                                                          always
--   M  the key's mode record; W  the type's waiting set      but for 'unlock' of an uncounted key
--   H  asynq record of the holder ARGV[5]; P, A, S, R  asynq's pending list,
--      active list, scheduled set and retry set of the queue             but for 'unlock'
--   G  asynq record of the follow-up ARGV[6]                             when the mode record names one
-- ARGV[1]  the roles of KEYS
-- ARGV[2]  'release': if ARGV[3] holds the key; 'force': whoever holds it;
--          'unlock': if the lock's value is ARGV[3] exactly (a refused enqueue's
--          own); 'stuck': if ARGV[3] holds it and cannot run (no record,
--          completed, archived, or not where its state says) and no policy keeps
--          it (a cooldown, a failure hold, a firing's window). With 'stuck', a key
--          whose lock is gone with its holder ARGV[3] (asynq's DeleteTask) but whose
--          mode record names a follow-up it owed queues it, and it takes the key.
-- ARGV[3]  the holder (the value, for 'unlock'); ARGV[4] the key's fingerprint
-- ARGV[5]  the holder H belongs to; ARGV[6] the follow-up G belongs to
-- ARGV[7]  heal grace, integer seconds ('stuck')
--
-- Reply: {1, holder, queued}  released; queued: the follow-up queued now, or ''
--        {0}                  no lock (and, with 'stuck', no follow-up owed)
--        {2, holder}          held by another task (or value)
--        {3, why}             'stuck': kept (why: the holder's state, or the kind of hold)
--        {11, lacking, holder, f}  nothing done: call again with these keys
-- @lib: lib.lua is spliced in here.
roles(0)
local A = ARGV
local v = call('GET', K.L)
local holder, kind, at = holder_of(v)
local m = K.M and call('HMGET', K.M, 'id', 'f', 'b', 'e', 'o') or {}
if not v then
  -- No lock: asynq deleted it with its holder. With 'stuck' a follow-up the
  -- holder owed, which still waits, is queued now (the key is free for it).
  if A[2] ~= 'stuck' or m[1] ~= A[3] or not m[2] then return {0} end
  holder = A[3]
end
if A[2] == 'unlock' then
  if v ~= A[3] then return {2, holder} end
  call('DEL', K.L)
  if m[1] == holder and m[3] then call('ZREM', K.W, A[4]) end
  return {1, holder, ''}
end
if A[2] ~= 'force' and holder ~= A[3] then return {2, holder} end
local f = m[2]
if holder ~= A[5] then K.H = nil end
if f ~= A[6] then K.G = nil end
if lacks('HPASR' .. (f and 'G' or '')) then return {11, lacking, holder, f or ''} end
-- The holder's state ('' with no record), and whether the list or set it names
-- holds it (true for one that names none: completed, archived, aggregating).
local st, there = call('HGET', K.H, 'state') or '', true
local moved = st ~= '' and not belongs(K.H, holder, kind, K.L) -- (another key's task now)
if moved then st = '' end
if st == 'pending' or st == 'active' then
  there = call('LPOS', st == 'pending' and K.P or K.A, holder)
elseif st == 'scheduled' or st == 'retry' then
  there = call('ZSCORE', st == 'retry' and K.R or K.S, holder)
end
if A[2] == 'stuck' then
  if kind == 'c' or kind == 'x' or cools(kind, at, st) then return {3, kind == 'k' and 'c' or kind} end
  if (st == '' or st == 'archived') and m[1] == holder and m[4] then return {3, 'failed'} end
  if m[1] == holder and outlived(m[5]) then return {3, 'active'} end -- (a handler asynq gave up still runs)
  if st == '' and not moved and kind == 'w' and now_parts() - at < tonumber(A[7]) then return {3, 'reserved'} end
  if st ~= '' and not gone(st) and there then return {3, st} end
end
if not moved and (waiting(st) or st == 'active' or (kind == 'k' and st == 'completed')) then
  mark(K.H, 'released') -- (asynq keeps a running task's message if it requeues it)
end
local queued = f and queue_now(f) and f or ''
if queued ~= '' then call('HDEL', K.M, 'f') end
if queued ~= '' and A[2] == 'stuck' then
  -- The holder cannot run: its follow-up takes the key (and its mode); with no lock, for its mode record's lifetime.
  if v then call('SET', K.L, queued, 'KEEPTTL') else local t = call('PTTL', K.M) call('SET', K.L, queued, unpack(t > 0 and {'PX', t} or {})) end
  hand(K.M, queued, 0)
  return {1, holder, queued}
end
call('DEL', K.L)
if m[3] and queued == '' then call('ZREM', K.W, A[4]) end
return {1, holder, queued}
