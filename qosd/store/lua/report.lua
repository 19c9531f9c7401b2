-- Append latency samples to per-(pool, class) windows, newest first, keeping the
-- newest ARGV[1] of each. Samples are stamped with Redis TIME in milliseconds.
--
-- KEYS: one window list per class present in the batch (all of one pool)
-- ARGV: window_size, expire_ms, then pairs (key index, encoded sample)
local now_parts = redis.call('TIME')
local stamp = (tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)) .. '|'
local size = tonumber(ARGV[1])
for i = 3, #ARGV, 2 do
  redis.call('LPUSH', KEYS[tonumber(ARGV[i])], stamp .. ARGV[i + 1])
end
for i = 1, #KEYS do
  redis.call('LTRIM', KEYS[i], 0, size - 1)
  redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2]))
end
return #ARGV / 2 - 1
