-- again: store a copy of a running task under a new ID, scheduled for later: a
-- task that met a busy key on its last attempt, which asynq would archive (it
-- archives whenever retried >= max retry, whatever the error). The copy keeps the
-- message whole (type, payload, options, headers, retry count) and its record's
-- unique_key; only its ID differs, as the running task's own record is asynq's to
-- finish. A task that is the follow-up its key owes hands that place to its copy.
--
-- KEYS[1]  asynq record of the running task; KEYS[2] the copy's
-- KEYS[3]  asynq scheduled set of the queue
-- KEYS[4]  the key's mode record (when the task may be its follow-up)
-- ARGV[1]  the copy's ID; ARGV[2] unix seconds it is due; ARGV[3] the running task's ID
--
-- Reply: {1}          stored
--        {0}          the running task's record is gone: nothing to copy
--        {-1, reason} asynq's task record is not what this expects
-- @lib: lib.lua is spliced in here.
local t = call('HMGET', KEYS[1], 'msg', 'unique_key')
if not t[1] then return {0} end
local copy = pb_rewrite(t[1], {[3] = pb_str(3, ARGV[1])})
if not copy then return {-1, 'malformed task message'} end
call('HSET', KEYS[2], 'msg', copy, 'state', 'scheduled')
if t[2] then call('HSET', KEYS[2], 'unique_key', t[2]) end
call('ZADD', KEYS[3], ARGV[2], ARGV[1])
if KEYS[4] and call('HGET', KEYS[4], 'f') == ARGV[3] then call('HSET', KEYS[4], 'f', ARGV[1]) end
return {1}
