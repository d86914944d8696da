-- A conversation's chain in the Responses store (gateway.state.store; its keys: store.lua). KEYS[1]: the newest link's
-- record. ARGV: 1 B, the store's keys' start, 2 the caller (a gateway key's name, '' without keys), 3 the newest link's
-- id, 4 ms to live again (0: a look, no refresh), 5 most links. Returns the records' data from the newest back to the
-- first turn, or false when a link is missing (expired or deleted) or another owner's (then none is refreshed). A
-- refresh makes every link live another ttl and the most recently used of its owner's index (store.lua).
local out, ids, id = {}, {}, ARGV[3]
while id and id ~= '' do
  local rec = redis.pcall('HMGET', ARGV[1] .. ':record:' .. id, 'data', 'previous', 'o')
  if rec.err or not rec[1] or rec[3] ~= ARGV[2] or #out >= tonumber(ARGV[5]) then return false end
  out[#out + 1] = rec[1]
  ids[#ids + 1] = id
  id = rec[2]
end
if tonumber(ARGV[4]) > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local idx = ARGV[1] .. ':index:' .. ARGV[2]
  local top = redis.pcall('ZREVRANGE', idx, 0, 0, 'WITHSCORES')
  if type(top) == 'table' and top[2] and tonumber(top[2]) >= now then now = tonumber(top[2]) + 0.001 end
  for i, link in ipairs(ids) do  -- the newest link scored highest: the index stays in the order they were made
    redis.call('PEXPIRE', ARGV[1] .. ':record:' .. link, ARGV[4])
    redis.pcall('ZADD', idx, 'XX', string.format('%.3f', now + (#ids - i) * 0.001), link)
  end
end
return out
