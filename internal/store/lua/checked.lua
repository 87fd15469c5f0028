-- checked: replaces the prelude's `call` in tests, so that a script using a key
-- not given in KEYS fails loudly instead of splitting a queue's keys during a
-- Redis Cluster slot migration. TIME and PUBLISH have no key; DEL and EXISTS, only keys.
do
  local given, raw = {}, redis.call
  for _, k in ipairs(KEYS) do given[k] = true end
  call = function(cmd, ...)
    local c, args = string.upper(cmd), {...}
    local n = ((c == 'TIME' or c == 'PUBLISH') and 0) or ((c == 'DEL' or c == 'EXISTS') and #args) or 1
    for i = 1, n do
      if not given[args[i]] then error('dedup: script used key ' .. tostring(args[i]) .. ' (' .. c .. ') not given in KEYS') end
    end
    return raw(cmd, ...)
  end
end
