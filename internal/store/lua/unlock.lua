-- unlock: give back a lock whose enqueue asynq refused.
--
-- KEYS, by the role letters of ARGV[1] (only keys that exist are given, so
-- that during a slot migration the call runs wholly on one side):
--   L  the lock                                          always
--   W  the task type's waiting set                       when the lock may be counted there
--   I  index key of a caller-chosen task ID              with a caller-chosen ID
-- ARGV[1]  the roles of KEYS, one letter each
-- ARGV[2]  task ID that took the lock, as lock records store it
-- ARGV[3]  fingerprint (member of W)
-- ARGV[4]  task ID (a lock of the earlier layout holds it whole)
--
-- Reply: 1 released; 0 not ours, or the task already started (left alone)
roles(0)
local rec = call('HMGET', K.L, 'id', 'tok', 'b')
if (rec[1] ~= ARGV[2] and rec[1] ~= ARGV[4]) or rec[2] then
  return 0
end
call('DEL', K.L)
if K.I and call('GET', K.I) == ARGV[3] then -- the ID's index, if it leads here
  call('DEL', K.I)
end
if rec[3] and K.W then
  call('ZREM', K.W, ARGV[3])
end
return 1
