-- Paying for an admission: how (contract.Take), take, settle, retry-after, aging.
local function how_to_take(i, cost, shared_open)
  local c = classes[i]
  local own = state.tokens[i]
  if own >= cost then
    return TAKE_OWN
  end
  if shared_open and c.can_borrow and math.max(own, 0) + state.shared >= cost then
    return TAKE_BORROW
  end
  if own >= math.min(cost, c.burst) then
    return TAKE_OWN  -- above the burst, from a full bucket, into debt
  end
  return 0
end

-- GPU-gated pools: room in flight, the class's share, and how to pay.

-- The predicted prefill of a prompt of `input` tokens, us, by the pool's prefill model;
-- nil while there is none.
function predict.prefill_us(input)
  local m = state.prefill_model
  if not m then
    return nil
  end
  return formula.prefill_ms(m, tonumber(input)) * 1000
end

-- The leases in flight: the batch the servers decode, as far as qosd knows it.
function predict.in_flight()
  local count = 0
  for j = 1, class_count do
    count = count + state.in_n[j]
  end
  return count
end

-- The top class's recent peak demand (save.lua: decayed by the pool's half-life), in
-- whole requests: what the top reserve, the predicted batch and the gap rule
-- (waiters.lua) count of it.
function predict.top_peak_requests()
  return math.floor(state.top_peak_n + 0.5)
end

-- The batch a new stream of class i makes, as far as its decode will see it: the
-- leases in flight, the stream itself and, below the top class, the top class's
-- recent peak less what it holds now (in whole requests). A stream of a lower class
-- decodes for seconds; the top class's next burst joins its batch, and the top
-- class's streams are the ones the prediction must keep on time.
function predict.batch_for(i)
  local batch = predict.in_flight() + 1
  if i ~= 1 then
    batch = batch + math.max(0, predict.top_peak_requests() - state.in_n[1])
  end
  return batch
end

-- The decode model that predicts the streams' TPOT, and so the prefill share and
-- the room for one more stream: on servers that chunk prefill only. On unchunked
-- ones the predicted share was tighter than the configured one, and goodput fell
-- from 0.680 to 0.486 on an Azure development seed (ADR 13); there the model
-- predicts only the pass a new prompt waits out (deadline.lua: first_pass_us).
function predict.share_model()
  local d = state.decode_model
  if d and d.chunked then
    return d
  end
  return nil
end

-- The tightest TPOT target (ms) of the streams in flight and of a new one of class i,
-- by the decode model's targets; nil: none has one (or there is no model).
function predict.tightest_tpot_ms(i)
  local d = predict.share_model()
  if not d then
    return nil
  end
  local tightest = d.targets[i]
  for j = 1, class_count do
    local target = d.targets[j]
    if target and state.in_n[j] > 0 and (not tightest or target < tightest) then
      tightest = target
    end
  end
  return tightest
end

-- The share of the servers' time a prompt of class i may keep them prefilling: the
-- pace of the share clock. With a decode model, what keeps every stream in flight,
-- and class i's new one, within its TPOT target at the batch they then make
-- (formulas.lua: prefill_share_for), never below MIN_PREFILL_SHARE_PCT, and the whole
-- time where none has a target; without a model, the configured share.
function predict.prefill_share(i)
  local d = predict.share_model()
  if not d then
    return gate.prefill_share
  end
  local target = predict.tightest_tpot_ms(i)
  if not target then
    return 1
  end
  local step = formula.decode_step_ms(d, predict.batch_for(i))
  return math.min(1, math.max(MIN_PREFILL_SHARE_PCT / 100,
    formula.prefill_share_for(step, target)))
end

-- What a prompt of class i, of work_us of prefill, counts on the share clock: the
-- time it adds to the streams' decode (formulas.lua: prefill_stretch_us; without a
-- decode model, all of it), at the share class i may keep.
function predict.share_clock_us(i, work_us)
  local d = predict.share_model()
  local stretch = work_us
  if d then
    stretch = formula.prefill_stretch_us(work_us,
      formula.decode_step_ms(d, predict.batch_for(i)), d.chunked)
  end
  return stretch / predict.prefill_share(i)
end

-- May one more stream of class i decode? Not if the step of the batch it makes would
-- itself take a stream in flight past its TPOT target (decode model only).
function predict.step_within_targets(i)
  local target = predict.tightest_tpot_ms(i)
  if not target then
    return true
  end
  return formula.decode_step_ms(predict.share_model(), predict.batch_for(i)) <= target
end

-- How long a prompt of class i, of `input` tokens, keeps the top class's next prompt
-- from starting within the backlog bound, us: its own prefill past the bound (a
-- prompt admitted at the bound, as has_room admits one). On servers that prefill
-- oldest first the top class's prompt waits that long; on servers that serve it first
-- it starts, but every pass it shares with the long prompt's chunks is longer (vLLM
-- V1 plans running prompts' chunks before a new one's, and a long prompt's late
-- chunks attend over its whole prefix), about as long. 0 for the top class, for a
-- prompt the bound covers, and where nothing predicts prefill.
function predict.top_blocked_us(i, input)
  if i == 1 or gate.prefill_backlog_us <= 0 then
    return 0
  end
  local own = predict.prefill_us(input)
  if not own then
    return 0
  end
  -- Spread over several servers, each taking its next prompt from the earliest free,
  -- about one top-class prompt in that many lands behind it.
  return math.max(0, own - gate.prefill_backlog_us) / gate.servers
end

-- The top class has traffic: in flight, waiting, or a recent peak of a request or more.
function predict.top_active()
  return state.in_n[1] > 0 or state.waiting[1] > 0 or predict.top_peak_requests() > 0
end

-- Does a prompt of class i wait for the top class's blocked share (max_top_blocked_share)?
-- While the top class has traffic, the time prompts below it keep its next prompt
-- blocked comes from a bucket that fills at that share of real time, up to
-- top_blocked_burst_s: the clock `Bb` is when it would be empty (prefill_started
-- charges it), so it holds (now - Bb) x share, at most the burst. A prompt waits
-- until the bucket holds its block, or is full. About that share of the top class's
-- prompts arrive while it is blocked (or slowed, where servers serve it first); of
-- the prompts that block it, those that block it least go first.
function predict.top_blocked(i, input)
  if gate.top_blocked_share >= 1 or not predict.top_active() then
    return false
  end
  local blocked = predict.top_blocked_us(i, input)
  return blocked > 0 and state.top_blocked_until
    > now - math.min(blocked, gate.top_blocked_burst_us) / gate.top_blocked_share
end

-- When a prompt of class i may block the top class again, ms from now (0: now).
function predict.top_blocked_wait_ms(i, input)
  if not predict.top_blocked(i, input) then
    return 0
  end
  local blocked = math.min(predict.top_blocked_us(i, input), gate.top_blocked_burst_us)
  return math.ceil((state.top_blocked_until + blocked / gate.top_blocked_share - now) / 1000)
end

-- The prefill backlog: an admitted prompt is prefilled after those admitted before
-- it, on the share clock (predict.share_clock_us) and the real one; a
-- top-class prompt (class i == 1) also on the top class's own clock. The real clock
-- is the earliest free server's; the share clock and the top class's run as fast as
-- the servers together (the servers' time is that many times real time).
local function prefill_started(i, input)
  local work_us = predict.prefill_us(input)
  if gate.top_blocked_share < 1 and predict.top_active() then
    local blocked = predict.top_blocked_us(i, input)
    if blocked > 0 then  -- from the bucket (predict.top_blocked), full at most
      state.top_blocked_until = math.max(now - gate.top_blocked_burst_us / gate.top_blocked_share,
        state.top_blocked_until) + blocked / gate.top_blocked_share
      state_changed = true
    end
  end
  if work_us then
    state.prefill_until = math.max(now, state.prefill_until)
      + predict.share_clock_us(i, work_us) / gate.servers
    state.prefill_real_until = predict.onto_earliest_server(
      math.max(now, state.prefill_real_until) + work_us)
    if i == 1 then
      state.prefill_top_until = math.max(now, state.prefill_top_until) + work_us / gate.servers
    end
    state_changed = true
  end
end

-- When the top class's prompts in prefill stop delaying a new one of `input` tokens,
-- on servers where prompts share passes (us of Redis time). There the servers plan a
-- chunk of every prompt in prefill into each pass, each at most the long-prefill
-- threshold (vLLM V1), so a new prompt does not wait for the backlog: it prefills
-- beside it, and each prompt beside it costs it about its chunk of every pass the
-- new one needs. A chunk costs what the new prompt's does (prompts of the same
-- depth) up to about three times (one deep in a long prompt: 512 tokens 30K tokens
-- in take 67 ms of attention and compute against 31 ms): the pool's
-- shared_pass_stretch times its own prefill each (policy.py: SHARED_PASS_STRETCH),
-- for at most every top-class lease in flight, and never more than the backlog.
-- Counted whole, the clock refused a 26-token P0 prompt behind 3.8 s of one
-- 37K-token P0 prompt that the servers would start at once (Mooncake 1.5x
-- chunked-priority, development seeds: 31 of 62 of P0's losses).
function predict.top_wait_until(input)
  local own = input and predict.prefill_us(input)
  if not own then
    return state.prefill_top_until
  end
  local beside = math.max(1, state.in_n[1]) * gate.shared_pass_stretch * own
  return math.min(state.prefill_top_until, now + beside)
end

-- When the prefill that class i's next prompt (of `input` tokens, where known)
-- starts behind ends (us of Redis time): the top class's, by the real clock (its
-- own prompts alone where the servers schedule by priority, as far as they delay
-- it where prompts share passes); the others', by the share's, and never before
-- the real one's (a decode model's share clock counts a chunked prefill less the
-- step its pass decodes, so it can run behind the prefill really queued).
-- (In `predict`, not a local: a script's main chunk has at most 200 locals.)
function predict.prefill_ahead_until(i, input)
  if i ~= 1 then
    return math.max(state.prefill_until, state.prefill_real_until)
  end
  if gate.shared_pass_stretch > 0 then
    return predict.top_wait_until(input)
  end
  if gate.servers_by_priority then
    return state.prefill_top_until
  end
  return state.prefill_real_until
end

-- Room for a request of class i holding `tokens` of KV in flight, with a prompt of
-- `input` tokens (nil: not known; the top class's backlog then counts whole).
local function has_room(i, tokens, input)
  local count, held = 0, 0
  for j = 1, class_count do
    count = count + state.in_n[j]
    held = held + state.in_c[j]
  end
  if count == 0 then
    return true  -- alone in an idle pool: always, whatever its size
  end
  if state.prefill_model and gate.prefill_backlog_us > 0 then
    if predict.prefill_ahead_until(i, input) - now > gate.prefill_backlog_us then
      return false  -- the servers' prefill backlog is full: wait here, in priority order
    end
  end
  -- The servers full: below the top class, the servers' own load
  if i ~= 1 and ((gate.max_server_waiting >= 0 and state.server_waiting
      and state.server_waiting > gate.max_server_waiting)
    or (gate.max_kv_cache_usage > 0 and state.server_kv
      and state.server_kv >= gate.max_kv_cache_usage)) then
    return false
  end
  if i ~= 1 and not predict.step_within_targets(i) then
    return false  -- one more stream would slow every stream past its TPOT target
  end
  if i == 1 then
    if bound_count > 0 and count + 1 > bound_count then
      return false
    end
    return not (bound_tokens > 0 and held + tokens > bound_tokens)
  end
  -- Below the top class, leave the top class's reserve free: the configured share of
  -- the bound, or what it held at its recent peak (in whole requests: a faded peak
  -- holds back no slot) less what it holds now, up to half the bound.
  local free_n = math.max(gate.top_reserve * bound_count,
    math.min(predict.top_peak_requests(), bound_count * gate.top_peak_most)
      - state.in_n[1])
  if bound_count > 0 and count + 1 > bound_count - free_n then
    return false
  end
  local free_c = math.max(gate.top_reserve * bound_tokens,
    math.min(state.top_peak_c, bound_tokens * gate.top_peak_most) - state.in_c[1])
  return not (bound_tokens > 0 and held + tokens > bound_tokens - free_c)
end

-- Passing the reserve: the top class goes past a better-standing waiter of a lower
-- class that has no room, into the reserve that waiter could not use anyway.
local function passes_reserve(i, ahead, ahead_has_room)
  return i == 1 and ahead ~= 1 and not ahead_has_room
end

local function within_share(i, cost)
  return state.tokens[i] >= math.min(cost, classes[i].burst)
end

local function gated_how(i, cost)
  local own = state.tokens[i]
  if own >= math.min(cost, classes[i].burst) then
    return TAKE_OWN
  end
  if classes[i].can_borrow and math.max(own, 0) + state.shared >= cost then
    return TAKE_BORROW
  end
  if gate.prefill_backlog_us > 0 and not state.prefill_model then
    return 0  -- room is known only once the prefill backlog can be predicted
  end
  return TAKE_OVER
end

local function take(i, cost, how)
  state_changed = true
  state.admitted = state.admitted + cost
  if how == TAKE_OWN then
    state.tokens[i] = state.tokens[i] - cost
    return
  end
  if how == TAKE_OVER then
    local tokens = state.tokens[i]
    state.tokens[i] = math.max(tokens - cost, math.min(tokens, -classes[i].burst))
    return
  end
  local own = math.max(state.tokens[i], 0)
  state.tokens[i] = state.tokens[i] - own
  state.shared = state.shared - (cost - own)
end

local function settle(i, delta)
  state_changed = true
  local tokens = state.tokens[i] - delta
  if tokens > classes[i].burst then
    state.shared = math.min(shared_burst, state.shared + tokens - classes[i].burst)
    tokens = classes[i].burst
  end
  state.tokens[i] = tokens
end

local function retry_after_ms(i, cost)
  local c = classes[i]
  local own = state.tokens[i]
  local best = nil
  if c.rate > 0 then
    best = (math.min(cost, c.burst) - own) * 1000 / c.rate
  end
  if c.can_borrow then
    local inflow = free_rate
    for j = 1, class_count do
      if j ~= i and state.tokens[j] >= classes[j].burst then
        inflow = inflow + classes[j].rate
      end
    end
    local own_refill = 0
    if own < c.burst then
      own_refill = c.rate
    end
    if inflow + own_refill > 0 then
      local borrow = (cost - math.max(own, 0) - state.shared) * 1000 / (inflow + own_refill)
      if best == nil or borrow < best then
        best = borrow
      end
    end
  end
  if best == nil then
    return 60000
  end
  return math.max(1, math.ceil(best))
end

local function effective_rank(i, waited_us)
  local c = classes[i]
  if c.aging_us <= 0 or waited_us <= 0 then
    return c.rank
  end
  return math.max(0, c.rank - math.floor(waited_us / c.aging_us))
end
