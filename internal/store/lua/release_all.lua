-- release_all (releases.go): release together the locks tasks took as they started
-- ('~a') and that then succeeded, each if it still holds that attempt's value; one
-- with a mode record beside it is left for a settle call. KEYS[2i-1] the i-th lock,
-- KEYS[2i] its mode record; ARGV[i] its value. Reply: per lock, 1 released, 2 left, 0 not its.
local out = {}
for i, v in ipairs(ARGV) do
  out[i] = call('GET', KEYS[2 * i - 1]) ~= v and 0 or call('EXISTS', KEYS[2 * i]) == 1 and 2 or call('DEL', KEYS[2 * i - 1])
end
return out
