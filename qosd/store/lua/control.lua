-- The SLO loop's record of a pool, read-only. KEYS[1] pool state hash, KEYS[2]
-- control hash (see adjust.lua). Returns CONTROL (qosd/store/contract.py): Redis time
-- (ms), R ('' if never set), K (the configured capacity R was written under), then
-- the control fields in CONTROL_HASH order ('' where unset), then the pool's epoch E
-- ('' while its state was never written; pool/args.lua).
local now_parts = redis.call('TIME')
local reply = {}
reply[REPLY_CONTROL_NOW_MS] = string.format('%.0f', tonumber(now_parts[1]) * 1000 +
  math.floor(tonumber(now_parts[2]) / 1000))
local rate = redis.call('HMGET', KEYS[1], 'R', 'K', 'E')
reply[REPLY_CONTROL_RATE] = rate[1] or ''
reply[REPLY_CONTROL_WRITTEN_UNDER] = rate[2] or ''
local fields = redis.call('HMGET', KEYS[2], unpack(CONTROL_HASH))
local before = REPLY_CONTROL_PINNED - 1  -- reply values before the control hash's
for i = 1, #CONTROL_HASH do
  reply[before + i] = fields[i] or ''
end
reply[REPLY_CONTROL_EPOCH] = rate[3] or ''
return reply
