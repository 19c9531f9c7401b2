-- Take tokens from (pool, class) buckets and create leases, for a batch of requests
-- of one pool, in order, atomically. One request is a batch of one.
-- Mirrors qosd/bucket.py (refilled, take) and qosd/store/embedded.py (acquire).
-- bucket(), save_buckets() and `now` come from _buckets.lua, prepended at load.
--
-- Commands issued inside a script cost far more than Lua arithmetic, so a batch
-- reads and writes each bucket once and writes all its leases with one HSET per
-- lease hash, whatever its size.
--
-- KEYS per request: bucket, lease hash, then the request-id key if it has one
-- ARGV[1]          number of requests
-- ARGV[2]          deadline in microseconds of Redis time (0: none). A batch that
--                  runs later than this was given up by its callers (their store
--                  timeout passed): it changes nothing and answers BACKEND_UNAVAILABLE.
-- ARGV per request (12): cost, rate, burst, max_cost, lease_id, lease field, ttl_ms,
--                  keep_ms (how long the lease hash must live), weight,
--                  input_tokens, output_tokens, has_request_id (0/1)
--
-- Bucket string:     "tokens|updated_us" (Redis TIME); absent means full.
-- Lease hash field:  "expiry_us|charged|weight|input|output" while active.
-- Request-id string: "lease_id|charged|expiry_us".
-- Returns Redis time (us, as a string), then 8 values per request: admitted, reason,
-- lease_id, charged, remaining, retry_after_ms, lease_ttl_ms, replayed.
local reply = {string.format('%.0f', now)}
local n = 1
local lease_writes = {}  -- lease hash key -> {field, value, ...}
local lease_keep = {}    -- lease hash key -> ms it must live

local function answer(admitted, reason, lease_id, charged, remaining, retry_ms, ttl_ms, replayed)
  reply[n + 1] = admitted
  reply[n + 2] = reason
  reply[n + 3] = lease_id
  reply[n + 4] = charged
  reply[n + 5] = remaining
  reply[n + 6] = retry_ms
  reply[n + 7] = ttl_ms
  reply[n + 8] = replayed
  n = n + 8
end

local count = tonumber(ARGV[1])
local deadline = tonumber(ARGV[2])
if deadline > 0 and now > deadline then
  for _ = 1, count do
    answer(0, 4, '', '0', '0', 0, 0, 0)
  end
  return reply
end

local k = 1
local a = 3
for _ = 1, count do
  local cost = tonumber(ARGV[a])
  local rate = tonumber(ARGV[a + 1])
  local burst = tonumber(ARGV[a + 2])
  local ttl_ms = tonumber(ARGV[a + 6])
  local b = bucket(KEYS[k], rate, burst)
  local lease_key = KEYS[k + 1]
  local request_key = nil
  if ARGV[a + 11] == '1' then
    request_key = KEYS[k + 2]
    k = k + 3
  else
    k = k + 2
  end

  local replayed = false
  if request_key then
    local prior = redis.call('GET', request_key)
    if prior then
      local prior_id, prior_charged, prior_expiry = string.match(prior, '^(.*)|([^|]*)|([^|]*)$')
      local left_ms = math.floor((tonumber(prior_expiry) - now) / 1000)
      if left_ms > 0 then
        answer(1, 0, prior_id, prior_charged, num(b[1]), 0, left_ms, 1)
        replayed = true
      end
    end
  end

  if not replayed then
    local needed = math.min(cost, burst)
    if cost > tonumber(ARGV[a + 3]) then
      answer(0, 2, '', ARGV[a], num(b[1]), 0, 0, 0)
    elseif b[1] < needed then
      local retry_ms = 0
      if rate > 0 then
        retry_ms = math.max(1, math.ceil((needed - b[1]) * 1000 / rate))
      end
      answer(0, 1, '', ARGV[a], num(b[1]), retry_ms, 0, 0)
    else
      b[1] = b[1] - cost
      b[4] = true
      local lease_id = ARGV[a + 4]
      local expiry = string.format('%.0f', now + ttl_ms * 1000)
      local writes = lease_writes[lease_key]
      if writes == nil then
        writes = {}
        lease_writes[lease_key] = writes
      end
      writes[#writes + 1] = ARGV[a + 5]
      writes[#writes + 1] = expiry .. '|' .. ARGV[a] .. '|' .. ARGV[a + 8] .. '|' ..
        ARGV[a + 9] .. '|' .. ARGV[a + 10]
      lease_keep[lease_key] = math.max(lease_keep[lease_key] or 0, tonumber(ARGV[a + 7]))
      if request_key then
        redis.call('SET', request_key, lease_id .. '|' .. ARGV[a] .. '|' .. expiry, 'PX', ttl_ms)
      end
      answer(1, 0, lease_id, ARGV[a], num(b[1]), 0, ttl_ms, 0)
    end
  end
  a = a + 12
end

for key, writes in pairs(lease_writes) do
  redis.call('HSET', key, unpack(writes))
  redis.call('PEXPIRE', key, lease_keep[key])
end
save_buckets()
return reply
