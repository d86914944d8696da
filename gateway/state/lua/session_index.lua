-- The sessions one gateway key holds in Redis (gateway.state.sessions), so that one key's runs are bounded there as in
-- a process's table. KEYS[1]: the key's index (a sorted set of session table keys, scored by their last step, wall
-- seconds). ARGV: 1 the session's table key, 2 now, 3 the sessions the key may hold, 4 seconds a session lives after
-- its last step, 5 ms the index lives. Reply: the table keys that left the index (its least recently used over the
-- bound), whose records the caller deletes (they sit in other Cluster slots: one key each, never in this script).
local idx = KEYS[1]
if redis.call('TYPE', idx).ok ~= 'zset' and redis.call('EXISTS', idx) == 1 then redis.call('DEL', idx) end
local now = tonumber(ARGV[2])
redis.call('ZADD', idx, now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', idx, '-inf', '(' .. (now - tonumber(ARGV[4])))  -- idle: their records expired
redis.call('PEXPIRE', idx, ARGV[5])
local over = redis.call('ZCARD', idx) - tonumber(ARGV[3])
if over <= 0 then return {} end
local gone = {}
for i, v in ipairs(redis.call('ZPOPMIN', idx, over)) do
  if i % 2 == 1 then gone[#gone + 1] = v end
end
return gone
