-- acquire: at enqueue, take the key's lock for a new task, fold the new
-- payload into the task that holds the key, or name the holder.
--
-- KEYS[1]  lock key            <prefix>:{<queue>}:l:<fingerprint>
-- KEYS[2]  (optional) index    <prefix>:{<queue>}:i:<task ID>, only for a caller-chosen task ID
-- ARGV[1]  ID of the new task, if one is created
-- ARGV[2]  lock lifetime while waiting, integer milliseconds
-- ARGV[3]  task type
-- ARGV[4]  asynq key prefix    asynq:{<queue>}:
-- ARGV[5]  dedup key prefix    <prefix>:{<queue>}:
-- ARGV[6]  heal grace, integer seconds
-- ARGV[7]  fingerprint hex
-- ARGV[8]  policy for a waiting holder: 'x' reject, 'r' replace, 'm' merge
-- ARGV[9]  policy for a running holder: 'x' reject, 'a' allow, 'd' defer
-- ARGV[10] the new payload (replace, and the follow-up of defer)
-- ARGV[11] ID for a follow-up task (defer)
-- ARGV[12] most keys of this type waiting in this queue, 0 for no bound
-- ARGV[13] how long a follow-up stays parked without a heartbeat, integer seconds
-- ARGV[14] asynq task message to store with a taken lock ('' for none: the caller enqueues)
-- ARGV[15] for ARGV[14]: unix seconds it is due, '0' for pending now
-- ARGV[16] the producer's clock, unix integer milliseconds
-- ARGV[17] ARGV[1] as lock records store it (see id_pack in lib.lua)
--
-- Reply: {1, id}                    lock taken for the new task ARGV[1]
--        {0, holder}                held; rejected
--        {10, stored}               the same, the holder's ID as the lock stores it (the fast path)
--        {2, id}                    already held by task ARGV[1]; untouched
--        {3, target, state}         payload of waiting task target replaced
--        {4, target, payload, ver}  merge: the caller merges and calls coalesce
--        {5, followup}              follow-up task created for the running holder
--        {6, holder}                held by a task not stored in asynq yet: try again shortly
--        {7, id}                    ARGV[14] given but task ARGV[1] already exists in asynq
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
-- enqueue plus the lock's. The clock is the producer's (ARGV[16]): asynq
-- stamps pending_since with it too, and the heal grace is far wider than
-- any sane clock skew. Only a call whose type defers (ARGV[11] given) looks
-- for an orphaned follow-up, and only a caller-chosen ID (KEYS[2]) can
-- collide with a stored task.
local now_ms = tonumber(ARGV[16])
local now = (now_ms - now_ms % 1000) / 1000
-- A folding policy needs the whole record anyway: read it at once.
local rec = ARGV[8] == 'x' and redis.call('HMGET', KEYS[1], 'id', 'c', 'f')
  or redis.call('HMGET', KEYS[1], 'id', 'c', 'f', 'tok', 'rp', 'n')
local holder = rec[1]
if holder and holder ~= ARGV[17] and ARGV[8] == 'x' and ARGV[11] == '' and not rec[3]
    and now - (tonumber(rec[2]) or 0) < tonumber(ARGV[6]) then
  -- Held by another task, young, and no answer but "held" is possible:
  -- rejected, naming the owner as the lock stores it (the caller unpacks it).
  return {10, holder}
end
if holder then
  -- rec becomes {id, c, tok, f, rp, n}.
  if ARGV[8] == 'x' then
    local more = redis.call('HMGET', KEYS[1], 'tok', 'rp', 'n')
    rec = {rec[1], rec[2], more[1], rec[3], more[2], more[3]}
  else
    rec = {rec[1], rec[2], rec[4], rec[3], rec[5], rec[6]}
  end
  -- id_unpack, inlined: lib.lua is not defined yet
  if string.byte(holder) == 61 then
    holder = string.sub(holder, 2)
  elseif #holder == 20 and not string.find(holder, '[^0-9a-f]') then
    holder = 'dd-' .. ARGV[7] .. '-' .. holder
  end
end
local young = holder and now - (tonumber(rec[2]) or 0) < tonumber(ARGV[6])
-- take takes the free key for the new task ARGV[1] (and stores the task,
-- given ARGV[14]).
local function take()
  local tkey = ARGV[4] .. 't:' .. ARGV[1]
  if ARGV[14] ~= '' and KEYS[2] and redis.call('EXISTS', tkey) == 1 then
    return {7, ARGV[1]}
  end
  local max = tonumber(ARGV[12])
  local fields = {'id', ARGV[17], 'c', now}
  if max > 0 then
    local wkey = ARGV[5] .. 'w:' .. ARGV[3]
    redis.call('ZREMRANGEBYSCORE', wkey, '-inf', now_ms)
    local n = redis.call('ZCARD', wkey)
    if n >= max then
      return {8, n}
    end
    redis.call('ZADD', wkey, now_ms + tonumber(ARGV[2]), ARGV[7])
    fields[#fields + 1] = 'b'
    fields[#fields + 1] = '1'
  end
  if ARGV[9] ~= 'x' then
    fields[#fields + 1] = 'rp'
    fields[#fields + 1] = ARGV[9]
  end
  if ARGV[14] ~= '' then
    -- Store the task as asynq's enqueue (or schedule) script would.
    if ARGV[15] ~= '0' then
      redis.call('HSET', tkey, 'msg', ARGV[14], 'state', 'scheduled')
      redis.call('ZADD', ARGV[4] .. 'scheduled', ARGV[15], ARGV[1])
    else
      redis.call('HSET', tkey, 'msg', ARGV[14], 'state', 'pending', 'pending_since', ARGV[16] .. '000000')
      redis.call('LPUSH', ARGV[4] .. 'pending', ARGV[1])
    end
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if KEYS[2] then
    redis.call('SET', KEYS[2], ARGV[7], 'PX', ARGV[2])
  end
  return {1, ARGV[1]}
end
if not holder and ARGV[11] == '' then
  return take() -- free, and no follow-up can be owed: no need for lib.lua
end
-- @lib: lib.lua is spliced in here, after the fast paths, so that they do
-- not pay for defining its functions.
local tprefix = ARGV[4] .. 't:'
local fkey = ARGV[5] .. 'f:' .. ARGV[7]
local now_ns = ARGV[16] .. '000000'

-- adopt makes the waiting follow-up f the lock's owner, released to the
-- pending list if it is still parked, and returns its state.
local function adopt(f, fstate)
  if fstate == 'scheduled' then
    redis.call('ZREM', ARGV[4] .. 'scheduled', f)
    redis.call('LPUSH', ARGV[4] .. 'pending', f)
    redis.call('HSET', tprefix .. f, 'state', 'pending', 'pending_since', now_ns)
    fstate = 'pending'
  end
  redis.call('DEL', fkey)
  redis.call('HDEL', KEYS[1], 'tok', 'f')
  redis.call('HSET', KEYS[1], 'id', id_pack(f, ARGV[7]), 'c', now)
  if ARGV[9] ~= 'x' then
    redis.call('HSET', KEYS[1], 'rp', ARGV[9])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return fstate
end
-- coalesce folds the new payload into the waiting task target (state, and
-- its message if already read).
local function coalesce(target, state, msg)
  if ARGV[8] == 'x' then
    return {0, target}
  end
  if not msg then
    msg = redis.call('HGET', tprefix .. target, 'msg')
  end
  if not msg then
    return {0, target}
  end
  if ARGV[8] == 'm' then
    local p = pb_bytes(msg, 2)
    if not p then return {-1, 'malformed task message'} end
    return {4, target, p, rec[6] or '0'}
  end
  local new = pb_setpayload(msg, ARGV[10])
  if not new then return {-1, 'malformed task message'} end
  if new ~= msg then -- the same payload again (common): nothing to write
    redis.call('HSET', tprefix .. target, 'msg', new)
  end
  redis.call('HINCRBY', KEYS[1], 'n', 1)
  return {3, target, state}
end

if holder then
  if holder == ARGV[1] then
    return {2, holder}
  end
  -- A folding policy needs the holder's message too: read both at once.
  local state, msg
  if ARGV[8] == 'x' then
    state = redis.call('HGET', tprefix .. holder, 'state')
  else
    local st = redis.call('HMGET', tprefix .. holder, 'state', 'msg')
    state, msg = st[1], st[2]
  end
  if gone(state) then
    if young then
      -- Too young to tell: its producer may not have stored it in asynq yet.
      if not state and (ARGV[8] ~= 'x' or ARGV[9] == 'd') then
        return {6, holder}
      end
      return {0, holder}
    end
    local f = rec[4]
    local fstate = f and redis.call('HGET', tprefix .. f, 'state')
    if waiting(fstate) then
      -- The holder is gone but owed a follow-up: that becomes the holder.
      redis.call('DEL', ARGV[5] .. 'i:' .. holder)
      return coalesce(f, adopt(f, fstate))
    end
    redis.call('DEL', KEYS[1], ARGV[5] .. 'i:' .. holder)
    if redis.call('HGET', KEYS[1], 'b') then
      redis.call('ZREM', ARGV[5] .. 'w:' .. ARGV[3], ARGV[7])
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
      if rec[5] ~= 'd' or f or ARGV[11] == '' then
        return {0, holder}
      end
      local hmsg = msg or redis.call('HGET', tprefix .. holder, 'msg')
      local copy = hmsg and pb_rewrite(hmsg, {[2] = ARGV[10], [3] = ARGV[11], [6] = false, [7] = false, [9] = false, [11] = false, [13] = false})
      if not copy then return {-1, 'malformed task message'} end
      local park = tonumber(ARGV[13])
      redis.call('HSET', tprefix .. ARGV[11], 'msg', copy, 'state', 'scheduled')
      redis.call('ZADD', ARGV[4] .. 'scheduled', now + park, ARGV[11])
      redis.call('SET', fkey, ARGV[11], 'PX', park * 1000)
      redis.call('HSET', KEYS[1], 'f', ARGV[11])
      redis.call('HINCRBY', KEYS[1], 'n', 1)
      return {5, ARGV[11]}
    end
    return coalesce(holder, state, msg)
  end
end

-- No live lock. A follow-up whose run died may still be owed for this key.
if ARGV[11] ~= '' then
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
