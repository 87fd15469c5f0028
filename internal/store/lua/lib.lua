-- lib: helpers spliced into the scripts that read or write asynq's own task
-- record (at their "-- @lib" line, after the fast paths, which then do not
-- pay for defining them), after pb.lua. They parse and rewrite asynq v0.26.0's
-- TaskMessage protobuf (type = 1, payload = 2, id = 3, retried = 6,
-- error_msg = 7, deadline = 9, last_failed_at = 11, completed_at = 13);
-- TestAsynqLayoutPinned and the rewrite tests guard this.
-- Lengths are below 2^53, so the arithmetic on them is exact.

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
-- task will never run again, so a lock it owns is orphaned.
local function gone(state)
  return (not state) or state == 'completed' or state == 'archived'
end

-- debounce moves the due time of a scheduled task t to due (unix seconds,
-- '0' for no debounce), never earlier than it was, and makes its lock last
-- at least ttl_ms from now_ms, with the task's index key (index, if given:
-- a caller-chosen ID) and its entry fp in the waiting set (wait, if given
-- and counted there), when a payload was folded into it: a burst of folds
-- runs once, after the last. A task already due keeps its place.
local function debounce(lock, sched, t, tstate, due, ttl_ms, index, wait, fp, now_ms)
  if due == '0' or tstate ~= 'scheduled' then return end
  if tonumber(call('ZSCORE', sched, t) or '0') < tonumber(due) then
    call('ZADD', sched, 'XX', due, t)
  end
  if call('PTTL', lock) < tonumber(ttl_ms) then
    call('PEXPIRE', lock, ttl_ms)
    if index then
      call('PEXPIRE', index, ttl_ms) -- (none for an ID the wrapper chose)
    end
    if wait then
      call('ZADD', wait, 'XX', now_ms + tonumber(ttl_ms), fp)
    end
  end
end

-- queue_now moves task id, parked in asynq's scheduled set sched (its
-- record rec in state), to the pending list now, as asynq's forwarder
-- would (pending_since: since, in nanoseconds); a task already pending or
-- waiting for a retry stays. Returns its state after.
local function queue_now(sched, pending, rec, id, state, since)
  if state ~= 'scheduled' then return state end
  call('ZREM', sched, id)
  call('LPUSH', pending, id)
  call('HSET', rec, 'state', 'pending', 'pending_since', since)
  return 'pending'
end

-- placed reads where asynq keeps task id: its record's state ('' when the
-- record is missing) and whether the list or set that state names holds it
-- (true too for a state that names none: completed, archived, aggregating).
local function placed(rec, pending, active, scheduled, retry, id)
  local state = call('HGET', rec, 'state')
  if not state then
    return '', false
  end
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

-- now_parts reads the server clock: unix seconds, milliseconds, and
-- nanoseconds as a string (asynq's pending_since).
local function now_parts()
  local t = call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s, s * 1000 + (us - us % 1000) / 1000, t[1] .. string.format('%06d', us) .. '000'
end

-- hold_failed keeps lock held after its owner failed for good (OnFailure:
-- fh, the lock's failure hold, '-1' for until released), marked k 'f' with
-- the owner's last error err (kept if err is false and one is there), and
-- returns its PTTL. A period key's hold ends with its window at the latest:
-- the next window is another key. index, if given, is the owner's index
-- key (a caller-chosen ID), kept as long, so that a run by hand finds it
-- (30 days at most for a hold until released).
local function hold_failed(lock, fh, err, index)
  call('HDEL', lock, 'tok')
  call('HSET', lock, 'k', 'f')
  if err or call('HEXISTS', lock, 'e') == 0 then
    call('HSET', lock, 'e', string.sub(err or 'archived by asynq', 1, 1000))
  end
  local _, now_ms = now_parts()
  local ms = tonumber(fh)
  local w = call('HGET', lock, 'pw')
  local w_end = w and tonumber(string.match(w, ':(%d+)$'))
  if w_end and (ms < 0 or now_ms + ms > w_end) then
    ms = math.max(w_end - now_ms, 1)
  end
  if ms < 0 then
    call('PERSIST', lock)
  else
    call('PEXPIRE', lock, ms)
  end
  if index then
    call('PEXPIRE', index, ms < 0 and 2592000000 or ms)
  end
  return call('PTTL', lock)
end
