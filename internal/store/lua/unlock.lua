-- unlock: give back a lock whose enqueue asynq refused.
--
-- KEYS[1]  the lock
-- KEYS[2]  the task type's waiting set
-- KEYS[3]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID that took the lock, as lock records store it
-- ARGV[2]  fingerprint (member of KEYS[2])
-- ARGV[3]  task ID (a lock of the earlier layout holds it whole)
--
-- Reply: 1 released; 0 not ours, or the task already started (left alone)
local rec = call('HMGET', KEYS[1], 'id', 'tok', 'b')
if (rec[1] ~= ARGV[1] and rec[1] ~= ARGV[3]) or rec[2] then
  return 0
end
call('DEL', KEYS[1])
if KEYS[3] and call('GET', KEYS[3]) == ARGV[2] then -- the ID's index, if it leads here
  call('DEL', KEYS[3])
end
if rec[3] then
  call('ZREM', KEYS[2], ARGV[2])
end
return 1
