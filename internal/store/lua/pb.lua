-- pb: what a fast path needs to replace the payload of asynq's TaskMessage,
-- spliced at a script's "-- @pb" line (else just before lib.lua). Lengths are
-- below 2^53, so the arithmetic on them is exact.

-- pb_varint reads the varint at i: its value and the next position, or nil if
-- the bytes end first.
local function pb_varint(s, i)
  local v, m = 0, 1
  for j = i, #s do
    local b = string.byte(s, j)
    if b < 128 then return v + b * m, j + 1 end
    v, m = v + (b - 128) * m, m * 128
  end
end

-- pb_splice returns msg with its payload field (2) replaced by field (encoded
-- whole, '' for an empty payload), or nil unless msg has the shape asynq (Go's
-- protobuf) writes: each field once, in number order, so the payload follows the
-- type (field 1) and what follows it is copied unread. The speed of Replace:
-- pb_setpayload (lib.lua) rewrites the other messages.
local function pb_splice(msg, field)
  local i = 1
  if string.byte(msg, 1) == 10 then -- field 1 (type), length-delimited
    local len, j = pb_varint(msg, 2)
    if not len then return nil end
    i = j + len
  end
  if string.byte(msg, i) ~= 18 then return nil end -- no payload right after the type
  local len, j = pb_varint(msg, i + 1)
  if not len or j + len > #msg + 1 then return nil end
  j = j + len
  if j <= #msg and (pb_varint(msg, j) or 0) < 24 then return nil end -- a field 1 or 2 follows
  return string.sub(msg, 1, i - 1) .. field .. string.sub(msg, j)
end
