-- Count the active leases in some lease hashes of one pool (an admin query).
-- KEYS: lease hashes. Returns the number of fields neither settled nor expired.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local active = 0
for i = 1, #KEYS do
  local values = redis.call('HVALS', KEYS[i])
  for j = 1, #values do
    local expiry = string.match(values[j], '^(%d+)|')
    if expiry and tonumber(expiry) > now then
      active = active + 1
    end
  end
end
return active
