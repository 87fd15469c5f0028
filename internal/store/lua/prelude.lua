-- prelude: goes first in every script. `call` is redis.call; run with
-- checked keys (tests, see scripts.go) it refuses any key not in KEYS.
-- K maps the role letters of ARGV[1] to KEYS (see roles.go): roles(from)
-- reads the letters from position from + 1 on, the i-th naming KEYS[i].
-- The first key is always the lock (role L).
local call = redis.call
local K = {L = KEYS[1]}
local function roles(from)
  local r = ARGV[1]
  for i = 2, #KEYS do
    K[string.sub(r, from + i, from + i)] = KEYS[i]
  end
end
