-- diagnose: where asynq keeps a task, read atomically (dedupctl doctor): its
-- record's state and whether the list or set that state names holds it.
--
-- KEYS[1]  asynq record of the task
-- KEYS[2]  asynq pending list, KEYS[3] active list, KEYS[4] scheduled set,
--          KEYS[5] retry set, all of the task's queue
-- ARGV[1]  task ID
--
-- Reply: {1, state, there}  state '' when the record is missing; there 1
--                           when the state's list or set holds the ID (or the
--                           state names none: completed, archived,
--                           aggregating), else 0
local state = call('HGET', KEYS[1], 'state')
if not state then
  return {1, '', 0}
end
local id, there = ARGV[1], true
if state == 'pending' then
  there = call('LPOS', KEYS[2], id)
elseif state == 'active' then
  there = call('LPOS', KEYS[3], id)
elseif state == 'scheduled' then
  there = call('ZSCORE', KEYS[4], id)
elseif state == 'retry' then
  there = call('ZSCORE', KEYS[5], id)
end
if there then
  return {1, state, 1}
end
return {1, state, 0}
