-- Read a bucket's tokens after refill, without writing.
-- KEYS[1] bucket hash; ARGV: rate, burst. Returns tokens as a string.
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 't', 'u')
local tokens = tonumber(state[1])
if tokens == nil then
  return tostring(burst)
end
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local elapsed = now - tonumber(state[2])
if elapsed > 0 then
  tokens = math.min(burst, tokens + elapsed * rate / 1000000)
end
return tostring(tokens)
