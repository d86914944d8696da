-- A: per kind (requests, tokens) the reported remaining ('' none), ms to its reset, what the report leaves out ('':
-- unknown); then the channel, this replica, the upstream, the attempt's in-flight member (''), its mark in sent
-- tokens (''). The upstream counted what had reached it when it answered. Left out, as far as the gateway can tell:
-- what was reserved after this attempt (the sent totals past its mark), and what was in flight when it was reserved
-- (it may have reached the upstream after this attempt; counting it twice is the safe error, and its own report
-- corrects it): the attempt passes the latter, and its mark. A report without a mark (its attempt reserved nothing:
-- no estimate yet, or Redis was away) only starts an estimate where there is none. Publishes the estimates when one of
-- them began or more than doubled (a new window, a refill: replicas that spilled over on a short estimate learn it;
-- a fall they learn from their own admissions, and a small rise does not move a spill decision). Returns the
-- estimates set ('' for a kind left as it was).
land(A[10])
local out, ms, rose = {'', ''}, {'', ''}, false
for i = 1, 2 do
  local reported, ahead = tonumber(A[3 * i - 2]), A[3 * i]
  local old = num(K[i])
  if reported and (ahead ~= '' or not old) then
    local since = 0
    if ahead ~= '' then
      local mark = (i == 1) and A[11] or A[12]
      since = math.max(0, (num(K[i + 2]) or 0) - tonumber(mark)) + tonumber(ahead)
    end
    local value = reported - since
    redis.call('SET', K[i], tostring(value), 'PX', A[3 * i - 1])
    if (not old) or old * 2 < value then rose = true end
    out[i], ms[i] = tostring(value), A[3 * i - 1]
  end
end
if rose then
  redis.call('PUBLISH', A[7], cjson.encode({r = A[8], u = A[9], e = 'quota', q = out, ms = ms}))
end
return out
