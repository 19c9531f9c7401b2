-- Settle a lease: move the bucket by (actual cost - charged), bounded by one burst.
-- Mirrors qosd/bucket.py (settle) and qosd/store/embedded.py (release).
--
-- KEYS[1] lease hash, KEYS[2] bucket hash, KEYS[3] active-lease sorted set
-- ARGV: lease_id, actual_input ('' = keep estimate), actual_output ('' = keep),
--       output_weight, rate, burst, outcome, tombstone_ms
-- Returns {status, charged, adjustment, remaining}; status is 'released' (settled now),
-- 'again' (settled before), 'expired' or 'unknown'.
local lease = redis.call('HMGET', KEYS[1], 'x', 'c', 'w', 'i', 'o', 'f', 'a')
if lease[1] == false then
  return {'unknown', '0', '0', '0'}
end
local rate = tonumber(ARGV[5])
local burst = tonumber(ARGV[6])
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])

local state = redis.call('HMGET', KEYS[2], 't', 'u')
local tokens = tonumber(state[1])
if tokens == nil then
  tokens = burst
else
  local elapsed = now - tonumber(state[2])
  if elapsed > 0 then
    tokens = math.min(burst, tokens + elapsed * rate / 1000000)
  end
end

if lease[6] ~= false then
  return {'again', lease[6], lease[7], tostring(tokens)}
end
if now >= tonumber(lease[1]) then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {'expired', lease[2], '0', tostring(tokens)}
end

local charged = tonumber(lease[2])
local input = tonumber(lease[4])
local output = tonumber(lease[5])
if ARGV[2] ~= '' then input = tonumber(ARGV[2]) end
if ARGV[3] ~= '' then output = tonumber(ARGV[3]) end
local actual = (input + tonumber(ARGV[4]) * output) * tonumber(lease[3])
local delta = math.max(-burst, math.min(burst, actual - charged))
tokens = math.min(burst, tokens - delta)

redis.call('HSET', KEYS[2], 't', tokens, 'u', now)
local full_in_ms = 86400000
if rate > 0 then
  full_in_ms = math.ceil(math.max(0, burst - tokens) * 1000 / rate)
end
redis.call('PEXPIRE', KEYS[2], full_in_ms + 1000)

local final = tostring(charged + delta)
redis.call('HSET', KEYS[1], 'f', final, 'a', tostring(delta), 'r', ARGV[7])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[8]))
redis.call('ZREM', KEYS[3], ARGV[1])
return {'released', final, tostring(delta), tostring(tokens)}
