-- Shared by acquire.lua, release.lua and tokens.lua: qosd prepends this file to each
-- of them when it loads them (a script cannot import another). Mirrors
-- qosd/bucket.py: refill on read, full when absent, expire once full again.
--
-- Bucket string: "tokens|updated_us", times from Redis TIME in microseconds.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local buckets = {}  -- key -> {tokens, rate, burst, changed, updated}; read once per call

-- Floats travel as strings (Redis would truncate a Lua number to an integer), with
-- all 17 significant digits: tostring() keeps only 14.
local function num(x)
  return string.format('%.17g', x)
end

-- The bucket at `key`, refilled up to now; read from Redis at most once per call.
local function bucket(key, rate, burst)
  local b = buckets[key]
  if b == nil then
    local tokens = burst
    local updated = now
    local state = redis.call('GET', key)
    if state then
      local stored, stamp = string.match(state, '^([^|]*)|(.*)$')
      tokens = tonumber(stored)
      updated = tonumber(stamp)
      if now > updated then
        tokens = math.min(burst, tokens + (now - updated) * rate / 1000000)
        updated = now
      end
    end
    b = {tokens, rate, burst, false, updated}
    buckets[key] = b
  end
  return b
end

-- Writes every changed bucket once, set to expire 1 s after it would be full again
-- (an absent bucket reads as full, so expiry loses nothing). The update time never
-- moves back: after a failover to a primary whose clock is behind, the skew is not
-- refilled twice.
local function save_buckets()
  for key, b in pairs(buckets) do
    if b[4] then
      local full_in_ms = 86400000
      if b[2] > 0 then
        full_in_ms = math.ceil(math.max(0, b[3] - b[1]) * 1000 / b[2])
      end
      redis.call('SET', key, num(b[1]) .. '|' .. string.format('%.0f', b[5]),
        'PX', full_in_ms + 1000)
    end
  end
end

