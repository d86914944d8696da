local function land(member)
  if member ~= '' and safe('ZREM', K[5], member) == 1 then
    safe('HINCRBY', K[6], 'r', -1)
    safe('HINCRBY', K[6], 't', -(tonumber(string.match(member, ':(%d+)$')) or 0))
  end
end
