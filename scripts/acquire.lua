-- acquire: at enqueue, take the key's lock for a new task, fold the new
-- payload into the task that holds the key, or name the holder.
--
-- KEYS[1]  lock key            <prefix>:{<queue>}:l:<fingerprint>
-- KEYS[2]  (optional) index    <prefix>:{<queue>}:i:<task ID>, only for a caller-chosen task ID
-- ARGV[1]  ID of the new task, if one is created
-- ARGV[2]  ARGV[1] as lock records store it (see id_pack in lib.lua)
-- ARGV[3]  the producer's clock, unix integer milliseconds
-- ARGV[4]  heal grace, integer seconds
-- ARGV[5]  lock lifetime while waiting, integer milliseconds
-- ARGV[6]  asynq key prefix    asynq:{<queue>}:
-- ARGV[7]  task type
-- ARGV[8]  asynq task message to store with a taken lock ('' for none: the caller enqueues)
-- The rest may be left out (most calls do: every argument costs Redis and
-- the client time); the default is in brackets:
-- ARGV[9]  policy for a waiting holder: 'x' reject, 'r' replace, 'm' merge ['x']
-- ARGV[10] policy for a running holder: 'x' reject, 'a' allow, 'd' defer ['x']
-- ARGV[11] for ARGV[8]: unix seconds it is due, '0' for pending now ['0']
-- ARGV[12] most keys of this type waiting in this queue, 0 for no bound ['0']
-- ARGV[13] the new payload (replace, and the follow-up of defer) ['']
-- ARGV[14] ID for a follow-up task (defer) ['']
-- ARGV[15] how long a follow-up stays parked without a heartbeat, integer seconds ['0']
-- The dedup key prefix (<prefix>:{<queue>}:) and the fingerprint are read
-- off KEYS[1] where needed.
--
-- Reply: {1, id}                    lock taken for the new task ARGV[1]
--        {0, holder}                held; rejected
--        {10, stored}               the same, the holder's ID as the lock stores it (the fast path)
--        {2, id}                    already held by task ARGV[1]; untouched
--        {3, target, state}         payload of waiting task target replaced
--        {4, target, payload, ver}  merge: the caller merges and calls coalesce
--        {5, followup}              follow-up task created for the running holder
--        {6, holder}                held by a task not stored in asynq yet: try again shortly
--        {7, id}                    ARGV[8] given but task ARGV[1] already exists in asynq
--        {8, waiting}               refused: ARGV[12] keys already waiting
--        {-1, reason}               asynq's task record is not what this expects
--
-- The follow-up of a running task is a copy of its asynq record with the new
-- payload and a fresh ID (no retries used, no absolute deadline), parked in
-- asynq's scheduled set; the heartbeat keeps it parked and the end of the
-- run releases it (finish). A pointer <prefix>:{<queue>}:f:<fingerprint>
-- outlives the running lease by the parking time, so if the worker dies the
-- key's next enqueue still folds into the follow-up (and releases it), and
-- otherwise the follow-up comes due by itself: the owed work is never lost.
--
-- Cost: every redis.call is most of a script's time, so the common paths
-- make few. A lock younger than the heal grace is held whatever its owner's
-- state, so a plain rejection (no follow-up possible) reads the lock alone;
-- an accepted direct enqueue makes five calls, as many as asynq's own
-- enqueue plus the lock's. The clock is the producer's (ARGV[3]): asynq
-- stamps pending_since with it too, and the heal grace is far wider than
-- any sane clock skew. Only a call whose type defers (ARGV[14] given) looks
-- for an orphaned follow-up, and only a caller-chosen ID (KEYS[2]) can
-- collide with a stored task.
local id, stored, ttl, aprefix, typ, msg = ARGV[1], ARGV[2], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local grace = ARGV[4]
local policy, running, due = ARGV[9] or 'x', ARGV[10] or 'x', ARGV[11] or '0'
local max, payload, follow, park = ARGV[12] or '0', ARGV[13] or '', ARGV[14] or '', ARGV[15] or '0'
local now_ms = tonumber(ARGV[3])
local now = (now_ms - now_ms % 1000) / 1000
-- A folding policy needs the whole record anyway: read it at once.
local rec = policy == 'x' and redis.call('HMGET', KEYS[1], 'id', 'c', 'f')
  or redis.call('HMGET', KEYS[1], 'id', 'c', 'f', 'tok', 'rp', 'n')
local holder = rec[1]
if holder and holder ~= stored and policy == 'x' and follow == '' and not rec[3]
    and now - (tonumber(rec[2]) or 0) < tonumber(grace) then
  -- Held by another task, young, and no answer but "held" is possible:
  -- rejected, naming the owner as the lock stores it (the caller unpacks it).
  return {10, holder}
end
local kp -- {dedup prefix, fingerprint}, read off the lock key on first use
local function keyparts()
  if not kp then kp = {string.match(KEYS[1], '^(.*:)l:([^:]*)$')} end
  return kp
end
local function dprefix() return keyparts()[1] end
local function fp() return keyparts()[2] end
if holder then
  -- rec becomes {id, c, tok, f, rp, n}.
  if policy == 'x' then
    local more = redis.call('HMGET', KEYS[1], 'tok', 'rp', 'n')
    rec = {rec[1], rec[2], more[1], rec[3], more[2], more[3]}
  else
    rec = {rec[1], rec[2], rec[4], rec[3], rec[5], rec[6]}
  end
end
-- take takes the free key for the new task id (and stores the task,
-- given msg).
local function take()
  local tkey = aprefix .. 't:' .. id
  if msg ~= '' and KEYS[2] and redis.call('EXISTS', tkey) == 1 then
    return {7, id}
  end
  local max = tonumber(max)
  local fields = {'id', stored, 'c', now}
  if max > 0 then
    local wkey = dprefix() .. 'w:' .. typ
    redis.call('ZREMRANGEBYSCORE', wkey, '-inf', now_ms)
    local n = redis.call('ZCARD', wkey)
    if n >= max then
      return {8, n}
    end
    redis.call('ZADD', wkey, now_ms + tonumber(ttl), fp())
    fields[#fields + 1] = 'b'
    fields[#fields + 1] = '1'
  end
  if running ~= 'x' then
    fields[#fields + 1] = 'rp'
    fields[#fields + 1] = running
  end
  if msg ~= '' then
    -- Store the task as asynq's enqueue (or schedule) script would.
    if due ~= '0' then
      redis.call('HSET', tkey, 'msg', msg, 'state', 'scheduled')
      redis.call('ZADD', aprefix .. 'scheduled', due, id)
    else
      redis.call('HSET', tkey, 'msg', msg, 'state', 'pending', 'pending_since', ARGV[3] .. '000000')
      redis.call('LPUSH', aprefix .. 'pending', id)
    end
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('PEXPIRE', KEYS[1], ttl)
  if KEYS[2] then
    redis.call('SET', KEYS[2], fp(), 'PX', ttl)
  end
  return {1, id}
end
if not holder and follow == '' then
  return take() -- free, and no follow-up can be owed: no need for lib.lua
end
-- @lib: lib.lua is spliced in here, after the fast paths, so that they do
-- not pay for defining its functions.
local tprefix = aprefix .. 't:'
local fkey = dprefix() .. 'f:' .. fp()
local now_ns = ARGV[3] .. '000000'
holder = id_unpack(holder, fp())
local young = holder and now - (tonumber(rec[2]) or 0) < tonumber(grace)

-- adopt makes the waiting follow-up f the lock's owner, released to the
-- pending list if it is still parked, and returns its state.
local function adopt(f, fstate)
  if fstate == 'scheduled' then
    redis.call('ZREM', aprefix .. 'scheduled', f)
    redis.call('LPUSH', aprefix .. 'pending', f)
    redis.call('HSET', tprefix .. f, 'state', 'pending', 'pending_since', now_ns)
    fstate = 'pending'
  end
  redis.call('DEL', fkey)
  redis.call('HDEL', KEYS[1], 'tok', 'f')
  redis.call('HSET', KEYS[1], 'id', id_pack(f, fp()), 'c', now)
  if running ~= 'x' then
    redis.call('HSET', KEYS[1], 'rp', running)
  end
  redis.call('PEXPIRE', KEYS[1], ttl)
  return fstate
end
-- coalesce folds the new payload into the waiting task target (state, and
-- its message if already read).
local function coalesce(target, state, msg)
  if policy == 'x' then
    return {0, target}
  end
  if not msg then
    msg = redis.call('HGET', tprefix .. target, 'msg')
  end
  if not msg then
    return {0, target}
  end
  if policy == 'm' then
    local p = pb_bytes(msg, 2)
    if not p then return {-1, 'malformed task message'} end
    return {4, target, p, rec[6] or '0'}
  end
  local new = pb_setpayload(msg, payload)
  if not new then return {-1, 'malformed task message'} end
  if new ~= msg then -- the same payload again (common): nothing to write
    redis.call('HSET', tprefix .. target, 'msg', new)
  end
  redis.call('HINCRBY', KEYS[1], 'n', 1)
  return {3, target, state}
end

if holder then
  if holder == id then
    return {2, holder}
  end
  -- A folding policy needs the holder's message too: read both at once.
  local state, msg
  if policy == 'x' then
    state = redis.call('HGET', tprefix .. holder, 'state')
  else
    local st = redis.call('HMGET', tprefix .. holder, 'state', 'msg')
    state, msg = st[1], st[2]
  end
  if gone(state) then
    if young then
      -- Too young to tell: its producer may not have stored it in asynq yet.
      if not state and (policy ~= 'x' or running == 'd') then
        return {6, holder}
      end
      return {0, holder}
    end
    local f = rec[4]
    local fstate = f and redis.call('HGET', tprefix .. f, 'state')
    if waiting(fstate) then
      -- The holder is gone but owed a follow-up: that becomes the holder.
      redis.call('DEL', dprefix() .. 'i:' .. holder)
      return coalesce(f, adopt(f, fstate))
    end
    redis.call('DEL', KEYS[1], dprefix() .. 'i:' .. holder)
    if redis.call('HGET', KEYS[1], 'b') then
      redis.call('ZREM', dprefix() .. 'w:' .. typ, fp())
    end
    rec = {false, false, false, false, false, false}
    holder = false
  else
    local f = rec[4]
    if f then
      local fstate = redis.call('HGET', tprefix .. f, 'state')
      if waiting(fstate) then
        return coalesce(f, fstate)
      end
    end
    if rec[3] or not waiting(state) then
      -- running
      if rec[5] ~= 'd' or f or follow == '' then
        return {0, holder}
      end
      local hmsg = msg or redis.call('HGET', tprefix .. holder, 'msg')
      local copy = hmsg and pb_rewrite(hmsg, {[2] = payload, [3] = follow, [6] = false, [7] = false, [9] = false, [11] = false, [13] = false})
      if not copy then return {-1, 'malformed task message'} end
      local park = tonumber(park)
      redis.call('HSET', tprefix .. follow, 'msg', copy, 'state', 'scheduled')
      redis.call('ZADD', aprefix .. 'scheduled', now + park, follow)
      redis.call('SET', fkey, follow, 'PX', park * 1000)
      redis.call('HSET', KEYS[1], 'f', follow)
      redis.call('HINCRBY', KEYS[1], 'n', 1)
      return {5, follow}
    end
    return coalesce(holder, state, msg)
  end
end

-- No live lock. A follow-up whose run died may still be owed for this key.
if follow ~= '' then
  local orphan = redis.call('GET', fkey)
  if orphan then
    local fstate = redis.call('HGET', tprefix .. orphan, 'state')
    if waiting(fstate) then
      rec = {orphan, false, false, false, false, false}
      return coalesce(orphan, adopt(orphan, fstate))
    end
    redis.call('DEL', fkey)
  end
end

return take()
