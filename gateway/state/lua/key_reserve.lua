-- KEYS: one counter per limit of a gateway key (gateway.tenancy.keys: level, dimension, window id), then the
-- reservation's hold and its tombstone (all under the key's hash tag). ARGV: per counter its limit, the amount to add,
-- its ms to live and its floor; then the hold's ms to live. A counter Redis does not hold (it restarted without its
-- data, or evicted it) starts from its floor: the last value the calling replica saw of it, never from nothing. All or
-- nothing: {1, the counters' new values...} when every limit leaves room (the amounts added, and kept in the hold for
-- its settlement), {0, the first that does not, the counters' values...} and nothing added, or {2}: the reservation was
-- cancelled before it arrived (a replica that gave up waiting for it settled it locally; see _KEY_SETTLE).
local n = #KEYS - 2
if redis.call('EXISTS', KEYS[n + 2]) == 1 then return {2} end
local v = {}
for i = 1, n do
  v[i] = num(KEYS[i]) or tonumber(ARGV[4 * i]) or 0
end
for i = 1, n do
  if v[i] + tonumber(ARGV[4 * i - 2]) > tonumber(ARGV[4 * i - 3]) then
    local out = {0, i}
    for k = 1, n do out[k + 2] = tostring(v[k]) end
    return out
  end
end
local held, out = {}, {1}
for i = 1, n do
  v[i] = v[i] + tonumber(ARGV[4 * i - 2])
  redis.call('DEL', KEYS[i])  -- garbage ('1e999', 'abc') or the old value: the new one is set whole
  redis.call('SET', KEYS[i], tostring(v[i]), 'PX', ARGV[4 * i - 1])
  held[i] = ARGV[4 * i - 2]
  out[i + 1] = tostring(v[i])
end
redis.call('SET', KEYS[n + 1], table.concat(held, ','), 'PX', ARGV[4 * n + 1])
return out
