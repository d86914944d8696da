-- One step's admission to an agent session (gateway.state.sessions): the run's budgets checked against its steps
-- finished and in flight, and the step's hold added, in one script, so that steps admitted at once by any replicas
-- are all counted. KEYS[1]: the session's hash, KEYS[2]: its holds (a sorted set of its steps in flight, members
-- '<hold id>|<usd>', scored by when each expires: wall seconds). ARGV: 1 ms the hash lives, 2 now (wall seconds),
-- 3 when this step's hold expires, 4 its member, 5 the USD it reserves, 6 max_steps ('': none), 7 max_usd ('': not
-- checked), 8 owner, 9 id, 10 source, 11 started (wall seconds), 12 ms the holds live.
-- Holds expired by now are dropped first: a replica that died mid-step leaks none. A step is admitted while
-- steps + held < max_steps and usd + reserved < max_usd. Reply: {1 admitted or 0 refused, the budget refused ('' when
-- admitted), steps, held, usd, reserved} (held and reserved: this step's included when admitted; numbers as strings).
-- The run's hash is made once (HSETNX of its identity), by its first step's admission.
local h, z = KEYS[1], KEYS[2]
if redis.call('TYPE', h).ok ~= 'hash' and redis.call('EXISTS', h) == 1 then redis.call('DEL', h) end
if redis.call('TYPE', z).ok ~= 'zset' and redis.call('EXISTS', z) == 1 then redis.call('DEL', z) end
redis.call('ZREMRANGEBYSCORE', z, '-inf', ARGV[2])
local function count(field)
  local v = tonumber(redis.call('HGET', h, field))
  if not v or v ~= v or v == math.huge or v == -math.huge then return 0 end  -- garbage counts from nothing
  return v
end
local steps, usd, held, reserved = count('n'), count('u'), redis.call('ZCARD', z), 0
if ARGV[7] ~= '' then
  for _, m in ipairs(redis.call('ZRANGE', z, 0, -1)) do
    local v = tonumber(string.match(m, '|([^|]*)$'))
    if v and v == v and v ~= math.huge then reserved = reserved + v end
  end
end
local refused = ''
if ARGV[6] ~= '' and steps + held >= tonumber(ARGV[6]) then
  refused = 'max_steps'
elseif ARGV[7] ~= '' and usd + reserved >= tonumber(ARGV[7]) then
  refused = 'max_usd'
end
if refused ~= '' then
  return {0, refused, tostring(steps), tostring(held), tostring(usd), tostring(reserved)}
end
redis.call('HSETNX', h, 'o', ARGV[8])
redis.call('HSETNX', h, 'i', ARGV[9])
redis.call('HSETNX', h, 'src', ARGV[10])
redis.call('HSETNX', h, 's0', ARGV[11])
redis.call('PEXPIRE', h, ARGV[1])
redis.call('ZADD', z, ARGV[3], ARGV[4])
redis.call('PEXPIRE', z, ARGV[12])
return {1, '', tostring(steps), tostring(held + 1), tostring(usd), tostring(reserved + tonumber(ARGV[5]))}
