-- Take `cost` tokens from one (pool, class) bucket and create a lease, atomically.
-- Mirrors qosd/bucket.py (take, refilled) and qosd/store/embedded.py (acquire).
--
-- KEYS[1] bucket hash {t = tokens, u = last update, microseconds of Redis TIME}
-- KEYS[2] lease hash for ARGV[5]
-- KEYS[3] active-lease sorted set (member lease id, score expiry in microseconds)
-- KEYS[4] request-id key (optional): "lease_id|charged|expiry_us", for replays
-- ARGV: cost, rate, burst, max_cost, lease_id, ttl_ms, forget_ms (ttl + tombstone),
--       weight, input_tokens, output_tokens, tenant
-- Returns {admitted, reason, lease_id, charged, remaining, retry_after_ms, ttl_ms, replayed}
-- with floats as strings (Redis truncates Lua numbers to integers).
local cost = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local max_cost = tonumber(ARGV[4])
local ttl_ms = tonumber(ARGV[6])

local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])

local function refilled()
  local state = redis.call('HMGET', KEYS[1], 't', 'u')
  local tokens = tonumber(state[1])
  if tokens == nil then
    return burst
  end
  local elapsed = now - tonumber(state[2])
  if elapsed > 0 then
    tokens = math.min(burst, tokens + elapsed * rate / 1000000)
  end
  return tokens
end

if KEYS[4] then
  local prior = redis.call('GET', KEYS[4])
  if prior then
    local prior_id, prior_charged, prior_expiry = string.match(prior, '^(.*)|([^|]*)|([^|]*)$')
    local left_ms = math.floor((tonumber(prior_expiry) - now) / 1000)
    if left_ms > 0 then
      return {1, 0, prior_id, prior_charged, tostring(refilled()), 0, left_ms, 1}
    end
  end
end

local tokens = refilled()
if cost > max_cost then
  return {0, 2, '', tostring(cost), tostring(tokens), 0, 0, 0}
end
local needed = math.min(cost, burst)
if tokens < needed then
  local wait_ms = 0
  if rate > 0 then
    wait_ms = math.ceil((needed - tokens) * 1000 / rate)
  end
  return {0, 1, '', tostring(cost), tostring(tokens), math.max(wait_ms, 1), 0, 0}
end

tokens = tokens - cost
redis.call('HSET', KEYS[1], 't', tokens, 'u', now)
local full_in_ms = 86400000
if rate > 0 then
  full_in_ms = math.ceil(math.max(0, burst - tokens) * 1000 / rate)
end
redis.call('PEXPIRE', KEYS[1], full_in_ms + 1000)

local lease_id = ARGV[5]
local expiry = now + ttl_ms * 1000
redis.call('HSET', KEYS[2], 'x', expiry, 'c', cost, 'w', ARGV[8], 'i', ARGV[9],
  'o', ARGV[10], 'n', ARGV[11])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[7]))
redis.call('ZADD', KEYS[3], expiry, lease_id)
if KEYS[4] then
  redis.call('SET', KEYS[4], lease_id .. '|' .. ARGV[1] .. '|' .. string.format('%.0f', expiry),
    'PX', ttl_ms)
end
return {1, 0, lease_id, ARGV[1], tostring(tokens), 0, ttl_ms, 0}
