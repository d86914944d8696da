-- What the Responses store's scripts share (gateway.state.store). Every key of the store is under one hash tag (B, as
-- ARGV[1]: '{prefix}:{responses}'), so that one script keeps a record, its key's index and the store's totals at once
-- (one Redis Cluster slot). B..':record:'..id: a record (a hash: data, previous, o: its owner, the gateway key's
-- name, '' without keys); B..':index:'..o: o's records (a sorted set of ids, each scored by when it was last put or
-- continued, ms of Redis's clock); B..':sizes:'..o: their sizes (a hash: bytes, the record's JSON and the per-record
-- overhead); B..':held': the counts (a hash: n and b in all, n:o and b:o of each owner); B..':owners': each owner's
-- share of the store (the larger of its fraction of the records and of the bytes), the largest first to give room.
-- Only the records have a TTL: under a volatile-* maxmemory policy Redis never evicts what bounds them.
-- ARGV[2], ARGV[3]: the records and the bytes the whole store may hold.
local B, MAX_N, MAX_B = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local seen = {}
local function want(key, kind)  -- a key that holds something else (garbage, another program's) is dropped
  if not seen[key] then
    local t = redis.call('TYPE', key).ok
    if t ~= kind and t ~= 'none' then redis.call('DEL', key) end
    seen[key] = true
  end
  return key
end
local HELD, OWNERS = want(B .. ':held', 'hash'), want(B .. ':owners', 'zset')
local function index(o) return want(B .. ':index:' .. o, 'zset') end
local function sizes(o) return want(B .. ':sizes:' .. o, 'hash') end
local function held(o)  -- the records and the bytes held in all, then of o
  local v = redis.call('HMGET', HELD, 'n', 'b', 'n:' .. o, 'b:' .. o)
  for i = 1, 4 do v[i] = math.max(0, tonumber(v[i]) or 0) end
  return v[1], v[2], v[3], v[4]
end
local function bump(field, by)
  local v = redis.pcall('HINCRBY', HELD, field, by)
  if type(v) ~= 'number' then  -- not a count (garbage): counts from nothing
    v = math.max(0, by)
    redis.call('HSET', HELD, field, v)
  end
  if v <= 0 then redis.call('HDEL', HELD, field) end
  return math.max(0, v)
end
local function account(o, n, b)  -- o holds n more records of b more bytes (fewer: negative)
  bump('n', n)
  bump('b', b)
  local on, ob = bump('n:' .. o, n), bump('b:' .. o, b)
  if on > 0 then
    redis.call('ZADD', OWNERS, math.max(on / MAX_N, ob / MAX_B), o)
  else
    redis.call('HDEL', HELD, 'b:' .. o)
    redis.call('ZREM', OWNERS, o)
  end
end
local function forget(o, id)  -- id leaves o's count (its record stays: the caller deletes or rewrites it)
  local size = tonumber(redis.call('HGET', sizes(o), id)) or 0
  redis.call('HDEL', sizes(o), id)
  if redis.call('ZREM', index(o), id) == 1 then account(o, -1, -size) end
end
local function evict(o, id)  -- id leaves o's count and Redis (its record, if it is still o's)
  forget(o, id)
  local rec = want(B .. ':record:' .. id, 'hash')
  if redis.call('HGET', rec, 'o') == o then redis.call('DEL', rec) end
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function after_newest(o, now)  -- a score above every other in o's index: puts within one ms keep their order
  local top = redis.call('ZREVRANGE', index(o), 0, 0, 'WITHSCORES')[2]  -- (ties would sort by id, not by time)
  if top and tonumber(top) >= now then return tonumber(top) + 0.001 end
  return now
end
local function prune(o, now, ttl)  -- o's records that expired leave its count; how many did
  local old = redis.call('ZRANGEBYSCORE', index(o), '-inf', '(' .. string.format('%d', now - ttl), 'LIMIT', 0, 1000)
  for _, id in ipairs(old) do evict(o, id) end
  return #old
end
