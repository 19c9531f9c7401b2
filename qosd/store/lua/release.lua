-- Settle leases of one pool, for a batch of releases, in order, atomically: move
-- each lease's class tokens by (charged - actual), bounded by one burst unless the
-- release undoes an admission. Pool state,
-- policy and settle() come from the pool prelude (a refund above the class's burst
-- overflows into the shared tokens, as refill does).
--
-- Script arguments: RELEASE per release, packed in one argument
-- (qosd/store/contract.py): class, lease
-- field, actual input and output tokens ('' keeps the estimate), outcome, exact (1:
-- undo an admission whose caller left, refunding the whole charge; 0: a release),
-- has_request. Keys per release: its lease hash, then its request-id key where
-- has_request (freed, if it still names this lease, so that the caller's retry is a
-- new request: an undo's, or a release of a request that failed on its way), then
-- its tenant's counter where its class shares by
-- tokens (fair_charges set). The cost rule is formula.cost (formulas.lua).
--
-- An active lease field is "expiry_us|charged|weight|input|output" (pool/lease_writes.lua);
-- settling turns it into "R|final|adjustment|outcome", which stays until the lease
-- hash expires, so a repeated release gets the first answer.
-- A lease released before its expiry stops counting as in flight (pool/in_flight.lua:
-- lease_ended).
-- Returns a SETTLEMENT per release: status (SETTLED_RELEASED now, SETTLED_AGAIN if
-- settled before, SETTLED_EXPIRED or SETTLED_UNKNOWN), final charge, adjustment,
-- class tokens after.
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
  reply[n + REPLY_SETTLEMENT_STATUS] = status
  reply[n + REPLY_SETTLEMENT_CHARGED] = charged
  reply[n + REPLY_SETTLEMENT_ADJUSTMENT] = adjustment
  reply[n + REPLY_SETTLEMENT_REMAINING] = tokens
  n = n + SETTLEMENT_FIELDS
end

local k = NEXT_KEY
local a = ARGS_BEFORE  -- arguments before this release's
for _ = 1, tonumber(ARGV[ARG_CALLS]) do
  local r = record(ARGV[a + ARG_RELEASE_RECORD])  -- its ReleaseArgs, packed
  local i = class_index[r[ARG_RELEASE_QOS_CLASS]]
  local burst = classes[i].burst
  local lease_key = KEYS[k]
  local request_key = nil
  if r[ARG_RELEASE_HAS_REQUEST] == '1' then
    k = k + 1
    request_key = KEYS[k]
  end
  local field = r[ARG_RELEASE_FIELD]
  local value = lease(lease_key, field)
  if value == '' then
    answer(SETTLED_UNKNOWN, '0', '0', '0')
  elseif string.sub(value, 1, 2) == 'R|' then
    local final, adjustment = string.match(value, '^R|([^|]*)|([^|]*)|')
    answer(SETTLED_AGAIN, final, adjustment, num(state.tokens[i]))
  else
    local expiry, charged, weight, input, output =
      string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
    if now >= tonumber(expiry) then
      answer(SETTLED_EXPIRED, charged, '0', '0')
    else
      lease_ended(i, tonumber(input) + tonumber(output), tonumber(expiry))  -- as estimated
      local actual_input = r[ARG_RELEASE_INPUT_TOKENS]
      local actual_output = r[ARG_RELEASE_OUTPUT_TOKENS]
      if r[ARG_RELEASE_FAIR_CHARGES] ~= '' then  -- its tenant's counter follows
        tenant.settle(i, KEYS[k + 1], r[ARG_RELEASE_FAIR_CHARGES], input, output,
          actual_input, actual_output, r[ARG_RELEASE_EXACT] == '1')
      end
      if actual_input ~= '' then input = actual_input end
      if actual_output ~= '' then output = actual_output end
      local actual = formula.cost(input, output, weight, gate.output_weight)
      local delta = actual - tonumber(charged)
      if r[ARG_RELEASE_EXACT] ~= '1' then
        delta = math.max(-burst, math.min(burst, delta))
      end
      if request_key then
        free_request_id(request_key, field)
      end
      settle(i, delta)
      local final = num(tonumber(charged) + delta)
      local settled = 'R|' .. final .. '|' .. num(delta) .. '|' .. r[ARG_RELEASE_OUTCOME]
      leases[lease_key][field] = settled
      local writes = changed[lease_key]
      if writes == nil then
        writes = {}
        changed[lease_key] = writes
      end
      writes[#writes + 1] = field
      writes[#writes + 1] = settled
      answer(SETTLED_RELEASED, final, num(delta), num(state.tokens[i]))
    end
  end
  k = k + 1
  if r[ARG_RELEASE_FAIR_CHARGES] ~= '' then
    k = k + 1  -- past the tenant's counter
  end
  a = a + RELEASE_ARGS
end

for key, writes in pairs(changed) do
  redis.call('HSET', key, unpack(writes))
end
tenant.save()
save_state()
return reply
