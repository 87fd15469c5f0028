-- release_all (releases.go): release together the locks tasks took as they started ('~a') and that
-- then succeeded, each if still its task's; one with a mode record beside it is
-- left for a settle call. KEYS[2i-1] the i-th lock, KEYS[2i] its mode record;
-- ARGV[i] its task. Reply: the indexes of the locks left.
local left = {}
for i, id in ipairs(ARGV) do
  local holder, kind = holder_of(call('GET', KEYS[2 * i - 1]))
  if holder == id and kind == 'a' and call('EXISTS', KEYS[2 * i]) == 1 then left[#left + 1] = i
  elseif holder == id and kind == 'a' then call('DEL', KEYS[2 * i - 1]) end
end
return left
