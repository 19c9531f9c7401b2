-- Leases (release.lua settles them). A batch writes all its leases with one HSET and
-- one PEXPIRE per lease hash: commands are the expensive part of a script.

-- lease hash key -> {field, value, ..., keep = ms the hash must live}; one table, not
-- two: the acquire script's main chunk is at Lua's limit of 200 locals.
local lease_writes = {}

local function add_lease(i, lease_key, field, cost, ttl_ms, keep_ms, weight, input, output)
  local expiry_us = now + ttl_ms * 1000
  local expiry = string.format('%.0f', expiry_us)
  local writes = lease_writes[lease_key]
  if writes == nil then
    writes = {keep = 0}
    lease_writes[lease_key] = writes
  end
  writes[#writes + 1] = field
  writes[#writes + 1] = expiry .. '|' .. num(cost) .. '|' .. weight .. '|' .. input .. '|' .. output
  writes.keep = math.max(writes.keep, tonumber(keep_ms))
  lease_started(i, tonumber(input) + tonumber(output), expiry_us)
  if pool_gated then
    prefill_started(i, input)
  end
  return expiry
end

local function save_leases()
  for key, writes in pairs(lease_writes) do
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIRE', key, writes.keep)
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
