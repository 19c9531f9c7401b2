-- Keep each model server's latest load and the pool's aggregate of them
-- (the servers' waiting summed, the highest KV usage), which the pool scripts read with the state.
--
-- KEYS[1]  the pool's state hash: Sw (waiting requests, summed), Sk (largest KV cache
--          usage), St (when, us, Redis time); a field is deleted when no fresh read
--          said it
-- KEYS[2]  the pool's servers hash: server -> "at_us|waiting|kv_usage" ('' unknown)
-- ARGV     LOAD (qosd/store/contract.py): the max age of a read, us (older reads
--          are dropped, and not counted), the expiry of the servers hash, ms; then
--          SERVER per server: server, waiting or '', kv_usage or ''
-- Returns the number of servers counted.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local stamp = string.format('%.0f', now)
local max_age = tonumber(ARGV[ARG_LOAD_MAX_AGE_US])
for a = LOAD_ARGS, #ARGV - 1, SERVER_ARGS do  -- a: arguments before this server's
  redis.call('HSET', KEYS[2], ARGV[a + ARG_SERVER_SERVER],
    stamp .. '|' .. ARGV[a + ARG_SERVER_WAITING] .. '|' .. ARGV[a + ARG_SERVER_KV_USAGE])
end
local waiting, kv = nil, nil
local counted = 0
local reads = redis.call('HGETALL', KEYS[2])
for i = 1, #reads, 2 do
  local at, w, k = string.match(reads[i + 1], '^([^|]*)|([^|]*)|([^|]*)$')
  if not at or now - tonumber(at) > max_age then
    redis.call('HDEL', KEYS[2], reads[i])  -- stopped reporting: forgotten
  else
    counted = counted + 1
    if w ~= '' then
      waiting = (waiting or 0) + tonumber(w)
    end
    if k ~= '' then
      kv = math.max(kv or 0, tonumber(k))
    end
  end
end
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[ARG_LOAD_EXPIRE_MS]))
if waiting then
  redis.call('HSET', KEYS[1], 'Sw', string.format('%.0f', waiting))
else
  redis.call('HDEL', KEYS[1], 'Sw')
end
if kv then
  redis.call('HSET', KEYS[1], 'Sk', string.format('%.17g', kv))
else
  redis.call('HDEL', KEYS[1], 'Sk')
end
redis.call('HSET', KEYS[1], 'St', stamp)
return counted
