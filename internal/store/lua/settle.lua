-- settle: an attempt whose mode acts at its end ended: hold the key for the
-- retry, hand it to the follow-up it owes, cool it down, hold it after a final
-- failure (as long as the holder's hold says), or release it where asynq will
-- not. Written before the handler's result reaches asynq, so no shutdown or
-- deadline can lose it.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; M  the key's mode record; T  the task's asynq record   always
--   G  asynq record of the follow-up ARGV[7]; S, P, R  asynq's
--      scheduled set, pending list, retry set                  when the mode record names one
-- ARGV[1]  the roles of KEYS; ARGV[2] task ID
-- ARGV[3]  how it ended: 'ok' (success), 'revoke', 'fail' (asynq archives it),
--          'retry' (asynq runs it again); 'note' (settled as it ran on: only its note goes)
-- ARGV[4]  'retry': how long the key stays held for the retry at least; else the
--          lock's lifetime for a follow-up it goes to (integer ms)
-- ARGV[5]  'fail': the handler's error
-- ARGV[6]  after 'ok' and 'revoke': 'a' leave a lock the record does not name as taken at
--          start (its deadline was near: asynq may yet retry it); else it is released ('1':
--          the record does not name it); 'q' a success that made no call, settled late
--          (owed.go): it acts once asynq's done released the lock ({12} while it names the task)
-- ARGV[7]  the follow-up G belongs to ('' none)
-- ARGV[8]  'retry': seconds until asynq runs the task again
-- ARGV[9]  the attempt's token if asynq gave it up while its handler ran: its note (o, oa) goes
-- ARGV[10] the lock's value as the attempt took it ('' any naming the task): else it is not the task's
--
-- Reply: {1, what[, followup]}  what: '' (asynq releases it, or a failure that heals
--                               at the key's next enqueue), 'released', 'held' (for the
--                               retry; with the follow-up it owes), 'cooling', 'failed',
--                               'follow' (now the follow-up's, which is queued)
--        {0}                    the key is not the task's any more; {12} 'q': not yet
--        {11, lacking, '', f}   nothing done: call again with these keys
-- After 'ok' and 'revoke' the task's record is marked (lib.lua's mark, 'ended'): should
-- asynq put the task back before it records the end (a shutdown), it does not run again.
-- @lib: lib.lua is spliced in here.
roles(0)
local A = ARGV
local id, out = A[2], A[3]
local v = call('GET', K.L)
if A[10] ~= '' and v ~= A[10] then return {0} end
local holder, kind = holder_of(v)
local m = call('HMGET', K.M, 'id', 'f', 'cd', 'fh', 'pw', 'o', 'oa')
local mine, st = m[1] == id, (A[6] == 'q' or not holder) and call('HGET', K.T, 'state') -- (read only where used)
if st and not belongs(K.T, id, kind, K.L) then st = nil end -- (another key's task, by a reused caller ID)
-- Late (owed.go), the lock still its task's: running (asynq's done to come, or a rerun) or put back
-- (marked: its rerun checks the key, and settles; an operator may archive it yet), it waits; archived, the key goes on.
if A[6] == 'q' and holder == id and waiting(st) then mark(K.T, 'owed') end
if A[6] == 'q' and holder == id and (st == 'active' or waiting(st)) then return {12} end
-- This attempt's handler, which asynq gave up, has ended, whoever holds the key now.
if m[6] and m[7] == A[9] then call('HDEL', K.M, 'o', 'oa') end
if out == 'note' then return {1, ''} end
-- Its lock went (an operator deleted its task; or asynq's done, after an end that made no call,
-- owed.go) while it owes a follow-up: that runs now. (Another task's lock would name it.)
local gone = not holder and mine and m[2] and (st or 'completed') == 'completed'
if holder ~= id and not gone then return {0} end
local f = mine and m[2]
local now, now_ms = now_parts()
if f and f ~= A[7] then K.G = nil end
if f and lacks(out == 'retry' and not gone and 'S' or 'GSPR') then return {11, lacking, '', f} end
if out == 'retry' and not gone then
  if kind ~= 'c' then
    lengthen(K.L, A[4])
    if mine then lengthen(K.M, A[4]) end
  end
  -- Parked until the retry is due: should the task not run again (an operator
  -- deleted it), the follow-up runs then; if it does, the follow-up waits for
  -- the key, which its end hands over.
  if f then call('ZADD', K.S, 'XX', now + tonumber(A[8]) + 1, f) end
  return {1, 'held', f or ''}
end
if out ~= 'fail' and A[10] == '' then mark(K.T, 'ended') end -- (a shared release's settle: its record may be a later task's)
if f and queue_now(f) then
  call('SET', K.L, f, 'PX', A[4])
  hand(K.M, f, 0)
  call('HDEL', K.M, 'f')
  keep(K.L, K.M)
  return {1, 'follow', f}
end
if gone then return {0} end
if kind == 'c' then return {1, 'cooling'} end -- (it succeeded before, when asynq had given the attempt up)
local cd = mine and tonumber(m[3] or '0') or 0
if out == 'ok' and cd > now_ms then
  call('SET', K.L, '~c:' .. id, 'PX', cd - now_ms)
  call('PEXPIRE', K.M, cd - now_ms)
  return {1, 'cooling'}
end
if out == 'fail' and mine and m[4] then
  -- OnFailure: held by the task that failed for good, with its error; a period
  -- key's hold ends with its window at the latest. (The value stays: an archived
  -- holder whose mode record holds its error holds the key, deleted or not;
  -- asynq releases it if it runs the task again and it succeeds. Its record
  -- names the lock no more, so that asynq's DeleteTask leaves it.)
  local ms = tonumber(m[4])
  local w_end = m[5] and tonumber(string.match(m[5], ':(%d+)$'))
  if w_end and (ms < 0 or now_ms + ms > w_end) then ms = math.max(w_end - now_ms, 1) end
  call('HSET', K.M, 'e', string.sub(A[5], 1, 1000))
  call('HDEL', K.T, 'unique_key')
  for _, k in ipairs({K.L, K.M}) do if ms < 0 then call('PERSIST', k) else call('PEXPIRE', k, ms) end end
  return {1, 'failed'}
end
if out ~= 'fail' and A[6] ~= 'a' then
  -- Released (with the mode, which ends with its task) now rather than by asynq's
  -- done moments later: until then its record still says active, and the key would
  -- read as held by a running task whose mode (a follow-up it would queue) has
  -- just ended. (A lock left because asynq may yet retry the task keeps its mode.)
  if mine then call('DEL', K.L, K.M) else call('DEL', K.L) end
  return {1, 'released'}
end
if A[6] == 'a' and kind == 'w' and out ~= 'fail' then call('SET', K.L, '~a:' .. id, 'KEEPTTL') end
return {1, ''}
