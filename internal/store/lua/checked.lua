-- checked: replaces the prelude's `call` in tests, so that a script that
-- reads or writes a key it was not given fails loudly instead of working
-- on one node and splitting a queue's keys during a Redis Cluster slot
-- migration.
do
  local given = {}
  for _, k in ipairs(KEYS) do
    given[k] = true
  end
  local keyless = {TIME = true}
  local allkeys = {DEL = true, EXISTS = true}
  local raw = redis.call
  call = function(cmd, ...)
    local c = string.upper(cmd)
    if not keyless[c] then
      local args = {...}
      local n = 1
      if allkeys[c] then
        n = #args
      end
      for i = 1, n do
        if not given[args[i]] then
          error('dedup: script used key ' .. tostring(args[i]) .. ' (' .. c .. ') not given in KEYS')
        end
      end
    end
    return raw(cmd, ...)
  end
end
