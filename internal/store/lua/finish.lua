-- finish: an attempt ended; release the lock, or hold it for the retry.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; S, P  asynq scheduled set and pending list; F  the key's follow-up pointer   always
--   I  index key of the task's caller-chosen ID                                               with a caller-chosen ID
--   G  asynq record of the follow-up ARGV[8], X the task's superseded marker                  when the lock owes one
--   O  asynq record of the task ARGV[10]                                                      when asynq gave the attempt up; with 'watch';
--                                                                                            with ARGV[13]
-- ARGV[1]  the roles of KEYS, one letter each
-- ARGV[2]  task ID, as lock records store it
-- ARGV[3]  attempt token ('' for a lock no attempt runs under: a check after a guess, a watch)
-- ARGV[4]  'release' (success, revoked, final failure) or 'hold' (a retry follows); with O,
--          what follows if asynq has not moved the task on yet; or 'watch': a lock held for
--          the task's retry, which owes a follow-up, is released (to it) once O says the task
--          will not run again (an operator deleted or archived it), else left as it is
-- ARGV[5]  for 'hold': lifetime, integer milliseconds
-- ARGV[6]  lock lifetime for a released follow-up, integer milliseconds
-- ARGV[7]  how long a follow-up stays parked without a heartbeat, integer seconds
-- ARGV[8]  the follow-up G belongs to ['']
-- ARGV[9]  ARGV[8] as lock records store it ['']
-- ARGV[10] task ID (a lock of the earlier layout holds it whole)
-- ARGV[11] '1' if the handler returned nil: a released lock with a cooldown
--          (field cd) then stays, marked k, until the cooldown's end, unless
--          asynq gave the attempt up and archived the task ['']
-- ARGV[12] the task's type, kept in a cooling or failed lock (its task's
--          record goes) ['']
-- ARGV[13] the handler's error, if it returned one that ends the task for
--          good when released (asynq archives it): a lock recording a
--          failure hold (field fh) then stays, marked k 'f' with the error
--          as field e, for the hold ('-1': until released); also when asynq
--          gave the attempt up and its record says archived ['']
--
-- Reply: {1, ''}             released
--        {1, '', 'cooling'}  kept until the end of its cooldown (marked k), the task done
--        {1, '', 'failed'}   kept for its failure hold (marked k 'f'), the task archived
--        {1, '', 'held', g, f}  held for the retry; g 'guess' if asynq had not moved the task on yet
--                            (O given, the task still active): the hold is a guess, to check later;
--                            f the follow-up the lock owes ('' none): to watch for (see 'watch')
--        {1, followup}       released to the owed follow-up task, now pending and the lock's owner
--        {0}                 not ours any more (another task or a newer attempt): untouched
--        {11, 'G', followup} nothing done: call again with the follow-up's record
-- @lib: lib.lua is spliced in here.
roles(0)
local rec = call('HMGET', K.L, 'id', 'tok', 'f', 'cd', 'fh', 'ca')
if (rec[1] ~= ARGV[2] and rec[1] ~= ARGV[10]) or (rec[2] or '') ~= ARGV[3] then
  return {0}
end
local f = rec[3]
if f and (f ~= ARGV[8] or not K.G or not K.X) then
  return {11, 'G', f}
end
local mode, guess, ok = ARGV[4], '', ARGV[11] == '1'
local failed = ARGV[13] or ''
if mode == 'watch' then
  -- The task waits for its retry while its follow-up stays parked: nothing
  -- changes until its record says it will not run again.
  local state = call('HGET', K.O, 'state')
  if not gone(state) then
    return {1, '', 'held', waiting(state) and '' or 'guess', f or ''}
  end
  mode, ok = 'release', false
elseif K.O then
  -- asynq gave the attempt up (its context ended) and decides what follows
  -- from its own signal, whatever the handler returned: once it has moved
  -- the task on, its record is the truth.
  local state = call('HGET', K.O, 'state')
  if waiting(state) then
    mode = 'hold'
  elseif gone(state) then
    mode = 'release'
    ok = ok and state ~= 'archived' -- completed or deleted: asynq counted it a success
    if state ~= 'archived' then
      failed = '' -- completed or deleted by an operator: no failure holds the key
    elseif failed == '' then
      failed = 'archived by asynq' -- (its record says why)
    end
  else
    guess = 'guess'
    if mode == 'release' and failed ~= '' and not ok and rec[5] then
      -- A failure that holds the key: held until asynq's record says what
      -- followed (archived holds it; a retry, as for an IsFailure that
      -- said no, keeps it for the retry).
      mode = 'hold'
    end
  end
end
if mode == 'release' then
  if K.X then
    call('DEL', K.X) -- done: the follow-up runs after it
  end
  if failed ~= '' and not ok and rec[5] and not f then
    -- OnFailure: the key stays held by the task that failed for good (its
    -- index too, by which a run by hand finds its lock).
    hold_failed(K.L, rec[5], failed, K.I)
    if (ARGV[12] or '') ~= '' then
      call('HSET', K.L, 'ty', ARGV[12])
    end
    return {1, '', 'failed'}
  end
  if K.I then
    call('DEL', K.I)
  end
  local _, now_ms = now_parts()
  local left = tonumber(rec[4] or '0') - now_ms
  if (ok or rec[6]) and left > 0 and not f then
    -- Cooldown: the key stays held by the task that just succeeded (or
    -- ended any way, for a lock marked ca).
    call('HDEL', K.L, 'tok')
    call('HSET', K.L, 'k', '1')
    if (ARGV[12] or '') ~= '' then
      call('HSET', K.L, 'ty', ARGV[12])
    end
    call('PEXPIRE', K.L, left)
    return {1, '', 'cooling'}
  end
  if f then
    call('DEL', K.F)
    local state = call('HGET', K.G, 'state')
    if waiting(state) then
      local now, _, ns = now_parts()
      queue_now(K.S, K.P, K.G, f, state, ns)
      call('HDEL', K.L, 'tok', 'f')
      call('HSET', K.L, 'id', ARGV[9], 'c', now)
      call('PEXPIRE', K.L, ARGV[6])
      return {1, f}
    end
  end
  call('DEL', K.L)
  return {1, ''}
end
call('HDEL', K.L, 'tok')
if guess ~= '' and failed ~= '' and not ok and rec[5] then
  -- A final failure on a guess: marked with its error, so that a call that
  -- finds the task archived before the recheck holds the key at once.
  call('HSET', K.L, 'e', string.sub(failed, 1, 1000))
else
  call('HDEL', K.L, 'e')
end
local _, now_ms = now_parts()
call('PEXPIRE', K.L, math.max(tonumber(ARGV[5]), tonumber(rec[4] or '0') - now_ms))
if K.I then
  call('PEXPIRE', K.I, ARGV[5])
end
if f then
  -- Parked until the retry has run: the follow-up must come after it.
  local now = now_parts()
  local hold_s = (ARGV[5] - ARGV[5] % 1000) / 1000
  call('ZADD', K.S, 'XX', now + hold_s + tonumber(ARGV[7]), f)
  call('PEXPIRE', K.F, (hold_s + tonumber(ARGV[7])) * 1000)
  call('PEXPIRE', K.X, (hold_s + tonumber(ARGV[7])) * 1000) -- (if there is one)
end
return {1, '', 'held', guess, f or ''}
