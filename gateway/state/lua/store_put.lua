-- Keep one record of the Responses store (gateway.state.store; the keys and the first arguments: store.lua). KEYS[1]:
-- the record. ARGV: 4 its owner, 5 its id, 6 its data, 7 the id it continues (''), 8 its size, 9 ms to live, 10 the
-- records and 11 the bytes its owner may hold (its share; without keys, the whole store's). The owner's expired
-- records leave its count; past its share its own oldest go; past the whole store's bounds, the oldest of the owner
-- holding the largest share (a key holding less than another never loses a record to it). Reply: the ids that left
-- Redis, or false (larger than its owner may hold: not kept, nothing dropped for it).
local o, id, size, ttl = ARGV[4], ARGV[5], tonumber(ARGV[8]), tonumber(ARGV[9])
local most_n, most_b = tonumber(ARGV[10]), tonumber(ARGV[11])
if size > most_b or size > MAX_B then return false end
local now, rec = now_ms(), want(KEYS[1], 'hash')
local was = redis.call('HGET', rec, 'o')
if was then forget(was, id) end  -- put again (an id an upstream gave twice, maybe to another key): counted once
redis.call('DEL', rec)
redis.call('HSET', rec, 'data', ARGV[6], 'previous', ARGV[7], 'o', o)
redis.call('PEXPIRE', rec, ttl)
redis.call('ZADD', index(o), string.format('%.3f', after_newest(o, now)), id)
redis.call('HSET', sizes(o), id, string.format('%d', size))
account(o, 1, size)
prune(o, now, ttl)
local gone = {}
while true do
  local _, _, n, b = held(o)
  if n <= most_n and b <= most_b then break end
  local two = redis.call('ZRANGE', index(o), 0, 1)  -- its oldest, never the one just put (alone, it fits)
  local oldest = two[1]
  if oldest == id then oldest = two[2] end
  if not oldest then break end
  evict(o, oldest)
  gone[#gone + 1] = oldest
end
for _ = 1, 10000 do  -- bounded: each turn drops one record, or the count of an owner that holds none
  local n, b = held('')
  if n <= MAX_N and b <= MAX_B then break end
  local top = redis.call('ZREVRANGE', OWNERS, 0, 0)[1]
  if not top then  -- counted, yet no owner: the totals are wrong
    redis.call('HDEL', HELD, 'n', 'b')
    break
  end
  if prune(top, now, ttl) == 0 then
    local oldest = redis.call('ZRANGE', index(top), 0, 0)[1]
    if oldest then
      evict(top, oldest)
      gone[#gone + 1] = oldest
    else  -- an owner counted with nothing indexed: its count goes
      local _, _, tn, tb = held(top)
      account(top, -tn, -tb)
    end
  end
end
return gone
