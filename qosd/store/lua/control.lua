-- The SLO loop's record of a pool, read-only. KEYS[1] pool state hash, KEYS[2]
-- control hash (see adjust.lua). Returns Redis time (ms), R ('' if never set), K (the
-- configured capacity R was written under), then the control fields p, c, r, f, b, s,
-- w, g, d, h, k, e ('' where unset), then the pool's epoch E ('' while its state was
-- never written; _pool.lua).
local now_parts = redis.call('TIME')
local reply = {string.format('%.0f', tonumber(now_parts[1]) * 1000 +
  math.floor(tonumber(now_parts[2]) / 1000))}
local rate = redis.call('HMGET', KEYS[1], 'R', 'K', 'E')
reply[2] = rate[1] or ''
reply[3] = rate[2] or ''
local fields = redis.call('HMGET', KEYS[2], 'p', 'c', 'r', 'f', 'b', 's', 'w', 'g', 'd', 'h',
  'k', 'e')
for i = 1, #fields do
  reply[#reply + 1] = fields[i] or ''
end
reply[#reply + 1] = rate[3] or ''
return reply
