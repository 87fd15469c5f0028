-- optout: mark a caller-chosen task ID as enqueued without deduplication
-- (its index key holds '-'), so the middleware runs it unlocked; unless a
-- task with that ID exists, whose index this must not overwrite (asynq
-- refuses the enqueue that follows).
--
-- KEYS[1]  index key of the ID
-- KEYS[2]  asynq record of the ID's task
-- ARGV[1]  the mark's lifetime, integer milliseconds
--
-- Reply: 1 marked; 0 the ID's task exists: untouched
if call('EXISTS', KEYS[2]) == 1 then
  return 0
end
call('SET', KEYS[1], '-', 'PX', ARGV[1])
return 1
