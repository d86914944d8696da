-- KEYS as _KEY_RESERVE. ARGV: per counter what the request used, its floor and its ms to live; then the tombstone's ms
-- to live, and '1' when the reservation was counted by the replica itself (Redis did not answer it in time, or was
-- away), else '0'. With its hold there: each counter takes what was used instead of what was held (a counter whose
-- window is gone is not made again). Without: the reservation has not arrived (or its hold expired): a tombstone makes
-- it void if it still comes, so that a reservation is counted once whatever the order; and a reservation the replica
-- counted itself is added now (from the counter's floor if Redis lost it), so that what was spent while Redis was away
-- is not lost when it returns.
local n = #KEYS - 2
local held = redis.pcall('GET', KEYS[n + 1])
if type(held) ~= 'string' then
  redis.call('SET', KEYS[n + 2], '1', 'PX', ARGV[3 * n + 1])
  if ARGV[3 * n + 2] == '1' then
    for i = 1, n do
      local v = (num(KEYS[i]) or tonumber(ARGV[3 * i - 1]) or 0) + (tonumber(ARGV[3 * i - 2]) or 0)
      redis.call('DEL', KEYS[i])
      redis.call('SET', KEYS[i], tostring(v), 'PX', ARGV[3 * i])
    end
  end
  return 0
end
local i = 1
for amount in string.gmatch(held, '([^,]+)') do
  if i <= n and num(KEYS[i]) then  -- gone with its window (or garbage): not made again
    safe('INCRBYFLOAT', KEYS[i], (tonumber(ARGV[3 * i - 2]) or 0) - (tonumber(amount) or 0))
  end
  i = i + 1
end
redis.call('DEL', KEYS[n + 1])
return 1
