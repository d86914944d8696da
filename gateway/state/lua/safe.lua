-- Every script starts with SAFE: a key that holds something else than what the gateway keeps there (a string where a
-- count belongs, a hash where a string does: another program's, or garbage) is dropped and counts from nothing, so
-- that no stray value makes a script fail for every request (which the gateway would take for Redis being away).
local function safe(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    redis.call('DEL', key)
    r = redis.call(cmd, key, ...)
  end
  return r
end
local function num(key)
  local v = tonumber(safe('GET', key))
  if v and (v ~= v or v == math.huge or v == -math.huge) then return nil end  -- 'nan', '1e999': not a count
  return v
end
