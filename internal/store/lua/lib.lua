-- lib: helpers spliced into the scripts at their "-- @lib" line (after
-- their fast paths, which then do not pay for defining them), after pb.lua.
-- They read the lock's value (record.go owns its grammar), and parse and
-- rewrite asynq v0.26.0's TaskMessage protobuf (type = 1, payload = 2,
-- id = 3, retried = 6, error_msg = 7, completed_at = 13, headers = 15);
-- TestAsynqLayoutPinned and the rewrite tests guard this. Lengths are below
-- 2^53, so the arithmetic on them is exact.

local function pb_putvarint(n)
  local t = {}
  while n >= 128 do
    local low = n % 128
    t[#t + 1] = string.char(low + 128)
    n = (n - low) / 128
  end
  t[#t + 1] = string.char(n)
  return table.concat(t)
end

-- pb_str encodes a length-delimited field ('' for an empty value, which
-- proto3 omits).
local function pb_str(num, v)
  if #v == 0 then return '' end
  return pb_putvarint(num * 8 + 2) .. pb_putvarint(#v) .. v
end

-- pb_field reads the field starting at position i: returns its number and
-- the position after it, or nil if the message is malformed there.
local function pb_field(msg, i)
  local key
  key, i = pb_varint(msg, i)
  if not key then return nil end
  local wt = key % 8
  if wt == 0 then
    local _
    _, i = pb_varint(msg, i)
    if not i then return nil end
  elseif wt == 1 then
    i = i + 8
  elseif wt == 2 then
    local len
    len, i = pb_varint(msg, i)
    if not len then return nil end
    i = i + len
  elseif wt == 5 then
    i = i + 4
  else
    return nil
  end
  if i > #msg + 1 then return nil end
  return (key - wt) / 8, i
end

-- pb_fields splits a message into {num, from, to} entries (to inclusive),
-- or returns nil for a malformed message.
local function pb_fields(msg)
  local out, i, n = {}, 1, #msg
  while i <= n do
    local num, after = pb_field(msg, i)
    if not num then return nil end
    out[#out + 1] = {num, i, after - 1}
    i = after
  end
  return out
end

-- pb_bytes returns the value of length-delimited field num ('' if absent),
-- or nil for a malformed message.
local function pb_bytes(msg, num)
  local fields = pb_fields(msg)
  if not fields then return nil end
  local val = ''
  for _, f in ipairs(fields) do
    if f[1] == num then
      local _, start = pb_varint(msg, f[2])
      local len
      len, start = pb_varint(msg, start)
      val = string.sub(msg, start, start + len - 1)
    end
  end
  return val
end

-- pb_rewrite returns msg with each field in repl replaced: repl[num] is the
-- whole encoded field (as pb_str makes it; '' drops the field). Fields
-- keep number order. Returns nil for a malformed message.
local function pb_rewrite(msg, repl)
  local fields = pb_fields(msg)
  if not fields then return nil end
  local nums = {}
  for num in pairs(repl) do nums[#nums + 1] = num end
  table.sort(nums)
  local out, k = {}, 1
  local function emit_upto(limit)
    while k <= #nums and nums[k] < limit do
      out[#out + 1] = repl[nums[k]]
      k = k + 1
    end
  end
  for _, f in ipairs(fields) do
    emit_upto(f[1])
    if repl[f[1]] == nil then
      out[#out + 1] = string.sub(msg, f[2], f[3])
    elseif k <= #nums and nums[k] == f[1] then
      emit_upto(f[1] + 1)
    end
  end
  emit_upto(math.huge)
  return table.concat(out)
end

-- pb_setpayload returns msg with its payload field replaced by field (the
-- whole encoded field 2, '' for an empty payload), as
-- pb_rewrite(msg, {[2] = field}) does: by pb_splice when the message has
-- asynq's shape, else by the rewrite. Returns nil for a malformed message.
local function pb_setpayload(msg, field)
  return pb_splice(msg, field) or pb_rewrite(msg, {[2] = field})
end

-- waiting reports whether an asynq task state means "not started yet".
local function waiting(state)
  return state == 'pending' or state == 'scheduled' or state == 'retry'
end

-- gone reports whether an asynq task state (false: no record) means its
-- task will never run again, so a lock it holds is orphaned.
local function gone(state)
  return (not state) or state == 'completed' or state == 'archived'
end

-- now_parts reads the server clock: unix seconds, milliseconds, and
-- nanoseconds as a string (asynq's pending_since).
local function now_parts()
  local t = call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s, s * 1000 + (us - us % 1000) / 1000, t[1] .. string.format('%06d', us) .. '000'
end

-- lacks records which of the roles in r were not given (in `lacking`,
-- which a script replies with so that its caller calls again with them).
local lacking = ''
local function lacks(r)
  for i = 1, #r do
    local c = string.sub(r, i, i)
    if not K[c] then lacking = lacking .. c end
  end
  return lacking ~= ''
end

-- keep makes the mode record mode live as long as the lock.
local function keep(lock, mode)
  local left = call('PTTL', lock)
  if left > 0 then
    call('PEXPIRE', mode, left)
  elseif left == -1 then
    call('PERSIST', mode)
  end
end

-- lengthen makes key live at least ms more (a key without expiry stays so).
local function lengthen(key, ms)
  local left = call('PTTL', key)
  if left >= 0 and left < tonumber(ms) then
    call('PEXPIRE', key, ms)
  end
end

-- queue_now moves the waiting task id (record rec, in state) to the pending
-- list now, from the scheduled set or the retry set, as asynq's forwarder
-- would. Returns its state after.
local function queue_now(rec, id, state, sched, retry, pending)
  if state == 'pending' then return state end
  call('ZREM', state == 'retry' and retry or sched, id)
  call('LPUSH', pending, id)
  local _, _, ns = now_parts()
  call('HSET', rec, 'state', 'pending', 'pending_since', ns)
  return 'pending'
end

-- mark adds the header dedup-lost = reason to the stored task rec (a
-- waiting or archived task asynq will not rewrite before it runs): the
-- task lost its key, so its next run checks the key first.
local function mark(rec, reason)
  local msg = call('HGET', rec, 'msg')
  if not msg then return end
  local entry = pb_str(1, 'dedup-lost') .. pb_str(2, reason)
  local field = pb_putvarint(122) .. pb_putvarint(#entry) .. entry -- field 15, length-delimited
  if not string.find(msg, field, 1, true) then
    call('HSET', rec, 'msg', msg .. field)
  end
end

-- belongs reports whether the stored task rec is the holder the lock at lock
-- names (kind: the value's): an ID this library made is never used twice,
-- but a caller's may be, by a task of another key once the first is gone.
-- (A lock taken as its task started is that task's: its record names none.)
local function belongs(rec, holder, kind, lock)
  if kind == 'a' or string.match(holder, '^d[dfka]%-') then return true end
  local t = call('HMGET', rec, 'unique_key', 'msg')
  if t[1] then return t[1] == lock end
  return not t[2] or string.find(t[2], lock, 1, true) ~= nil
end

-- same_type reports whether a stored message is of type typ (asynq's
-- messages begin with the type field).
local function same_type(msg, typ)
  local tf = pb_str(1, typ)
  return msg and string.sub(msg, 1, #tf) == tf
end

-- debounce moves the due time of the scheduled task t to due (unix seconds;
-- '0' none), never earlier, and makes its lock last ttl ms from now at
-- least, with its entry fp in the waiting set wait (if given): a burst of
-- folds runs once, after the last. A task already due keeps its place.
local function debounce(lock, sched, t, tstate, due, ttl, wait, fp, now_ms)
  if due == '0' or tstate ~= 'scheduled' then return end
  if tonumber(call('ZSCORE', sched, t) or '0') < tonumber(due) then
    call('ZADD', sched, 'XX', due, t)
  end
  if call('PTTL', lock) < tonumber(ttl) then
    call('PEXPIRE', lock, ttl)
    if wait then
      call('ZADD', wait, 'XX', now_ms + tonumber(ttl), fp)
    end
  end
end

-- placed reads where asynq keeps task id: its record's state ('' when the
-- record is missing) and whether the list or set that state names holds it
-- (true too for a state that names none: completed, archived, aggregating).
local function placed(rec, pending, active, scheduled, retry, id)
  local state = call('HGET', rec, 'state')
  if not state then return '', false end
  local there = true
  if state == 'pending' then
    there = call('LPOS', pending, id)
  elseif state == 'active' then
    there = call('LPOS', active, id)
  elseif state == 'scheduled' then
    there = call('ZSCORE', scheduled, id)
  elseif state == 'retry' then
    there = call('ZSCORE', retry, id)
  end
  return state, there and true or false
end
