-- A: tokens needed (a whole number), requests kept, tokens kept, ms the totals live, the reservation's end (wall
-- seconds), now (wall). Returns {admitted 1|0, refused kind index 1|2 (0), remaining requests ('' unknown), its ms to
-- reset, remaining tokens, its ms, sent requests, sent tokens, requests in flight before it, tokens in flight before
-- it} (floats as strings: a Lua number would reach Redis' reply as an integer).
for _, member in ipairs(safe('ZRANGEBYSCORE', K[5], '-inf', A[6])) do land(member) end
local need = {1, tonumber(A[1])}
local keep = {tonumber(A[2]), tonumber(A[3])}
local rem = {num(K[1]), num(K[2])}
for i = 1, 2 do
  if rem[i] and rem[i] - need[i] < keep[i] then
    return {0, i, tostring(rem[1] or ''), redis.call('PTTL', K[1]), tostring(rem[2] or ''), redis.call('PTTL', K[2]),
            '', '', '', ''}
  end
end
for i = 1, 2 do
  if rem[i] then rem[i] = safe('INCRBYFLOAT', K[i], -need[i]) end
end
local s1 = safe('INCRBY', K[3], need[1])
local s2 = safe('INCRBY', K[4], A[1])
local ahead = safe('HMGET', K[6], 'r', 't')
safe('ZADD', K[5], A[5], string.format('%d', s2) .. ':' .. A[1])
safe('HINCRBY', K[6], 'r', 1)
safe('HINCRBY', K[6], 't', A[1])
for k = 3, 6 do redis.call('PEXPIRE', K[k], A[4]) end
return {1, 0, rem[1] or '', redis.call('PTTL', K[1]), rem[2] or '', redis.call('PTTL', K[2]), s1, s2,
        ahead[1] or '0', ahead[2] or '0'}
