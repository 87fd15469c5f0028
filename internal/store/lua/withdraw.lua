-- withdraw: delete a task an enqueuer has just stored where the call that made
-- it is folded or refused (a task it put in another queue than the call's lock),
-- if no worker has taken it yet. asynq's Inspector cannot always (it refuses a
-- queue missing from its set of queues, as after a DeleteQueue that a client of
-- the same process would not register again).
--
-- KEYS[1]  asynq record of the task
-- KEYS[2]  asynq pending list, KEYS[3] asynq scheduled set, of its queue
-- ARGV[1]  task ID
--
-- Reply: 1 deleted; 0 not waiting there (a worker took it, or it is gone): left alone
local state = call('HGET', KEYS[1], 'state')
local taken = (state == 'pending' and call('LREM', KEYS[2], 1, ARGV[1]))
  or (state == 'scheduled' and call('ZREM', KEYS[3], ARGV[1])) or 0
if taken == 0 then return 0 end
call('DEL', KEYS[1])
return 1
