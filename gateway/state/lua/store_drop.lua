-- Delete one record of the Responses store for its owner (gateway.state.store; the keys and the first arguments:
-- store.lua). KEYS[1]: the record. ARGV: 4 the caller (a gateway key's name, '' without keys), 5 the id. Another
-- owner's record stays. Reply: 1 deleted, 0 not there (or another owner's).
local o, id = ARGV[4], ARGV[5]
local rec = want(KEYS[1], 'hash')
local owner = redis.call('HGET', rec, 'o')
if owner and owner ~= o then return 0 end
forget(o, id)
return redis.call('DEL', rec)
