-- Leases (release.lua settles them). A batch writes all its leases with one HSET and
-- one PEXPIRE per lease hash: commands are the expensive part of a script.

local lease_writes = {}  -- lease hash key -> {field, value, ...}
local lease_keep = {}    -- lease hash key -> ms it must live

local function add_lease(i, lease_key, field, cost, ttl_ms, keep_ms, weight, input, output)
  local expiry_us = now + ttl_ms * 1000
  local expiry = string.format('%.0f', expiry_us)
  local writes = lease_writes[lease_key]
  if writes == nil then
    writes = {}
    lease_writes[lease_key] = writes
  end
  writes[#writes + 1] = field
  writes[#writes + 1] = expiry .. '|' .. num(cost) .. '|' .. weight .. '|' .. input .. '|' .. output
  lease_keep[lease_key] = math.max(lease_keep[lease_key] or 0, tonumber(keep_ms))
  lease_started(i, tonumber(input) + tonumber(output), expiry_us)
  if pool_gated then
    prefill_started(i, input)
  end
  return expiry
end

local function save_leases()
  for key, writes in pairs(lease_writes) do
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIRE', key, lease_keep[key])
  end
end

-- Frees a request id (its key, as acquire wrote it: "<pool>:<field>|...") if it still
-- names the lease or waiter `field`, so that the retry of a request that ended
-- unserved, or failed on its way, is a new request rather than a reuse.
local function free_request_id(request_key, field)
  local named = redis.call('GET', request_key)
  if named and string.find(named, ':' .. field .. '|', 1, true) then
    redis.call('DEL', request_key)
  end
end
