-- lib: helpers spliced at a script's "-- @lib" line, after pb.lua (after the
-- script's fast paths, which then do not pay for defining them). They parse and
-- rewrite asynq v0.26.0's TaskMessage (type = 1, payload = 2, id = 3, retried =
-- 6, error_msg = 7, completed_at = 13, headers = 15), as TestAsynqLayoutPinned
-- and the rewrite tests guard.

local function pb_putvarint(n)
  if n < 128 then return string.char(n) end
  local low = n % 128
  return string.char(low + 128) .. pb_putvarint((n - low) / 128)
end

-- pb_str encodes a length-delimited field ('' for an empty value: proto3 omits it).
local function pb_str(num, v) return #v == 0 and '' or pb_putvarint(num * 8 + 2) .. pb_putvarint(#v) .. v end

-- pb_fields splits msg into {num, from, to, value} entries (to inclusive; value:
-- where a length-delimited field's bytes begin), or returns nil if it is malformed.
local function pb_fields(msg)
  local out, i = {}, 1
  while i <= #msg do
    local key, j = pb_varint(msg, i)
    if not key then return nil end
    local wt, v, at = key % 8
    if wt == 0 or wt == 2 then -- varint; length-delimited
      v, j = pb_varint(msg, j)
      if not v then return nil end
      if wt == 2 then at, j = j, j + v end
    elseif wt == 1 or wt == 5 then -- 64-bit; 32-bit
      j = j + (wt == 1 and 8 or 4)
    else
      return nil
    end
    if j > #msg + 1 then return nil end
    out[#out + 1] = {(key - wt) / 8, i, j - 1, at}
    i = j
  end
  return out
end

-- pb_bytes returns the value of length-delimited field num ('' if absent), or
-- nil for a malformed message.
local function pb_bytes(msg, num)
  local fields, val = pb_fields(msg), ''
  if not fields then return nil end
  for _, f in ipairs(fields) do if f[1] == num and f[4] then val = string.sub(msg, f[4], f[3]) end end
  return val
end

-- pb_rewrite returns msg with each field in repl replaced (a repeated one once):
-- repl[num] is the whole encoded field (as pb_str makes it; '' drops it). Fields
-- keep number order. Returns nil for a malformed message.
local function pb_rewrite(msg, repl)
  local fields, nums, out, k = pb_fields(msg), {}, {}, 1
  if not fields then return nil end
  for num in pairs(repl) do nums[#nums + 1] = num end
  table.sort(nums)
  local function emit_upto(limit) -- the replacements not yet emitted below limit
    while nums[k] and nums[k] < limit do
      out[#out + 1] = repl[nums[k]]
      k = k + 1
    end
  end
  for _, f in ipairs(fields) do
    local r = repl[f[1]]
    emit_upto(r and f[1] + 1 or f[1])
    if not r then out[#out + 1] = string.sub(msg, f[2], f[3]) end
  end
  emit_upto(math.huge)
  return table.concat(out)
end

-- pb_setpayload is pb_rewrite(msg, {[2] = field}), by pb_splice where msg has
-- asynq's shape.
local function pb_setpayload(msg, field)
  return pb_splice(msg, field) or pb_rewrite(msg, {[2] = field})
end

-- lacks adds the roles of r that were not given to `lacking` (which a script
-- replies, for its caller to call again with them); true if any are lacking.
local lacking = ''
local function lacks(r)
  for c in string.gmatch(r, '.') do if not K[c] then lacking = lacking .. c end end
  return lacking ~= ''
end

-- hand names holder, with n folds, in mode: another task's note (o) and error go.
local function hand(mode, holder, n)
  call('HSET', mode, 'id', holder, 'n', n)
  call('HDEL', mode, 'o', 'oa', 'e')
end

-- count counts a fold into holder's key (the version Merge compares) in its
-- mode record, whose holder was id.
local function count(lock, mode, id, holder)
  if id ~= holder then hand(mode, holder, 1) else call('HINCRBY', mode, 'n', 1) end
  keep(lock, mode)
end

-- lengthen makes key live at least ms more (a key without expiry stays so).
local function lengthen(key, ms)
  local left = call('PTTL', key)
  if left >= 0 and left < tonumber(ms) then call('PEXPIRE', key, ms) end
end

-- queue_now moves the follow-up f (record K.G), if it waits, to the pending list
-- now, from the scheduled set K.S or the retry set K.R, as asynq's forwarder
-- would. Returns whether it waited.
local function queue_now(f)
  local state = call('HGET', K.G, 'state')
  if not waiting(state) then return false end
  if state ~= 'pending' then
    call('ZREM', state == 'retry' and K.R or K.S, f)
    call('LPUSH', K.P, f)
    call('HSET', K.G, 'state', 'pending', 'pending_since', select(3, now_parts()))
  end
  return true
end

-- mark adds the header dedup-lost = reason to the stored task rec (a waiting or
-- archived task asynq will not rewrite before it runs): it lost its key, so its
-- next run checks the key first.
local function mark(rec, reason)
  local msg = call('HGET', rec, 'msg')
  local field = pb_str(15, pb_str(1, 'dedup-lost') .. pb_str(2, reason))
  if msg and not string.find(msg, field, 1, true) then call('HSET', rec, 'msg', msg .. field) end
end

-- outlived reports whether a mode record's o (unix ms, by the server's clock)
-- says a handler of its holder that asynq gave up still runs.
local function outlived(o) return o and tonumber(o) > select(2, now_parts()) or false end

-- belongs reports whether the stored task rec is the holder the lock at lock
-- names (kind: the value's): an ID this library made is never used twice, but a
-- caller's may be, by another key's task once the first is gone: its record
-- names its lock (unique_key, or the dedup header), but for one that took it as
-- it started ('a'): none, or one of its fingerprint (an enqueuer moved it, relocate.go).
local function belongs(rec, holder, kind, lock)
  if string.match(holder, '^d[dfkam]%-') then return true end
  local t, fp = call('HMGET', rec, 'unique_key', 'msg'), string.match(lock, '}:u:%x+$')
  if t[1] then return t[1] == lock end
  if not t[2] or string.find(t[2], lock, 1, true) then return true end
  return kind == 'a' and (not string.find(t[2], '\n\5dedup\18', 1, true) or string.find(t[2], '\n\5dedup\18[^\n]-' .. fp .. '%f[%X]') ~= nil)
end

-- same_type reports whether a stored message is of type typ (asynq's begin
-- with the type field).
local function same_type(msg, typ)
  local tf = pb_str(1, typ)
  return msg and string.sub(msg, 1, #tf) == tf
end

-- debounce moves the due time of the scheduled task t to due (unix seconds; '0'
-- none), never earlier, and makes its lock last ttl ms from now at least, with
-- its entry fp in the waiting set wait (if given): a burst of folds runs once,
-- after the last. A task already due keeps its place.
local function debounce(lock, sched, t, tstate, due, ttl, wait, fp, now_ms)
  if due == '0' or tstate ~= 'scheduled' then return end
  if tonumber(call('ZSCORE', sched, t) or '0') < tonumber(due) then call('ZADD', sched, 'XX', due, t) end
  if call('PTTL', lock) < tonumber(ttl) then
    call('PEXPIRE', lock, ttl)
    if wait then call('ZADD', wait, 'XX', now_ms + tonumber(ttl), fp) end
  end
end
