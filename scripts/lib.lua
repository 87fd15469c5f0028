-- lib: helpers prepended to the scripts that read or write asynq's own task
-- record. They parse and rewrite asynq v0.26.0's TaskMessage protobuf
-- (type = 1, payload = 2, id = 3, retried = 6, error_msg = 7,
-- last_failed_at = 11, completed_at = 13); TestAsynqLayoutPinned and the
-- rewrite tests guard this against layout changes.
-- Lengths are below 2^53, so the arithmetic on them is exact.

-- pb_varint reads a varint at position i; returns value and next position,
-- or nil if the bytes end first.
local function pb_varint(s, i)
  local v, m = 0, 1
  while true do
    local b = string.byte(s, i)
    if not b then return nil end
    i = i + 1
    if b < 128 then return v + b * m, i end
    v = v + (b - 128) * m
    m = m * 128
  end
end

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

-- pb_rewrite returns msg with each field in repl replaced: repl[num] is a
-- string (written as a length-delimited field, omitted when empty, as
-- proto3 does) or false (the field is dropped). Fields keep number order.
-- Returns nil for a malformed message.
local function pb_rewrite(msg, repl)
  local fields = pb_fields(msg)
  if not fields then return nil end
  local nums = {}
  for num, v in pairs(repl) do
    if v then nums[#nums + 1] = num end
  end
  table.sort(nums)
  local out, k = {}, 1
  local function emit_upto(limit)
    while k <= #nums and nums[k] < limit do
      local v = repl[nums[k]]
      if #v > 0 then
        out[#out + 1] = pb_putvarint(nums[k] * 8 + 2) .. pb_putvarint(#v) .. v
      end
      k = k + 1
    end
  end
  for _, f in ipairs(fields) do
    emit_upto(f[1])
    if repl[f[1]] == nil then
      out[#out + 1] = string.sub(msg, f[2], f[3])
    elseif repl[f[1]] and k <= #nums and nums[k] == f[1] then
      emit_upto(f[1] + 1)
    end
  end
  emit_upto(math.huge)
  return table.concat(out)
end

-- pb_setpayload returns msg with its payload (field 2) set to p, the way
-- pb_rewrite(msg, {[2] = p}) does, but by splicing in place: asynq (Go's
-- protobuf) writes fields once and in number order, the payload right after
-- the type, so the scan stops at the first field after it and the rest is
-- copied untouched. Unusual messages (field 2 repeated) go to pb_rewrite.
local function pb_setpayload(msg, p)
  local i, n = 1, #msg
  local from, to, at
  while i <= n do
    local num, after = pb_field(msg, i)
    if not num then return nil end
    if num > 2 and not at then
      at = i
      if from then break end -- fields come in number order: no field 2 follows
    end
    if num == 2 then
      if from then return pb_rewrite(msg, {[2] = p}) end
      from, to = i, after - 1
    end
    i = after
  end
  local field = ''
  if #p > 0 then field = pb_putvarint(18) .. pb_putvarint(#p) .. p end
  if from then
    return string.sub(msg, 1, from - 1) .. field .. string.sub(msg, to + 1)
  end
  at = at or n + 1
  return string.sub(msg, 1, at - 1) .. field .. string.sub(msg, at)
end

-- Lock records store their owner's task ID compactly: an ID the wrapper
-- generated for the key (dd-<fingerprint>-<20 hex>) as its 20 hex digits,
-- any other ID as itself, or as '=' .. ID where that would be ambiguous (20
-- hex digits, or a leading '='). The Go side (packLockID) does the same.
local function id_unpack(s, fp)
  if not s then return s end
  if string.byte(s) == 61 then return string.sub(s, 2) end
  if #s == 20 and not string.find(s, '[^0-9a-f]') then return 'dd-' .. fp .. '-' .. s end
  return s
end

local function id_pack(id, fp)
  local p = 'dd-' .. fp .. '-'
  local rest = string.sub(id, #p + 1)
  if string.sub(id, 1, #p) == p and #rest == 20 and not string.find(rest, '[^0-9a-f]') then
    return rest
  end
  if string.byte(id) == 61 or (#id == 20 and not string.find(id, '[^0-9a-f]')) then
    return '=' .. id
  end
  return id
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

-- now_s and now_ms read the server clock as integers.
local function now_parts()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s, s * 1000 + (us - us % 1000) / 1000, t[1] .. string.format('%06d', us) .. '000'
end
