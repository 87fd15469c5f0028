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

-- lapsed reports whether asynq's lease (in its lease set lease, given with
-- the record key rec of an active task) on that task has lapsed by now
-- (unix seconds): its worker died. An attempt that started free runs
-- without a token, so asynq's lease is the only sign of its worker's death.
local function lapsed(lease, rec, now)
  if not lease then return false end
  -- (rec is asynq's key prefix, 't:' and the ID; lease the prefix and 'lease')
  local exp = call('ZSCORE', lease, string.sub(rec, #lease - 2))
  return exp and tonumber(exp) < now or false
end
