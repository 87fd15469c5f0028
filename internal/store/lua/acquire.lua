-- acquire: at enqueue, take the key's lock for a new task, fold the new
-- payload into the task that holds the key, or name the holder.
--
-- KEYS, by the role letters of ARGV[1] from its third character on:
--   L  the lock                                         always
--   I  index key of the new task's caller-chosen ID     with a caller-chosen ID
--   T  asynq record of the new task                     with ARGV[7]; with a caller-chosen ID
--   P  asynq pending list, S asynq scheduled set        with ARGV[7]; to release a follow-up
--   W  the type's waiting set                           with ARGV[16]; to heal a counted lock
--   F  the key's follow-up pointer                      with ARGV[17]; to release a follow-up
--   N  asynq record of the new follow-up ARGV[17]       with ARGV[17]
--   H  asynq record of the holder ARGV[11], J its index key       when the holder must be read (J
--                                                                also with ARGV[20], to lengthen it)
--   X  the holder's superseded marker                           when a Replace may defer
--   G  asynq record of the follow-up ARGV[13]                    when the follow-up must be read
--   Y  the lock a stale index of the new task's caller-chosen ID names, when that ID's task is gone
--   R  the queue's registry of prefixes                          at a caller's first call on the queue
-- A call that needs a key it was not given changes nothing and replies
-- {11, ...} naming what it lacks: the caller calls again with those keys.
--
-- ARGV[1]  policy for a waiting holder ('x' reject, 'r' replace, 'm'
--          merge; 'X' reject, and a lock marked v may be answered from the
--          lock alone: the caller read its owner's record moments ago), for
--          a running one ('x' reject, 'a' allow, 'd' defer), then the roles
--          of KEYS, one letter each
-- ARGV[2]  ID of the new task, if one is created
-- ARGV[3]  ARGV[2] as lock records store it
-- ARGV[4]  the producer's clock, unix integer milliseconds
-- ARGV[5]  heal grace, integer seconds
-- ARGV[6]  lock lifetime while waiting, integer milliseconds
-- ARGV[7]  asynq task message to store with a taken lock ('' for none: the
--          caller enqueues; a caller that expects the key held sends none)
-- ARGV[8]  the task type: kept in a taken lock (operators find a lock by
--          it after its owner's record is gone); a payload only lands in a
--          task of its own type
-- ARGV[9]  how the key was chosen (Keys' KeyForm: field names, never
--          values), kept in a taken lock
-- The rest may be left out (most calls do: every argument costs); the
-- default is in brackets:
-- ARGV[10] the new payload as an encoded TaskMessage field 2 ('' when empty) ['']
-- ARGV[11] the holder H and J belong to, as lock records store it ['']
-- ARGV[12] fingerprint (member of W, value of I), given with W or I ['']
-- ARGV[13] the follow-up G belongs to ['']
-- ARGV[14] ARGV[13] as lock records store it ['']
-- ARGV[15] for ARGV[7]: unix seconds it is due, '0' for pending now ['0']
-- ARGV[16] most keys of the type waiting in the queue, '0' for no bound ['0']
-- ARGV[17] ID for a new follow-up (defer) ['']
-- ARGV[18] how long a new follow-up stays parked, integer seconds ['0']
-- ARGV[19] cooldown of a taken lock, integer milliseconds: after its task
--          succeeds the key stays held until this long after the take ['0']
-- ARGV[20] debounce: unix seconds a scheduled holder folded into becomes due
--          ('0' for none), with ARGV[6] its lock's lifetime from now ['0']
-- ARGV[21] with ARGV[20]: ARGV[11] whole, as asynq's scheduled set holds it ['']
-- ARGV[22] what a final failure of a taken lock's task does (FailHold): ''
--          release, '-1' hold until released, else hold this many ms ['']
-- ARGV[23] a period key's window, 'start:end' in unix milliseconds, kept in
--          a taken lock ('' for none) ['']
-- ARGV[24] '1': a taken lock's cooldown follows any end of its task but a
--          final failure (a revoke too), kept as field ca ['']
--
-- Reply (holder and f: the lock's owner as stored and its follow-up after
-- the call, for the caller's hints):
--   {1}                                taken for ARGV[2]
--   {2}                                already held by ARGV[2], whose task is not stored (the caller
--                                      enqueues it): untouched,
--                                      but for a lock written with its task, which loses v and is young again
--   {14, holder, ms, k}                held by its last task, which succeeded (k '1': the key cools
--                                      down) or failed for good (k 'f', OnFailure), for ms more (-1:
--                                      until released); any policy; rejected
--   {0, who, holder, f[, 'v']}         held by who (as stored, or a follow-up); rejected ('v': a lock
--                                      marked v whose owner's record was read and is live)
--   {10, holder}                       the same, from the lock alone: it is younger than the grace
--   {3, target, state, holder, f}      payload of waiting task target replaced
--   {4, target, payload, ver, holder, f}  merge: the caller merges and calls coalesce
--   {5, followup, holder, f}           follow-up task created for the running holder
--   {6, holder}                        held by a task not stored in asynq yet: try again shortly
--   {7}                                the ID ARGV[2] is taken: a task with it exists (a
--                                      caller-chosen ID, or ARGV[7] given), or the ID holds the
--                                      key and its task is completed or archived (asynq refuses
--                                      the ID while the record lasts)
--   {8, waiting, queued}               refused: ARGV[16] keys already waiting; queued: tasks in the
--                                      queue's pending list and scheduled set (fewer than waiting:
--                                      some entries are stale)
--   {11, lacking, holder, f[, stale]}  nothing done: call again with the keys of these roles (stale:
--                                      the key Y belongs to)
--
-- The call's own ID holding the key (ARGV[2] or ARGV[3] is the owner) with
-- its task stored and live is met as any other holder: folded into
-- (Replace, Merge), deferred behind (RunningDefer), or named (Reject).
--   {-1, reason}                       asynq's task record is not what this expects
--
-- A follow-up of a running task is a copy of its asynq record with the new
-- payload and a fresh ID (no retries used, no error; its options, the
-- deadline included, as asynq's client stored them), parked in
-- asynq's scheduled set; the heartbeat keeps it parked and the end of the
-- run releases it (finish). The pointer F outlives the running lease by the
-- parking time, so if the worker dies the key's next deferring enqueue
-- still folds into the follow-up (and releases it); otherwise the follow-up
-- comes due by itself: the owed work is never lost.
--
-- A lock written in the same script as its owner's record (field v: the
-- direct path, an adopted follow-up, an attempt that started) has no gap
-- between lock and task, so an owner found gone, completed or archived
-- frees the key at once; only other locks wait out the heal grace.
--
-- Cost: every call is most of a script's time, so the common paths make
-- few. An unverified lock younger than the heal grace is held whatever its
-- owner's state, so a plain rejection of it reads the lock alone; an accepted direct
-- enqueue makes five calls, as many as asynq's own enqueue plus the lock's.
-- The clock is the producer's (ARGV[4]): asynq stamps pending_since with
-- it too, and the heal grace is far wider than any sane clock skew.
local A = ARGV
if string.find(A[1], 'R', 3, true) then
  -- The caller's first call on the queue: register its prefix (the lock
  -- key's head, before its first ':{'), so that a server of another
  -- prefix finds this lock. (An ACL that refuses the key, a fixed name
  -- outside a custom prefix, refuses the call: the caller calls again
  -- without it.)
  roles(2)
  call('SADD', K.R, string.sub(K.L, 1, string.find(K.L, ':{', 1, true) - 1))
end
local policy, running = string.sub(A[1], 1, 1), string.sub(A[1], 2, 2)
-- (K.L is the lock; the other roles are read after the fast rejection.)
local id, stored, ttl, msg = A[2], A[3], A[6], A[7]
local now_ms = tonumber(A[4])
local now = (now_ms - now_ms % 1000) / 1000
local grace = tonumber(A[5])
local follow = A[17] or ''
local rec = call('HMGET', K.L, 'id', 'c', 'f', 'tok', 'v', 'k')
local holder = rec[1]
if rec[6] then
  return {14, holder, call('PTTL', K.L), rec[6]} -- cooling down or failed: nothing folds into a task that is done
end
-- A lock written with its owner's record (v), and not running, can be
-- judged by that record at once: there is no gap to wait out.
local verified = rec[5] and not rec[4]
if holder and holder ~= stored and holder ~= id and (policy == 'x' or policy == 'X') and follow == ''
    and not rec[3] and ((verified and policy == 'X') or (not verified and now - (tonumber(rec[2]) or 0) < grace)) then
  return {10, holder} -- young (or the caller checked the owner just now): only "held" is possible
end
if policy == 'X' then policy = 'x' end
roles(2)
-- The call's own task ID holds the key (a lock of the earlier layout holds
-- the whole ID): an enqueue again under a caller-chosen ID, or a retried
-- call whose first run took the key. A stored, live task is met as any
-- call of the key meets its holder (below); one not stored is the
-- caller's to enqueue.
local own = holder and (holder == stored or holder == id)
if own then
  local okey = K.T or (holder == A[11] and K.H)
  if not okey then
    return {11, 'H', holder, rec[3] or ''}
  end
  local st = call('HGET', okey, 'state')
  if not st then
    if rec[5] and not rec[4] then
      -- The caller enqueues this task now, through asynq's client: until it
      -- is stored the lock has a gap again, which the grace must cover.
      call('HDEL', K.L, 'v')
      call('HSET', K.L, 'c', now)
    end
    return {2}
  end
  if st == 'completed' or st == 'archived' then
    return {7} -- asynq keeps the ID taken while its record lasts
  end
  K.H = okey
end
local fp = A[12] or ''
-- A plain rejection of a lock written with its task reads the holder's
-- state alone (before the library below is defined: most of a call's cost).
if verified and policy == 'x' and follow == '' and not rec[3] and K.H and holder == A[11] then
  local st = call('HGET', K.H, 'state')
  if st and st ~= 'completed' and st ~= 'archived' then
    return {0, holder, holder, '', 'v'}
  end
end
-- queued counts the tasks waiting in the queue (asynq's pending list and
-- scheduled set, given with W): a waiting set that counts more keys than
-- that holds entries whose task is gone.
local function queued()
  return call('LLEN', K.P) + call('ZCARD', K.S)
end

-- take takes the free key for the new task (and stores the task, given msg).
local function take()
  if K.I then
    -- A caller-chosen ID: taken while a task has it, in any state (asynq
    -- refuses it then too); else its index, if it names another key, is
    -- stale, and so is a lock it still holds under that key.
    if call('EXISTS', K.T) == 1 then
      return {7}
    end
    local cur = call('GET', K.I)
    if cur and cur ~= fp and cur ~= '-' then
      if not K.Y then
        return {11, 'Y', '', '', cur}
      end
      if call('HGET', K.Y, 'id') == stored then
        call('DEL', K.Y)
      end
    end
  elseif msg ~= '' and call('EXISTS', K.T) == 1 then
    -- This very task, stored by an earlier try of this call that ran late:
    -- never store it twice.
    return {7}
  end
  local max, cool = tonumber(A[16] or '0'), tonumber(A[19] or '0')
  local fields = {'id', stored, 'c', now, 'ty', A[8], 'kf', A[9]}
  if max > 0 then
    call('ZREMRANGEBYSCORE', K.W, '-inf', now_ms)
    local n = call('ZCARD', K.W)
    if n >= max then
      return {8, n, queued()}
    end
    call('ZADD', K.W, now_ms + tonumber(ttl), fp)
    fields[#fields + 1] = 'b'
    fields[#fields + 1] = A[8] -- the type: where the lock is counted
  end
  if running ~= 'x' then
    fields[#fields + 1] = 'rp'
    fields[#fields + 1] = running
  end
  if cool > 0 then
    fields[#fields + 1] = 'cd' -- the end of the cooldown, should the task succeed before it
    fields[#fields + 1] = now_ms + cool
    if cool > tonumber(ttl) then ttl = cool end
  end
  if (A[22] or '') ~= '' then
    fields[#fields + 1] = 'fh'
    fields[#fields + 1] = A[22]
  end
  if (A[23] or '') ~= '' then
    fields[#fields + 1] = 'pw'
    fields[#fields + 1] = A[23]
  end
  if A[24] == '1' and cool > 0 then
    fields[#fields + 1] = 'ca'
    fields[#fields + 1] = '1'
  end
  if msg ~= '' then
    fields[#fields + 1] = 'v' -- stored with its task: verified
    fields[#fields + 1] = '1'
  end
  if msg ~= '' then
    -- Store the task as asynq's enqueue (or schedule) script would.
    local due = A[15] or '0'
    if due ~= '0' then
      call('HSET', K.T, 'msg', msg, 'state', 'scheduled')
      call('ZADD', K.S, due, id)
    else
      call('HSET', K.T, 'msg', msg, 'state', 'pending', 'pending_since', A[4] .. '000000')
      call('LPUSH', K.P, id)
    end
  end
  call('HSET', K.L, unpack(fields))
  call('PEXPIRE', K.L, ttl)
  if K.I then
    call('SET', K.I, fp, 'PX', ttl)
  end
  return {1}
end
if not holder and follow == '' then
  return take() -- free, and no follow-up can be owed
end
-- @lib: lib.lua is spliced in here, after the fast paths.
local field, fhint_s = A[10] or '', A[14] or ''
if holder then
  local more = call('HMGET', K.L, 'rp', 'n', 'b')
  rec = {rec[1], rec[2], rec[3], rec[4], more[1], more[2], more[3]}
end
-- rec: id, c, f, tok, rp, n, b
local f = rec[3]
-- The holder H, J and X were given for (A[11], or the call's own ID), and
-- its whole ID.
local hinted = holder and (own or holder == A[11])
local hwhole = own and id or A[21]
if not hinted or holder ~= A[11] then
  K.J, K.X = nil, nil -- given for another holder: not ours to touch
  if not own then K.H = nil end
end
if own then
  K.J = K.I -- the holder's index is the call's own
end
local lacking = ''
local fu = f -- the follow-up whose record is read
-- lacks records which of the roles in r were not given.
local function lacks(r)
  for i = 1, #r do
    local c = string.sub(r, i, i)
    if not K[c] then lacking = lacking .. c end
  end
  return lacking ~= ''
end
local function need()
  return {11, lacking, holder or '', fu or ''}
end

-- read_task reads a task's asynq state, and its message when the policy
-- may fold into it.
local function read_task(key)
  if policy == 'x' then
    return call('HGET', key, 'state')
  end
  local t = call('HMGET', key, 'state', 'msg')
  return t[1], t[2]
end

-- Read: the holder's record, then the follow-up's.
local state, hmsg
if holder then
  if lacks('H') then return need() end
  state, hmsg = read_task(K.H)
  if state == 'archived' and not rec[4] then
    local m = call('HMGET', K.L, 'fh', 'e')
    if m[1] and m[2] then
      -- Its owner failed for good (its settle marked the failure e, and
      -- asynq archived it) before the recheck held the key: held now.
      return {14, holder, hold_failed(K.L, m[1], false, K.J), 'f'}
    end
  end
  if gone(state) and not verified and now - (tonumber(rec[2]) or 0) < grace then
    -- Too young to tell: its producer may not have stored it in asynq yet.
    if not state and (policy ~= 'x' or running == 'd') then
      return {6, holder}
    end
    return {0, holder, holder, f or ''}
  end
end
local live = holder and not gone(state)
local orphan = false -- the key's follow-up pointer, when no live task holds the key
if not live and follow ~= '' then
  if lacks('F') then return need() end
  orphan = call('GET', K.F)
  fu = fu or orphan
end
local fstate, fmsg
if fu then
  if fu ~= A[13] then K.G = nil end
  if lacks('G') then return need() end
  fstate, fmsg = read_task(K.G)
end

-- same_type reports whether a stored message is of the new task's type
-- (asynq's messages begin with the type field).
local function same_type(tmsg)
  local tf = pb_str(1, A[8] or '')
  return string.sub(tmsg, 1, #tf) == tf
end

-- coalesce folds the new payload into the waiting task t (record key tkey,
-- state, message); ch and cf are the lock's holder and follow-up after it.
local function coalesce(t, tkey, tstate, tmsg, ch, cf)
  if policy == 'x' or not tmsg or not same_type(tmsg) then
    return {0, t, ch, cf} -- another type's task (a shared key): a duplicate
  end
  if policy == 'm' then
    local p = pb_bytes(tmsg, 2)
    if not p then return {-1, 'malformed task message'} end
    return {4, t, p, rec[6] or '0', ch, cf}
  end
  local due = hinted and t == holder and cf == '' and A[20] or '0' -- (a follow-up's due time is the heartbeat's)
  if due ~= '0' and tstate == 'scheduled' and lacks('S') then return need() end
  local new = pb_setpayload(tmsg, field)
  if not new then return {-1, 'malformed task message'} end
  if new ~= tmsg then -- the same payload again (common): nothing to write
    call('HSET', tkey, 'msg', new)
  end
  call('HINCRBY', K.L, 'n', 1)
  debounce(K.L, K.S, hwhole, tstate, due, ttl, K.J, K.W, fp, now_ms)
  return {3, t, tstate, ch, cf}
end

-- adopt makes the waiting follow-up fu the lock's owner, released to the
-- pending list if it is still parked, and returns its state.
local function adopt()
  fstate = queue_now(K.S, K.P, K.G, fu, fstate, A[4] .. '000000')
  call('DEL', K.F)
  call('HDEL', K.L, 'tok', 'f')
  if running ~= 'x' then
    call('HSET', K.L, 'id', fhint_s, 'c', now, 'rp', running, 'v', '1')
  else
    call('HSET', K.L, 'id', fhint_s, 'c', now, 'v', '1')
  end
  call('PEXPIRE', K.L, ttl)
  return fstate
end

if live then
  if f and waiting(fstate) then
    return coalesce(f, K.G, fstate, fmsg, holder, f)
  end
  if rec[4] or not waiting(state) then -- running
    -- (a follow-up an operator deleted or archived is owed no more: a new one replaces it)
    if rec[5] ~= 'd' or (f and not gone(fstate)) or follow == '' then
      return {0, holder, holder, f or ''}
    end
    if lacks(policy == 'r' and 'NSFX' or 'NSF') then return need() end
    hmsg = hmsg or call('HGET', K.H, 'msg')
    if hmsg and not same_type(hmsg) then
      return {0, holder, holder, f or ''} -- another type's task: no follow-up of it
    end
    local copy = hmsg and pb_rewrite(hmsg, {[2] = field, [3] = pb_str(3, follow),
      [6] = '', [7] = '', [11] = '', [13] = ''})
    if not copy then return {-1, 'malformed task message'} end
    local max = tonumber(A[16] or '0')
    if max > 0 then
      -- The follow-up is a key waiting: counted under MaxPending from now
      -- until it starts (start), or a check finds it cannot run (prune): no
      -- expiry of its own, as it waits as long as the run lasts.
      call('ZREMRANGEBYSCORE', K.W, '-inf', now_ms)
      if not call('ZSCORE', K.W, fp) then
        local n = call('ZCARD', K.W)
        if n >= max then
          return {8, n, queued()}
        end
      end
      call('ZADD', K.W, '+inf', fp)
      call('HSET', K.L, 'b', A[8])
    end
    local park = tonumber(A[18] or '0')
    call('HSET', K.N, 'msg', copy, 'state', 'scheduled')
    call('ZADD', K.S, now + park, follow)
    call('SET', K.F, follow, 'PX', park * 1000)
    call('HSET', K.L, 'f', follow)
    call('HINCRBY', K.L, 'n', 1)
    if policy == 'r' then
      -- Latest wins: should the holder lose its lock (its worker died) and
      -- start again after the follow-up, it must not run (start).
      call('SET', K.X, follow, 'PX', tonumber(ttl) + park * 1000)
    end
    return {5, follow, holder, follow}
  end
  return coalesce(holder, K.H, state, hmsg, holder, '')
end

-- No live task holds the key: its holder (if any) is gone for longer than
-- the grace. A waiting follow-up it still owes becomes the holder.
if f and waiting(fstate) then
  if lacks('SPFJ') then return need() end
  call('DEL', K.J)
  return coalesce(f, K.G, adopt(), fmsg, fhint_s, '')
end
-- Otherwise heal: drop the orphaned lock (with its index key and
-- waiting-set entry), adopt a follow-up owed by a run that died, drop a
-- stale follow-up pointer, and take the key.
local adopt_orphan = orphan and not f and waiting(fstate)
if (holder and lacks('J' .. (rec[7] and 'W' or ''))) or (adopt_orphan and lacks('SP')) then
  return need()
end
if holder then
  call('DEL', K.L, K.J)
  if rec[7] then
    call('ZREM', K.W, fp)
  end
  rec = {}
end
if adopt_orphan then
  return coalesce(orphan, K.G, adopt(), fmsg, fhint_s, '')
end
if orphan then
  call('DEL', K.F)
end
return take()
