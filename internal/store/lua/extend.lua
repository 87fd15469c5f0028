-- extend: renew a lock's lifetime if its owner (task and attempt) still holds
-- it. The heartbeat renews running attempts; the client lengthens a waiting
-- lock when its task turns out to be scheduled.
--
-- KEYS[1]  the lock
-- KEYS[2]  asynq scheduled set of the queue
-- KEYS[3]  the key's follow-up pointer
-- KEYS[4]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID, as lock records store it
-- ARGV[2]  attempt token, or '' to renew a waiting lock (no attempt running)
-- ARGV[3]  lifetime, integer milliseconds
-- ARGV[4]  how long a follow-up stays parked from now, integer seconds
-- ARGV[5]  task ID (a lock of the earlier layout holds it whole)
--
-- Reply: 1 renewed; 0 the lock is gone or belongs to another task or attempt
--
-- A parked follow-up (Defer) is kept parked for another ARGV[4] seconds. A
-- lock with a cooldown (field cd) lives until the cooldown's end at least.
-- @lib: lib.lua is spliced in here.
local rec = call('HMGET', KEYS[1], 'id', 'tok', 'f', 'cd')
if (rec[1] ~= ARGV[1] and rec[1] ~= ARGV[5]) or (rec[2] or '') ~= ARGV[2] then
  return 0
end
local life = tonumber(ARGV[3])
if rec[4] then -- a cooldown: the lock lasts until its end at least
  local _, now_ms = now_parts()
  life = math.max(life, tonumber(rec[4]) - now_ms)
end
call('PEXPIRE', KEYS[1], life)
if KEYS[4] then
  call('PEXPIRE', KEYS[4], ARGV[3])
end
if rec[3] then
  local now = now_parts()
  call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[4]), rec[3])
  call('PEXPIRE', KEYS[3], tonumber(ARGV[4]) * 1000)
end
return 1
