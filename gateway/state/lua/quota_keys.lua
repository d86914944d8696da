-- the keys of one upstream's quota scripts under the one key they declare (gateway.state.scripts.QUOTA_KEYS),
-- and their arguments, joined by the unit separator
local K, A = {}, {}
for i, suffix in ipairs({':quota:requests', ':quota:tokens', ':sent:requests', ':sent:tokens', ':inflight', ':inflight:n'}) do
  K[i] = KEYS[1] .. suffix
end
for v in string.gmatch(ARGV[1] .. '\31', '([^\31]*)\31') do A[#A + 1] = v end
