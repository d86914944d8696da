-- KEYS: the rest hash. ARGV: field (cooldown | open | closed), until (wall seconds), exhausted (0|1), channel, message.
if ARGV[1] == 'closed' then
  safe('HDEL', KEYS[1], 'open')
else
  if tonumber(ARGV[2]) > (tonumber(safe('HGET', KEYS[1], ARGV[1])) or 0) then
    safe('HSET', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[1] == 'cooldown' then safe('HSET', KEYS[1], 'exhausted', ARGV[3]) end
  end
  local latest = math.max(tonumber(safe('HGET', KEYS[1], 'cooldown')) or 0,
                          tonumber(safe('HGET', KEYS[1], 'open')) or 0)
  redis.call('PEXPIREAT', KEYS[1], math.ceil(latest * 1000))
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
