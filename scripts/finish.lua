-- finish: an attempt ended; release the lock, or hold it for the retry.
--
-- KEYS[1]  lock key
-- KEYS[2]  (optional) index key of a caller-chosen task ID
-- ARGV[1]  task ID
-- ARGV[2]  attempt token
-- ARGV[3]  'release' (success, revoked, final failure) or 'hold' (a retry follows)
-- ARGV[4]  for 'hold': lifetime, integer milliseconds
--
-- Reply: 1 done; 0 not ours any more (another task or a newer attempt), untouched
local rec = redis.call('HMGET', KEYS[1], 'id', 'tok')
if rec[1] ~= ARGV[1] or rec[2] ~= ARGV[2] then
  return 0
end
if ARGV[3] == 'release' then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    redis.call('DEL', KEYS[2])
  end
  return 1
end
redis.call('HDEL', KEYS[1], 'tok')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if KEYS[2] then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return 1
