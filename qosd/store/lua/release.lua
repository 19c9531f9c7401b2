-- Settle leases of one pool, for a batch of releases, in order, atomically: move
-- each lease's class tokens by (charged - actual), bounded by one burst unless the
-- release undoes an admission. Mirrors qosd/store/embedded.py (release); pool state,
-- policy and settle() come from _pool.lua (a refund above the class's burst
-- overflows into the shared tokens, as refill does).
--
-- Script arguments per release (7): class, lease field, actual_input ('' keeps the
-- estimate), actual_output ('' keeps it), output_weight, outcome, exact (1: undo an
-- admission, refunding the whole charge; 0: a release).
-- Keys per release: its lease hash.
--
-- An active lease field is "expiry_us|charged|weight|input|output" (_pool.lua);
-- settling turns it into "R|final|adjustment|outcome", which stays until the lease
-- hash expires, so a repeated release gets the first answer.
-- A lease released before its expiry stops counting as in flight (_pool.lua:
-- lease_ended).
-- Returns 4 values per release: status ('released' now, 'again' if settled before,
-- 'expired' or 'unknown'), final charge, adjustment, class tokens after.
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

local k = NEXT_KEY
local a = NEXT_ARG
for _ = 1, tonumber(ARGV[1]) do
  local i = class_index[ARGV[a]]
  local burst = classes[i].burst
  local lease_key = KEYS[k]
  local field = ARGV[a + 1]
  local value = lease(lease_key, field)
  if value == '' then
    answer('unknown', '0', '0', '0')
  elseif string.sub(value, 1, 2) == 'R|' then
    local final, adjustment = string.match(value, '^R|([^|]*)|([^|]*)|')
    answer('again', final, adjustment, num(state.tokens[i]))
  else
    local expiry, charged, weight, input, output =
      string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
    if now >= tonumber(expiry) then
      answer('expired', charged, '0', '0')
    else
      lease_ended(i, tonumber(input) + tonumber(output), tonumber(expiry))  -- as estimated
      if ARGV[a + 2] ~= '' then input = ARGV[a + 2] end
      if ARGV[a + 3] ~= '' then output = ARGV[a + 3] end
      local actual = (tonumber(input) + tonumber(ARGV[a + 4]) * tonumber(output)) * tonumber(weight)
      local delta = actual - tonumber(charged)
      if ARGV[a + 6] ~= '1' then
        delta = math.max(-burst, math.min(burst, delta))
      end
      settle(i, delta)
      local final = num(tonumber(charged) + delta)
      local settled = 'R|' .. final .. '|' .. num(delta) .. '|' .. ARGV[a + 5]
      leases[lease_key][field] = settled
      local writes = changed[lease_key]
      if writes == nil then
        writes = {}
        changed[lease_key] = writes
      end
      writes[#writes + 1] = field
      writes[#writes + 1] = settled
      answer('released', final, num(delta), num(state.tokens[i]))
    end
  end
  k = k + 1
  a = a + 7
end

for key, writes in pairs(changed) do
  redis.call('HSET', key, unpack(writes))
end
save_state()
return reply
