-- again: store a copy of a running task under a new ID, scheduled for
-- later: a task that met a busy key on its last attempt, which asynq would
-- archive (it archives whenever retried >= max retry, whatever the error).
-- The copy keeps the message whole (type, payload, options, retry count);
-- only its ID differs, as the running task's own record is asynq's to
-- finish. A task that is the follow-up its key's lock owes (run early by an
-- operator) hands that place to its copy, so the end of the holder's run
-- still queues the newest payload.
--
-- KEYS[1]  asynq record of the running task
-- KEYS[2]  asynq record of the copy
-- KEYS[3]  asynq scheduled set of the queue
-- KEYS[4]  the key's lock, KEYS[5] the key's follow-up pointer (given when
--          the running task may be the lock's follow-up)
-- ARGV[1]  the copy's ID
-- ARGV[2]  unix seconds it is due
-- ARGV[3]  the running task's ID (with KEYS[4])
--
-- Reply: {1}          stored
--        {0}          the running task's record is gone: nothing to copy
--        {-1, reason} asynq's task record is not what this expects
-- @lib: lib.lua is spliced in here.
local msg = call('HGET', KEYS[1], 'msg')
if not msg then
  return {0}
end
local copy = pb_rewrite(msg, {[3] = pb_str(3, ARGV[1])})
if not copy then
  return {-1, 'malformed task message'}
end
call('HSET', KEYS[2], 'msg', copy, 'state', 'scheduled')
call('ZADD', KEYS[3], ARGV[2], ARGV[1])
if KEYS[4] and call('HGET', KEYS[4], 'f') == ARGV[3] then
  call('HSET', KEYS[4], 'f', ARGV[1])
  if call('GET', KEYS[5]) == ARGV[3] then
    call('SET', KEYS[5], ARGV[1], 'KEEPTTL')
  end
end
return {1}
