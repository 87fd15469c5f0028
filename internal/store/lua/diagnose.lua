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
-- @lib: lib.lua is spliced in here.
local state, there = placed(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1])
if there then
  return {1, state, 1}
end
return {1, state, 0}
