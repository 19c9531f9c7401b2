-- Read a bucket's tokens after refill, without writing.
-- KEYS[1] bucket ("tokens|updated_us"); ARGV: rate, burst. Returns tokens as a string.
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local state = redis.call('GET', KEYS[1])
if not state then
  return tostring(burst)
end
local stored, updated = string.match(state, '^([^|]*)|(.*)$')
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local tokens = tonumber(stored)
local elapsed = now - tonumber(updated)
if elapsed > 0 then
  tokens = math.min(burst, tokens + elapsed * rate / 1000000)
end
return tostring(tokens)
