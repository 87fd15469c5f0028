-- take: at enqueue, take a free key for a new task in one small step, as asynq's
-- enqueueUniqueCmd takes its own; or say who holds the key.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock                                               always
--   T  asynq record of the new task                           with ARGV[4] or ARGV[11]
--   P  asynq pending list, S scheduled set                    with ARGV[4] (the one it goes
--                                                             to); both with ARGV[12]
--   M  the key's mode record                                  with ARGV[14] or ARGV[15] on
--   W  the type's waiting set (MaxPending)                    with ARGV[12]
--   H  asynq record of the holder ARGV[9]                     with ARGV[9]
-- ARGV[1]  the roles of KEYS; ARGV[2] ID of the new task
-- ARGV[3]  the lock's value for it (record.go: the ID, or a '~w'/'~x' form)
-- ARGV[4]  the task's asynq message to store with the lock ('' for none: the
--          caller enqueues it through asynq's client; '-': the caller has one
--          but did not send it, expecting the key held)
-- ARGV[5]  for ARGV[4]: unix seconds it is due ('0': pending now)
-- ARGV[6]  the producer's clock, unix integer ms; ARGV[7] the lock's lifetime, integer ms
-- ARGV[8]  '1': the task's record names the lock (unique_key; ARGV[4]'s
--          UniqueKey names it too), so that asynq's own scripts release it
-- ARGV[9]  the holder the caller expects ('' for none); ARGV[10] '1': a live
--          ARGV[9] holding a lock of its own ID is answered from the lock alone
--          (its record was read moments ago)
-- ARGV[11] '1': the ID is the caller's: refused if a task has it
-- ARGV[12] MaxPending: most keys of the type waiting in the queue ('0': none)
-- ARGV[13] the key's fingerprint (its member of W)
-- ARGV[14] '1': the caller defers (RunningDefer): a follow-up the mode record
--          says is owed sends the call to acquire
-- ARGV[15] on: the mode record of a taken lock, as field, value pairs
--
-- Reply: {1}                   taken (and the task stored, with ARGV[4])
--        {10}                  free, and ARGV[4] is '-': call again with the task
--        {2}                   ARGV[2], not the caller's, holds it already: a try of
--                              this very call ran
--        {7}                   a task with the ID exists (the caller's ID is taken;
--                              or an earlier try of this call ran)
--        {8, waiting, queued}  ARGV[12] keys wait already; queued: the tasks in P
--                              and S (fewer: some entries are stale)
--        {14, holder, ms, 'c'} cooling after its task succeeded, for ms more
--        {0, holder}           held by a live task (or a firing's, 'x')
--        {11, holder}          held, or a follow-up is owed: run acquire
roles(0)
local A = ARGV
local v = call('GET', K.L)
if not v then
  if A[4] == '-' then return {10} end
  if A[14] == '1' and call('HEXISTS', K.M, 'f') == 1 then return {11, ''} end
  if (A[11] == '1' or A[4] ~= '') and call('EXISTS', K.T) == 1 then return {7} end -- (with ARGV[4]: an earlier try of this very call stored it)
  local now_ms, ttl, max = tonumber(A[6]), A[7], tonumber(A[12])
  if max > 0 then
    call('ZREMRANGEBYSCORE', K.W, '-inf', now_ms)
    local n = call('ZCARD', K.W)
    if n >= max then return {8, n, call('LLEN', K.P) + call('ZCARD', K.S)} end
    call('ZADD', K.W, now_ms + tonumber(ttl), A[13])
  end
  call('SET', K.L, A[3], 'PX', ttl)
  if A[4] ~= '' then
    -- Stored as asynq's enqueue (or schedule) script stores it. (Without a
    -- unique key the last pair names msg again: one HSET either way.)
    local u, uv = A[8] == '1' and 'unique_key' or 'msg', A[8] == '1' and K.L or A[4]
    if A[5] ~= '0' then
      call('HSET', K.T, 'msg', A[4], 'state', 'scheduled', u, uv)
      call('ZADD', K.S, A[5], A[2])
    else
      call('HSET', K.T, 'msg', A[4], 'state', 'pending', 'pending_since', A[6] .. '000000', u, uv)
      call('LPUSH', K.P, A[2])
    end
  end
  if #A > 14 then
    call('DEL', K.M)
    call('HSET', K.M, unpack(A, 15))
    call('PEXPIRE', K.M, ttl)
  end
  return {1}
end
local holder, kind, at = holder_of(v)
if kind == 'c' then return {14, holder, call('PTTL', K.L), kind} end
if holder == A[2] and A[11] ~= '1' then return {2} end
if kind == 'x' then return {0, holder} end
-- A caller's ID, which a task of another key may have now: acquire checks.
if not string.match(holder, '^d[dfkam]%-') then return {11, holder} end
-- (Only a lock asynq's scripts delete at the task's end is trusted alone.)
if holder == A[9] and A[10] == '1' and kind == '' then return {0, holder} end
local st = holder == A[9] and K.H and call('HGET', K.H, 'state')
local left = cools(kind, at, st)
if left then return {14, holder, left, 'c'} end
if st and st ~= 'completed' and st ~= 'archived' then return {0, holder} end
return {11, holder}
