-- prelude: first in every script. `call` is redis.call (in tests, checked.lua's,
-- which refuses keys not in KEYS). K maps the role letters of ARGV[1] (roles.go)
-- to KEYS: roles(from) reads letter from + i for KEYS[i]; KEYS[1] is the lock, L.
local call = redis.call
local K = {L = KEYS[1]}
local function roles(from)
  for i = 2, #KEYS do K[string.sub(ARGV[1], from + i, from + i)] = KEYS[i] end
end

-- holder_of splits a lock's value (false: no lock; value.go owns the grammar)
-- into the task that holds the key, the kind of hold ('' held by its task; 'w'
-- taken at `at`, unix seconds, before its task was stored; 'a' taken as its task
-- started; 'c' cooling after its success; 'k' held by its task, and cooling
-- until `at`, unix ms, once asynq records it completed; 'x' a Scheduler
-- firing's, held until it expires), and at.
local function holder_of(v)
  if not v then return nil, '' end
  local i = string.byte(v, 1) == 126 and string.find(v, ':', 2, true)
  if not i then return v, '' end
  return string.sub(v, i + 1), string.sub(v, 2, 2), tonumber(string.sub(v, 3, i - 1)) or 0
end

-- waiting: an asynq task state that has not started; gone: one (false: no
-- record) whose task will never run again, so a lock it holds is orphaned.
local function waiting(state) return state == 'pending' or state == 'scheduled' or state == 'retry' end
local function gone(state) return not state or state == 'completed' or state == 'archived' end

-- keep makes the mode record mode live as long as the lock.
local function keep(lock, mode)
  local left = call('PTTL', lock)
  if left > 0 then call('PEXPIRE', mode, left) elseif left == -1 then call('PERSIST', mode) end
end

-- now_parts reads the server clock: unix seconds, milliseconds, and nanoseconds
-- as a string (asynq's pending_since).
local function now_parts()
  local t = call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s, s * 1000 + (us - us % 1000) / 1000, t[1] .. string.format('%06d', us) .. '000'
end

-- cools returns how long more (ms) a key kept past its task by asynq's record
-- (kind 'k': until at, unix ms) cools down, once that task completed; else nil.
local function cools(kind, at, state)
  local left = kind == 'k' and state == 'completed' and at - select(2, now_parts())
  return left and left > 0 and left or nil
end

-- ended reports whether the stored message msg carries the header dedup-lost:
-- ended (lib.lua's mark, after a success or revoke; task.go's LostEnded):
-- asynq put the task back before it recorded that end (a shutdown), and it
-- will not run again, so a lock it holds while it waits is orphaned.
local function ended(msg) return msg and string.find(msg, '\10\10dedup-lost\18\5ended', 1, true) ~= nil end
