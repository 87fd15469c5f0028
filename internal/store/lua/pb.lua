-- pb: the two helpers a fast path needs to replace the payload of asynq's
-- TaskMessage, spliced in at a script's "-- @pb" line (else just before
-- lib.lua). Lengths are below 2^53, so the arithmetic on them is exact.

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

-- pb_splice returns msg with its payload field (2) replaced by field (the
-- whole encoded field, '' for an empty payload), or nil unless msg has the
-- shape asynq (Go's protobuf) writes: each field once, in number order, so
-- the payload follows the type (field 1) and everything after it is copied
-- untouched, unread. pb_setpayload (lib.lua) takes every other message.
local function pb_splice(msg, field)
  local i = 1
  if string.byte(msg, 1) == 10 then -- field 1 (type), length-delimited
    local len
    len, i = pb_varint(msg, 2)
    if not len then return nil end
    i = i + len
  end
  if string.byte(msg, i) ~= 18 then -- no payload field right after the type
    return nil
  end
  local len, j = pb_varint(msg, i + 1)
  if not len then return nil end
  j = j + len
  if j > #msg + 1 then return nil end
  if j <= #msg then
    local tag = pb_varint(msg, j)
    if not tag or tag < 24 then return nil end -- a field 1 or 2 follows
  end
  return string.sub(msg, 1, i - 1) .. field .. string.sub(msg, j)
end
