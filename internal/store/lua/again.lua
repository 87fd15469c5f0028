-- again: store a copy of a running task under a new ID, scheduled for
-- later: a task that met a busy key on its last attempt, which asynq would
-- archive (it archives whenever retried >= max retry, whatever the error).
-- The copy keeps the message whole (type, payload, options, retry count);
-- only its ID differs, as the running task's own record is asynq's to
-- finish.
--
-- KEYS[1]  asynq record of the running task
-- KEYS[2]  asynq record of the copy
-- KEYS[3]  asynq scheduled set of the queue
-- ARGV[1]  the copy's ID
-- ARGV[2]  unix seconds it is due
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
return {1}
