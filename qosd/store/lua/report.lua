-- Append latency samples to per-(pool, class) windows, newest first, keeping the
-- newest window_size of each. Samples are stamped with Redis TIME in milliseconds.
--
-- KEYS: one window list per class present in the batch (all of one pool)
-- ARGV: REPORT (qosd/store/contract.py): window_size, expire_ms; then SAMPLE per
-- sample: its key's index in KEYS, the encoded sample
local now_parts = redis.call('TIME')
local stamp = (tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)) .. '|'
local size = tonumber(ARGV[ARG_REPORT_WINDOW_SIZE])
local samples = 0
for a = REPORT_ARGS, #ARGV - 1, SAMPLE_ARGS do  -- a: arguments before this sample's
  redis.call('LPUSH', KEYS[tonumber(ARGV[a + ARG_SAMPLE_KEY_INDEX])], stamp .. ARGV[a + ARG_SAMPLE_SAMPLE])
  samples = samples + 1
end
for i = 1, #KEYS do
  redis.call('LTRIM', KEYS[i], 0, size - 1)
  redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[ARG_REPORT_EXPIRE_MS]))
end
return samples
