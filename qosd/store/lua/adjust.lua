-- Set a pool's admitted rate (R), for the SLO loop or an operator's pin, atomically.
-- Pool state, allocate() and save_state() come from _pool.lua: the pool is refilled
-- at the old rate up to now, then runs at the new one; tokens above the new bursts
-- are dropped, as a refill would. Mirrors qosd/store/embedded.py (adjust).
--
-- The script, not the caller, enforces the cooldown: two controllers that both
-- believe they lead (a lease handed over in a partition, say) still cannot change
-- a pool twice within one cooldown.
--
-- Keys (after the pool's): control hash, history list.
-- Script arguments: cooldown_ms, force (1: pin or unpin, no cooldown or pin check),
-- then the new record: capacity, reason, by, probe_step, probe_wait, last_good,
-- direction, pinned, ceiling.
-- Control hash: p pinned, c changed_ms, r reason, f from, b by, s probe_step,
-- w probe_wait, g last_good, d direction, h ceiling, k configured capacity, e the pool
-- state's epoch it was written under (_pool.lua: E): a record whose e is not the
-- state's epoch was not written since the state was last made anew.
-- Returns {1, changed_ms} when applied, {0, 'pinned' | 'cooldown'} when refused.
local control_key = KEYS[NEXT_KEY]
local history_key = KEYS[NEXT_KEY + 1]
local a = NEXT_ARG
local now_ms = math.floor(now / 1000)
if ARGV[a + 1] ~= '1' then
  local current = redis.call('HMGET', control_key, 'p', 'c')
  if current[1] == '1' then
    return {0, 'pinned'}
  end
  local changed = tonumber(current[2]) or 0
  if changed > 0 and now_ms - changed < tonumber(ARGV[a]) then
    return {0, 'cooldown'}
  end
end
local old = state.capacity
state.capacity = tonumber(ARGV[a + 2])
allocate(state.capacity)
for i = 1, class_count do
  state.tokens[i] = math.min(state.tokens[i], classes[i].burst)
end
state.shared = math.min(state.shared, shared_burst)
state_changed = true
save_state()
-- k: the configured capacity f, g and h were written under (they scale with it, as
-- R does with K in the state hash).
redis.call('HSET', control_key, 'p', ARGV[a + 9], 'c', now_ms, 'r', ARGV[a + 3],
  'f', num(old), 'b', ARGV[a + 4], 's', ARGV[a + 5], 'w', ARGV[a + 6], 'g', ARGV[a + 7],
  'd', ARGV[a + 8], 'h', ARGV[a + 10], 'k', num(capacity), 'e', state.epoch)
redis.call('LPUSH', history_key, string.format('%.0f', now_ms) .. '|' .. num(old) .. '|' ..
  ARGV[a + 2] .. '|' .. ARGV[a + 4] .. '|' .. ARGV[a + 3])
redis.call('LTRIM', history_key, 0, 99)
return {1, string.format('%.0f', now_ms)}
