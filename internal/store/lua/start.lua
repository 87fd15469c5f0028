-- start: an attempt of a task begins; make it the lock's running owner.
--
-- KEYS, by the role letters of ARGV[1]:
--   L  the lock; W  the task type's waiting set; F  the key's follow-up pointer;
--   X  the task's superseded marker; T the task's asynq record                    always
--   I  index key of the task's caller-chosen ID                                  with a caller-chosen ID
--   H  asynq record of the holder ARGV[9], J its index key                       when the holder must be read
-- ARGV[1]  the roles of KEYS, one letter each
-- ARGV[2]  task ID
-- ARGV[3]  ARGV[2] as lock records store it
-- ARGV[4]  attempt token (random per attempt)
-- ARGV[5]  lease, integer milliseconds
-- ARGV[6]  heal grace, integer seconds
-- ARGV[7]  running policy ('x' reject, 'a' allow, 'd' defer) recorded if this creates the lock
-- ARGV[8]  fingerprint (member of W, value of I)
-- ARGV[9]  the holder H and J belong to, as lock records store it ['']
-- ARGV[10] cooldown recorded if this creates the lock, integer milliseconds ['0']
-- ARGV[11] the task's type, kept in a lock this creates ['']
-- ARGV[12] how the key was chosen (KeyForm), kept in a lock this creates; ''
--          when unknown (the key is the producer's, from the task's ID or
--          index) ['']
-- ARGV[13] what a final failure does (FailHold), recorded if this creates
--          the lock ['']
-- ARGV[14] a period key's window, 'start:end' in unix milliseconds,
--          recorded if this creates the lock ['']
--
-- Reply: {1, f, new, cools}        this attempt holds the lock; f: the follow-up it owes, or '';
--                                   new '1' when there was no lock (the attempt made it), else '';
--                                   cools '1' when the lock has a cooldown (field cd)
--        {0, holder, f, r, run}     held by another live task (as stored): the attempt must not run;
--                                   f: the follow-up the lock owes, or ''; r 'r' when an operator
--                                   released this task's lock (its marker X says 'r:') and the
--                                   holder, which took the key after that, is of its type; run
--                                   'run' when an attempt of the holder runs, else ''
--        {14, holder, ms, r, k}     the key cools down for ms more after its last task succeeded
--                                   (k '1'), or is held after it failed for good (k 'f'; ms -1:
--                                   until released): the attempt must not run; r 'r' when an
--                                   operator released this task's lock (its marker X says 'r:').
--                                   (The holder itself, run again by hand after it failed, takes
--                                   its lock back instead: {1, ...}.)
--        {9, '', new}               the key's running policy is "allow": lock dropped (not the index
--                                   of a caller-chosen ID), run unlocked; new '1' when there was no
--                                   lock to drop
--        {12, followup}             superseded: the task lost its lock (its worker died) after a
--                                   follow-up with a newer payload was made for it; it must not run
--        {11, lacking, holder}      nothing done: call again with the keys of these roles
--        {13}                       the task has no asynq record here: its server stores tasks in
--                                   another Redis; nothing done
--
-- A new attempt replaces an older attempt's token, so a leftover handler of
-- that attempt can neither renew nor release the lock any more.
--
-- The marker X holds the follow-up of a task whose run was superseded by
-- it (Replace + Defer), or 'r:' when an operator released the task's lock
-- (release, force): any task holding the key now took it since.
-- @lib: lib.lua is spliced in here.
roles(0)
if call('EXISTS', K.T) == 0 then
  return {13} -- (a running task's record always exists where asynq runs it)
end
local id, stored, fp = ARGV[2], ARGV[3], ARGV[8]
local now, now_ms = now_parts()
local rec = call('HMGET', K.L, 'id', 'c', 'rp', 'b', 'f', 'tok', 'v', 'k', 'cd')
local holder = rec[1]
if rec[8] == 'f' and (holder == stored or holder == id) then
  -- The task that failed for good runs again (an operator ran it from the
  -- archive): its held lock is its own again.
  call('HDEL', K.L, 'k', 'e')
  rec[8] = nil
end
if rec[8] then
  local by = call('GET', K.X)
  return {14, holder, call('PTTL', K.L), by and string.sub(by, 1, 2) == 'r:' and 'r' or '', rec[8]}
end
local cool_end = tonumber(rec[9] or '0')
local released = false -- an operator released this task's lock
if holder ~= stored and holder ~= id then
  local by = call('GET', K.X)
  if by and string.sub(by, 1, 2) == 'r:' then
    released = true
  elseif by then
    call('DEL', K.X)
    if K.I then
      call('DEL', K.I)
    end
    return {12, by}
  end
end
-- held answers that another task holds the key, saying whether this task,
-- released by an operator, met a task of its own type there.
local function held()
  local r = ''
  if released then
    local tf = pb_str(1, ARGV[11] or '')
    if string.sub(call('HGET', K.H, 'msg') or '', 1, #tf) == tf then
      r = 'r'
    end
  end
  return {0, holder, rec[5] or '', r, rec[6] and 'run' or ''}
end
if holder and holder ~= stored and holder ~= id then
  -- too young to be an orphan (unless written with its task: v)
  local young = not (rec[7] and not rec[6]) and now - (tonumber(rec[2]) or 0) < tonumber(ARGV[6])
  if young and not released then
    return held()
  end
  if holder ~= ARGV[9] or not K.H or not K.J then
    return {11, 'HJ', holder}
  end
  if young then
    return held()
  end
  local hstate = call('HGET', K.H, 'state')
  if not gone(hstate) then
    return held()
  end
  local m = hstate == 'archived' and not rec[6] and call('HMGET', K.L, 'fh', 'e')
  if m and m[1] and m[2] then
    -- The holder failed for good: the failure holds the key (OnFailure).
    return {14, holder, hold_failed(K.L, m[1], false, K.J), '', 'f'}
  end
  if rec[5] and rec[5] ~= id then
    return held() -- an orphan owed a follow-up: acquire or the follow-up settles it
  end
  call('DEL', K.L, K.J)
  if rec[4] then
    call('ZREM', K.W, fp) -- (counted under this type: the lock is this key's)
  end
  holder = false
  rec, cool_end = {}, 0
end
if rec[4] and (not rec[5] or rec[5] == id) then
  -- The key waits no more (MaxPending); but for the follow-up it owes,
  -- which still waits while its holder runs again (a retry).
  call('ZREM', K.W, fp)
  call('HDEL', K.L, 'b')
end
if call('GET', K.F) == id then
  call('DEL', K.F) -- the follow-up is running: no longer owed
end
if rec[3] == 'a' or (not holder and ARGV[7] == 'a') then
  -- (The index of a caller-chosen ID stays, until the end of the lifetime
  -- it was given: the task's retries must still find their key, or they
  -- would meet it as arrivals.)
  call('DEL', K.L)
  return {9, '', rec[3] == 'a' and '' or '1'}
end
if released then
  call('DEL', K.X) -- (the key was free: it runs, as any task that takes it)
end
local new = not holder
if not holder then
  call('HSET', K.L, 'id', stored, 'c', now, 'ty', ARGV[11] or '')
  if (ARGV[12] or '') ~= '' then
    call('HSET', K.L, 'kf', ARGV[12])
  end
  if ARGV[7] ~= 'x' then
    call('HSET', K.L, 'rp', ARGV[7])
  end
  local cool = tonumber(ARGV[10] or '0')
  if cool > 0 then
    cool_end = now_ms + cool
    call('HSET', K.L, 'cd', cool_end)
  end
  if (ARGV[13] or '') ~= '' then
    call('HSET', K.L, 'fh', ARGV[13])
  end
  if (ARGV[14] or '') ~= '' then
    call('HSET', K.L, 'pw', ARGV[14])
  end
end
call('HSET', K.L, 'tok', ARGV[4], 'v', '1') -- the task runs: it is stored
-- A lock with a cooldown outlives a dead worker until the cooldown ends:
-- asynq runs the task again, and no other task may run before then.
call('PEXPIRE', K.L, math.max(tonumber(ARGV[5]), cool_end - now_ms))
if K.I then
  call('SET', K.I, fp, 'PX', ARGV[5])
end
return {1, rec[5] or '', new and '1' or '', cool_end > 0 and '1' or ''}
