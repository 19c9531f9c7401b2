-- Forget expired leases from the active set and count what is left.
-- KEYS[1] active-lease sorted set. Returns {active, forgotten now}.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local forgotten = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return {redis.call('ZCARD', KEYS[1]), forgotten}
