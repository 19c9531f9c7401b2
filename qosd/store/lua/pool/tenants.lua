-- Plain token buckets for tenant ceilings read once
-- per script call and written back by save_tenants().
local tenants = {}  -- key -> {tokens, updated, rate, burst, changed}

local function tenant_load(key, rate, burst)
  local bucket = tenants[key]
  if bucket == nil then
    bucket = {burst, now, rate, burst, false}
    local value = redis.call('GET', key)
    if value then
      local stored, stamp = string.match(value, '^([^|]*)|(.*)$')
      bucket[1], bucket[2] = tonumber(stored), tonumber(stamp)
      if now > bucket[2] then
        bucket[1] = math.min(burst, bucket[1] + (now - bucket[2]) * rate / 1000000)
        bucket[2] = now
      end
    end
    tenants[key] = bucket
  end
  return bucket
end

local function tenant_wait_ms(bucket, cost)
  if bucket[3] <= 0 then
    return 1
  end
  return math.max(1, math.ceil((math.min(cost, bucket[4]) - bucket[1]) * 1000 / bucket[3]))
end

local function save_tenants()
  for key, b in pairs(tenants) do
    if b[5] then
      local full_in_ms = 86400000
      if b[3] > 0 then
        full_in_ms = math.ceil(math.max(0, b[4] - b[1]) * 1000 / b[3])
      end
      redis.call('SET', key, num(b[1]) .. '|' .. string.format('%.0f', b[2]),
        'PX', full_in_ms + 1000)
    end
  end
end
