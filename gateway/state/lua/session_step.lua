-- One finished step of an agent session (gateway.state.sessions). KEYS[1]: the session's hash, KEYS[2]: its list of
-- moves (newest first), KEYS[3]: its holds (session_begin.lua). ARGV: 1 ms to live, 2 now (wall seconds), 3 owner,
-- 4 id, 5 source, 6 started (wall seconds, kept from the first step), 7 upstream, 8 tier, 9 seconds, 10 USD, 11 prompt
-- tokens, 12 cached tokens, 13 output tokens, 14 what the fast tier saved ('' off the fast tier, 'u' unpriced, else
-- 'central|low|high|samples', seconds; the fewest samples are kept), 15 the move ('' or 'at|from|to|reason'), 16 moves
-- kept, 17 the step's hold ('' or its member): released as its step is added.
-- Counters are added, never overwritten, so that two replicas serving steps of one session at once lose neither.
local h = KEYS[1]
if redis.call('TYPE', h).ok ~= 'hash' and redis.call('EXISTS', h) == 1 then redis.call('DEL', h) end
if ARGV[17] ~= '' and redis.call('TYPE', KEYS[3]).ok == 'zset' then redis.call('ZREM', KEYS[3], ARGV[17]) end
redis.call('HSETNX', h, 'o', ARGV[3])
redis.call('HSETNX', h, 'i', ARGV[4])
redis.call('HSETNX', h, 'src', ARGV[5])
redis.call('HSETNX', h, 's0', ARGV[6])
local function add(field, by) if redis.pcall('HINCRBYFLOAT', h, field, by).err then redis.call('HSET', h, field, by) end end
add('n', 1)
add('u', ARGV[10])
add('pi', ARGV[11])
add('pc', ARGV[12])
add('po', ARGV[13])
add('tt:' .. ARGV[8], ARGV[9])
add('tu:' .. ARGV[7], ARGV[9])
add('st:' .. ARGV[8], 1)
if ARGV[14] == 'u' then
  add('svu', 1)
elseif ARGV[14] ~= '' then
  local central, low, high, samples = string.match(ARGV[14], '^([^|]+)|([^|]+)|([^|]+)|(%d+)$')
  if central and tonumber(central) and tonumber(low) and tonumber(high) then
    add('sv', central)
    add('svl', low)
    add('svh', high)
    local fewest = tonumber(redis.call('HGET', h, 'svm'))
    if not fewest or tonumber(samples) < fewest then redis.call('HSET', h, 'svm', samples) end
    add('svn', 1)
  end
end
redis.call('HSET', h, 't', ARGV[2], 'lu', ARGV[7], 'w:' .. ARGV[7], ARGV[2] .. '|' .. ARGV[11])
redis.call('PEXPIRE', h, ARGV[1])
if ARGV[15] ~= '' then
  add('mv', 1)
  if redis.call('TYPE', KEYS[2]).ok ~= 'list' and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DEL', KEYS[2]) end
  if tonumber(ARGV[16]) > 0 then
    redis.call('LPUSH', KEYS[2], ARGV[15])
    redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[16]) - 1)
    redis.call('PEXPIRE', KEYS[2], ARGV[1])
  end
end
return 1
