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

-- holder_of splits a lock's value (false: no lock; value.go owns the
-- grammar): the task that holds the key, the kind of hold ('' held by its
-- task; 'w' taken at `at`, unix seconds, before its task was stored; 'a'
-- taken as its task started; 'c' cooling after its success; 'x' a
-- Scheduler firing's, held until it expires), and at.
local function holder_of(v)
  if not v then return nil, '' end
  local i = string.byte(v, 1) == 126 and string.find(v, ':', 2, true)
  if not i then return v, '' end
  return string.sub(v, i + 1), string.sub(v, 2, 2), tonumber(string.sub(v, 3, i - 1)) or 0
end
