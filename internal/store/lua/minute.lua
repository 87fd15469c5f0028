-- minute: add one type's counts of a flush to the hash of the current
-- minute and set its lifetime in one step, so that the hash never lives
-- without one (Keys.StatsMinute). Plain Lua, no prelude: it is sent with
-- EVAL inside the flusher's pipeline, whose stats keys span nodes.
--
-- KEYS[1]  the minute's hash
-- ARGV[1]  its lifetime, integer milliseconds
-- ARGV[2i], ARGV[2i+1]  an event name and its count since the last flush
--
-- Reply: 1
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
