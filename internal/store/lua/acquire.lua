-- acquire: at enqueue, meet the task that holds a key: name it, fold the new
-- payload into it (or into the follow-up it owes), make a follow-up of a running
-- holder, or heal the lock of a holder that is gone. take.lua takes free keys.
--
-- KEYS, by the role letters of ARGV[1] from its third character on:
--   L  the lock; M  the key's mode record                      always
--   H  asynq record of the holder ARGV[7]                      when there is a holder
--   G  asynq record of the follow-up ARGV[8]                   when the mode record names one
--   N  asynq record of the new follow-up ARGV[9]               to make one
--   S  asynq scheduled set; P pending list; R retry set        to make, adopt or debounce one
--   W  the type's waiting set                                  with ARGV[10]; to heal a counted lock
--   T  asynq record of the call's caller-chosen ID             with ARGV[15]
-- ARGV[1]  policy for a waiting holder ('x' reject, 'r' replace, 'm' merge), for
--          a running one ('x' reject, 'd' defer), then the roles
-- ARGV[2]  ID of the new task; ARGV[3] the producer's clock, unix integer ms
-- ARGV[4]  the lock's lifetime while its task waits, integer ms
-- ARGV[5]  the task type: a payload only lands in a task of its own type
-- ARGV[6]  the new payload as an encoded TaskMessage field 2 ('' when empty)
-- ARGV[7]  the holder H belongs to ('' none), ARGV[8] the follow-up G does
-- ARGV[9]  ID for a new follow-up ('' when the caller does not defer)
-- ARGV[10] MaxPending ('0': none); ARGV[11] the key's fingerprint (member of W)
-- ARGV[12] debounce: unix seconds a scheduled holder folded into becomes due ('0' none)
-- ARGV[13] heal grace; ARGV[14] how long a new follow-up stays parked (integer seconds)
-- ARGV[15] '1': ARGV[2] is the caller's own ID, which may hold the key; ARGV[16] the owed channel
--
-- Reply: {10}                 the key is free (a lock whose holder is gone was
--                             deleted, its holder marked if archived): take it
--   {0, holder, f}            held by a live task (f: its follow-up, or '')
--   {14, holder, ms, k}       held after its task ended, for ms more (-1: until
--                             released): cooling (k 'c', as take.lua), or failed ('f':
--                             the holder failed for good, is archived or deleted, and
--                             its mode record holds its error: OnFailure)
--   {3, task, state, f}       the payload was written into the waiting task (f: the
--                             key's follow-up, or ''; task may be it)
--   {4, task, payload, n, f}  Merge: the task's payload and version, for merge.lua
--   {5, followup}             a follow-up of the running holder was made
--   {6, holder}               taken before its task was stored, which may still come
--   {2}                       ARGV[15]'s task holds it, but is not stored yet
--   {7}                       ARGV[15]'s task is completed or archived (its ID stays taken)
--   {8, waiting, queued}      over MaxPending (as take.lua)
--   {11, lacking, holder, f}  a key it needs is lacking: nothing done, call again with them
--   {-1, reason}              asynq's task record is not what this expects
-- @lib: lib.lua is spliced in here.
roles(2)
local A = ARGV
local policy, running = string.sub(A[1], 1, 1), string.sub(A[1], 2, 2)
local now_ms, ttl, typ = tonumber(A[3]), A[4], A[5]
local now = (now_ms - now_ms % 1000) / 1000
local holder, kind, at = holder_of(call('GET', K.L))
if kind == 'c' then return {14, holder, call('PTTL', K.L), kind} end
if kind == 'x' then return {0, holder, ''} end
local m = call('HMGET', K.M, 'id', 'rp', 'f', 'n', 'b', 'e', 'o')
local f = m[3]
local function need() return {11, lacking, holder or '', f or ''} end

-- The holder's record; the call's own caller-chosen ID is met as any holder.
local state, hmsg
if holder then
  local own = holder == A[2] and A[15] == '1'
  if own then K.H = K.T elseif holder ~= A[7] then K.H = nil end
  if lacks('H') then return need() end
  state, hmsg = unpack(call('HMGET', K.H, 'state', 'msg'))
  -- Its caller-chosen ID may name another key's task now: this key's is gone.
  local moved = state and not belongs(K.H, holder, kind, K.L)
  if moved then state, hmsg = nil, nil end
  -- Put back after its end was settled (a shutdown), it will not run again:
  -- as good as done, so its lock heals rather than taking folds or refusing.
  if waiting(state) and ended(hmsg) then state, hmsg = 'completed', nil end
  -- A kept key's holder run again by hand after it completed (its message keeps
  -- completed_at, field 13) waits inside its cooldown: the key cools still.
  for _, fl in ipairs(kind == 'k' and waiting(state) and pb_fields(hmsg or '') or {}) do if fl[1] == 13 then state = 'completed' end end
  if m[1] == holder and m[6] and (not state or state == 'archived' or state == 'active') then
    -- It failed for good and holds the key (OnFailure): archived, deleted since,
    -- or about to be archived (its hold is written first).
    return {14, holder, call('PTTL', K.L), 'f'}
  end
  local left = cools(kind, at, state)
  if left then return {14, holder, left, 'c'} end
  if own and gone(state) and (state or moved or kind ~= 'a') then return {(state or moved) and 7 or 2} end -- ('a': a start's, gone)
  if not state and not moved and kind == 'w' and now - at < tonumber(A[13]) then
    return (policy ~= 'x' or running == 'd') and {6, holder} or {0, holder, ''}
  end
end
-- (o: a handler of the holder that asynq gave up still runs)
local live = not gone(state) or (m[1] == holder and outlived(m[7]))
local fstate, fmsg
if f then -- (whatever the call's own policy: a follow-up owed by a gone holder takes the key)
  if f ~= A[8] then K.G = nil end
  if lacks('G') then return need() end
  fstate, fmsg = unpack(call('HMGET', K.G, 'state', 'msg'))
end

-- fold folds the new payload into the waiting task t (record tkey).
local function fold(t, tkey, tstate, tmsg)
  if policy == 'x' or not same_type(tmsg, typ) then
    return {0, t, f or ''} -- (another type's task, under a shared key: a duplicate)
  end
  if policy == 'm' then
    local p = pb_bytes(tmsg, 2)
    return p and {4, t, p, m[1] == holder and m[4] or '0', f or ''} or {-1, 'malformed task message'}
  end
  local due = t == holder and A[12] or '0' -- (a follow-up comes due when its holder ends)
  if due ~= '0' and tstate == 'scheduled' and lacks('S') then return need() end
  local new = pb_setpayload(tmsg, A[6])
  if not new then return {-1, 'malformed task message'} end
  if new ~= tmsg then call('HSET', tkey, 'msg', new) end -- (the same payload again, as is common: no write)
  count(K.L, K.M, m[1], holder)
  debounce(K.L, K.S, t, tstate, due, ttl, K.W, A[11], now_ms)
  return {3, t, tstate, f or ''}
end

-- A holder whose given-up handler still runs is running, whatever asynq's record
-- says: its retry carries the payload that handler runs, and may be archived on
-- its last attempt meeting the key busy, so newer work is a follow-up (or a
-- duplicate), never folded into it.
local zombie = m[1] == holder and outlived(m[7])
if live then
  if waiting(fstate) then return fold(f, K.G, fstate, fmsg) end
  if waiting(state) and not zombie then return fold(holder, K.H, state, hmsg) end
  local rp = m[1] == holder and m[2]
  if rp ~= 'd' or (f and not gone(fstate)) or A[9] == '' or not same_type(hmsg, typ) then
    return {0, holder, f or ''}
  end
  -- Defer: make a follow-up of the running holder, a copy of its record with the
  -- new payload and a fresh ID (no retries used, no error), parked in asynq's
  -- scheduled set until the holder's run ends (settle.lua queues it) or its
  -- parking time passes. Counted under MaxPending from now until it starts.
  if lacks('NS') then return need() end
  local copy = pb_rewrite(hmsg, {[2] = A[6], [3] = pb_str(3, A[9]), [6] = '', [7] = '', [11] = '', [13] = ''})
  if not copy then return {-1, 'malformed task message'} end
  local max = tonumber(A[10])
  if max > 0 then
    if lacks('WP') then return need() end
    call('ZREMRANGEBYSCORE', K.W, '-inf', now_ms)
    if not call('ZSCORE', K.W, A[11]) then
      local n = call('ZCARD', K.W)
      if n >= max then return {8, n, call('LLEN', K.P) + call('ZCARD', K.S)} end
    end
    call('ZADD', K.W, '+inf', A[11])
    call('HSET', K.M, 'b', typ)
  end
  local park = tonumber(A[14])
  -- It names its lock, as a task stored with its lock does (so that asynq's
  -- delete takes it with the follow-up, and its start finds it), even where
  -- its holder, which arrived without a lock, names none.
  call('HSET', K.N, 'msg', copy, 'state', 'scheduled', 'unique_key', K.L)
  call('ZADD', K.S, now + park, A[9])
  call('HSET', K.M, 'f', A[9])
  call('PUBLISH', A[16], holder) -- (its worker's middleware, which may not call at its end, settles it: owed.go)
  count(K.L, K.M, m[1], holder)
  lengthen(K.M, park * 1000)
  return {5, A[9]}
end

-- No live task holds the key. (Every key the rest needs is asked for before
-- anything is written.)
local adopt = f and waiting(fstate)
local counted = holder and m[5] and m[1] == holder
if lacks(adopt and 'SPR' or counted and 'W' or '') then return need() end
if state == 'archived' or (kind == 'k' and state == 'completed' and hmsg) then mark(K.H, 'healed') end -- should it run again by hand, it checks the key
if adopt then
  -- The follow-up a gone holder owed takes the key, and the call folds into it.
  queue_now(f)
  call('SET', K.L, f, 'PX', ttl)
  hand(K.M, f, 0)
  call('HDEL', K.M, 'f')
  keep(K.L, K.M)
  holder, m[1], m[4], f = f, f, '0', nil
  return fold(holder, K.G, 'pending', fmsg)
end
if counted then call('ZREM', K.W, A[11]) end
if holder then call('DEL', K.L) end
if f then call('HDEL', K.M, 'f') end -- owed no more: the follow-up is gone
return {10}
