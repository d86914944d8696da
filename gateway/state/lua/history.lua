-- ARGV: key prefix, response id, ms to live again (0: a look, no refresh), most links. Returns the records' data from
-- the newest back to the first turn, or nil when a link is missing (expired or deleted).
local out, id = {}, ARGV[2]
while id and id ~= '' do
  local key = ARGV[1] .. ':response:' .. id
  local rec = redis.call('HMGET', key, 'data', 'previous')
  if not rec[1] or #out >= tonumber(ARGV[4]) then return false end
  out[#out + 1] = rec[1]
  if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', key, ARGV[3]) end
  id = rec[2]
end
return out
