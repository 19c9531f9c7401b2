-- Settle leases of one pool, for a batch of releases, in order, atomically: move
-- each lease's bucket by (actual cost - charged), bounded by one burst.
-- Mirrors qosd/bucket.py (settle) and qosd/store/embedded.py (release).
-- bucket(), save_buckets() and `now` come from _buckets.lua, prepended at load.
--
-- KEYS per release: lease hash, bucket
-- ARGV[1]           number of releases
-- ARGV per release (8): lease field, actual_input ('' keeps the estimate),
--                   actual_output ('' keeps it), output_weight, rate, burst, outcome,
--                   exact (1: undo an admission, refunding the whole charge; 0: a
--                   release, whose settlement is bounded by one burst)
--
-- An active lease field is "expiry_us|charged|weight|input|output" (acquire.lua);
-- settling turns it into "R|final|adjustment|outcome", which stays until the lease
-- hash expires, so a repeated release gets the first answer.
-- Returns 4 values per release: status ('released' now, 'again' if settled before,
-- 'expired' or 'unknown'), final charge, adjustment, bucket tokens after.
local reply = {}
local n = 0
local leases = {}   -- lease hash key -> field -> value (read once, updated in place)
local changed = {}  -- lease hash key -> {field, value, ...}

local function lease(key, field)
  local fields = leases[key]
  if fields == nil then
    fields = {}
    leases[key] = fields
  end
  local value = fields[field]
  if value == nil then
    value = redis.call('HGET', key, field) or ''
    fields[field] = value
  end
  return value
end

local function answer(status, charged, adjustment, tokens)
  reply[n + 1] = status
  reply[n + 2] = charged
  reply[n + 3] = adjustment
  reply[n + 4] = tokens
  n = n + 4
end

local k = 1
local a = 2
for _ = 1, tonumber(ARGV[1]) do
  local lease_key = KEYS[k]
  local field = ARGV[a]
  local rate = tonumber(ARGV[a + 4])
  local burst = tonumber(ARGV[a + 5])
  local value = lease(lease_key, field)
  if value == '' then
    answer('unknown', '0', '0', '0')
  elseif string.sub(value, 1, 2) == 'R|' then
    local final, adjustment = string.match(value, '^R|([^|]*)|([^|]*)|')
    answer('again', final, adjustment, num(bucket(KEYS[k + 1], rate, burst)[1]))
  else
    local expiry, charged, weight, input, output =
      string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
    if now >= tonumber(expiry) then
      answer('expired', charged, '0', '0')
    else
      local b = bucket(KEYS[k + 1], rate, burst)
      if ARGV[a + 1] ~= '' then input = ARGV[a + 1] end
      if ARGV[a + 2] ~= '' then output = ARGV[a + 2] end
      local actual = (tonumber(input) + tonumber(ARGV[a + 3]) * tonumber(output)) * tonumber(weight)
      local delta = actual - tonumber(charged)
      if ARGV[a + 7] ~= '1' then
        delta = math.max(-burst, math.min(burst, delta))
      end
      b[1] = math.min(burst, b[1] - delta)
      b[4] = true
      local final = num(tonumber(charged) + delta)
      local settled = 'R|' .. final .. '|' .. num(delta) .. '|' .. ARGV[a + 6]
      leases[lease_key][field] = settled
      local writes = changed[lease_key]
      if writes == nil then
        writes = {}
        changed[lease_key] = writes
      end
      writes[#writes + 1] = field
      writes[#writes + 1] = settled
      answer('released', final, num(delta), num(b[1]))
    end
  end
  k = k + 2
  a = a + 8
end

for key, writes in pairs(changed) do
  redis.call('HSET', key, unpack(writes))
end
save_buckets()
return reply
