-- Set a pool's admitted rate (R), for the SLO loop or an operator's pin, atomically.
-- Pool state, allocate() and save_state() come from the pool prelude: the pool is refilled
-- at the old rate up to now, then runs at the new one; tokens above the new bursts
-- are dropped, as a refill would.
--
-- The script, not the caller, enforces the cooldown: two controllers that both
-- believe they lead (a lease handed over in a partition, say) still cannot change
-- a pool twice within one cooldown.
--
-- Keys (after the pool's): control hash, history list.
-- Script arguments: ADJUST (qosd/store/contract.py): cooldown_ms, force (1: pin or
-- unpin, no cooldown or pin check), then the new record: capacity, reason, by,
-- probe_step, probe_wait, last_good, direction, pinned, ceiling.
-- Control hash (contract.py: CONTROL_HASH): p pinned, c changed_ms, r reason, f from,
-- b by, s probe_step, w probe_wait, g last_good, d direction, h ceiling, k configured
-- capacity, e the pool state's epoch it was written under (pool/args.lua: E): a record
-- whose e is not the state's epoch was not written since the state was last made anew.
-- Returns ADJUSTED: {1, changed_ms} when applied, {0, 'pinned' | 'cooldown'} when
-- refused.
local control_key = KEYS[NEXT_KEY]
local history_key = KEYS[NEXT_KEY + 1]
local a = ARGS_BEFORE
local now_ms = math.floor(now / 1000)
if ARGV[a + ARG_ADJUST_FORCE] ~= '1' then
  local current = redis.call('HMGET', control_key, 'p', 'c')
  if current[1] == '1' then
    return {0, 'pinned'}
  end
  local changed = tonumber(current[2]) or 0
  if changed > 0 and now_ms - changed < tonumber(ARGV[a + ARG_ADJUST_COOLDOWN_MS]) then
    return {0, 'cooldown'}
  end
end
local old = state.capacity
state.capacity = tonumber(ARGV[a + ARG_ADJUST_CAPACITY])
allocate(state.capacity)
for i = 1, class_count do
  state.tokens[i] = math.min(state.tokens[i], classes[i].burst)
end
state.shared = math.min(state.shared, shared_burst)
state_changed = true
save_state()
-- k: the configured capacity f, g and h were written under (they scale with it, as
-- R does with K in the state hash).
redis.call('HSET', control_key, 'p', ARGV[a + ARG_ADJUST_PINNED], 'c', now_ms,
  'r', ARGV[a + ARG_ADJUST_REASON], 'f', num(old), 'b', ARGV[a + ARG_ADJUST_CHANGED_BY],
  's', ARGV[a + ARG_ADJUST_PROBE_STEP], 'w', ARGV[a + ARG_ADJUST_PROBE_WAIT],
  'g', ARGV[a + ARG_ADJUST_LAST_GOOD], 'd', ARGV[a + ARG_ADJUST_DIRECTION],
  'h', ARGV[a + ARG_ADJUST_CEILING], 'k', num(capacity), 'e', state.epoch)
redis.call('LPUSH', history_key, string.format('%.0f', now_ms) .. '|' .. num(old) .. '|' ..
  ARGV[a + ARG_ADJUST_CAPACITY] .. '|' .. ARGV[a + ARG_ADJUST_CHANGED_BY] .. '|' ..
  ARGV[a + ARG_ADJUST_REASON])
redis.call('LTRIM', history_key, 0, 99)
return {1, string.format('%.0f', now_ms)}
