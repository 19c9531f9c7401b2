-- The formulas the scripts share, each stated once: what a request costs, and how
-- long a prompt's prefill takes. qosd prepends this file to the pool scripts and to
-- prefill.lua (qosd/store/redis.py: FORMULA_SCRIPTS). One table: the pool scripts'
-- chunk holds at most 200 locals.
local formula = {}

-- What a request costs its class: (prompt + output_weight x output tokens) x the class
-- weight it was admitted under. acquire.lua and pump.lua charge it from the
-- estimates, release.lua settles it from the real counts.
function formula.cost(input, output, weight, output_weight)
  return (tonumber(input) + output_weight * tonumber(output)) * tonumber(weight)
end

-- The prefill model: a prompt of n tokens takes c + a n + b n^2 ms to prefill; m is
-- {c, a, b}. The SLO loop learns it from reports (qosd/control/prefill.py); only the
-- scripts apply it.
function formula.prefill_ms(m, n)
  return m[1] + n * (m[2] + m[3] * n)
end

-- The prompt length whose prefill takes `ms` (0 if even an empty prompt takes
-- longer): the root of b n^2 + a n + (c - ms) = 0.
function formula.prefill_tokens_for(m, ms)
  local c, a, b = m[1] - ms, m[2], m[3]
  if c >= 0 then
    return 0
  end
  if b <= 0 then
    if a > 0 then
      return -c / a
    end
    return math.huge
  end
  return (-a + math.sqrt(a * a - 4 * b * c)) / (2 * b)
end

-- The decode model: one decode step of a batch of n sequences takes base + per_sequence n
-- ms; d is {base, per_sequence}. The SLO loop learns it from reports
-- (qosd/control/decode.py); only the scripts apply it.
function formula.decode_step_ms(d, n)
  return d[1] + d[2] * n
end

-- The share of the servers' time prompts may add to the streams' decode while the
-- tightest stream in flight, decoding at steps of step_ms, must keep its time per
-- output token within tpot_ms: over a stream's life, its passes take a step each
-- plus what prefill adds to them, so its TPOT is about step / (1 - share).
function formula.prefill_share_for(step_ms, tpot_ms)
  return 1 - step_ms / tpot_ms
end

-- What a prompt's prefill of prefill_us adds to every stream's decode, us: all of it
-- where a prefill pass stops the streams (unchunked), the prefill less the step it
-- replaces where the pass that prefills also decodes (chunked).
function formula.prefill_stretch_us(prefill_us, step_ms, chunked)
  if chunked then
    return math.max(0, prefill_us - step_ms * 1000)
  end
  return prefill_us
end
