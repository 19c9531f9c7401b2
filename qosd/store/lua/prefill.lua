-- What the SLO loop learned of a pool's prefill (qosd/control/prefill.py) and decode
-- (qosd/control/decode.py), written into the pool's state: the decode model D
-- (base|per_sequence|class targets; '' none), the prefill model M (c|a|b; '' none) and the long-prefill
-- threshold P, the prompt length above which a prompt waits for a gap in the top
-- class's traffic. P is the length whose predicted prefill (formulas.lua) equals
-- the stall the top class can absorb, never below the pool's usual prompts; without a
-- model or a tolerance, the configured fallback (0: no rule). Pi is the idle threshold:
-- a prompt within it is not held while no prefill is admitted ahead (waiters.lua).
-- KEYS[1] the pool state hash. ARGV: PREFILL (qosd/store/contract.py). Returns P.
local model = nil
local encoded = ARGV[ARG_PREFILL_MODEL]
if encoded ~= '' then
  local c, a, b = string.match(encoded, '^([^|]*)|([^|]*)|([^|]*)$')
  model = {tonumber(c), tonumber(a), tonumber(b)}
  redis.call('HSET', KEYS[1], 'M', encoded)
else
  redis.call('HDEL', KEYS[1], 'M')
end
if ARGV[ARG_PREFILL_DECODE] ~= '' then
  redis.call('HSET', KEYS[1], 'D', ARGV[ARG_PREFILL_DECODE])
else
  redis.call('HDEL', KEYS[1], 'D')
end
local threshold = tonumber(ARGV[ARG_PREFILL_FALLBACK_TOKENS])
local tolerance = ARGV[ARG_PREFILL_TOLERANCE_MS]
if model and tolerance ~= '' then
  threshold = math.max(tonumber(ARGV[ARG_PREFILL_USUAL_TOKENS]),
    formula.prefill_tokens_for(model, tonumber(tolerance)))
end
if threshold > 0 and threshold < math.huge then
  redis.call('HSET', KEYS[1], 'P', string.format('%.17g', threshold))
else
  threshold = 0
  redis.call('HDEL', KEYS[1], 'P')
end
-- Pi, the idle threshold: the length whose prefill the top class absorbs when it is
-- all that is ahead of its next prompt (no prefill admitted before it), never below P.
local idle_tolerance = ARGV[ARG_PREFILL_IDLE_TOLERANCE_MS]
if model and threshold > 0 and idle_tolerance ~= '' then
  local idle = math.max(threshold, formula.prefill_tokens_for(model, tonumber(idle_tolerance)))
  redis.call('HSET', KEYS[1], 'Pi', string.format('%.17g', idle))
else
  redis.call('HDEL', KEYS[1], 'Pi')
end
return string.format('%.17g', threshold)
