-- Admission by deadline. A request with a TTFT objective is due at its arrival plus
-- that objective, and its class's waiters go by due time, shortest prompt first
-- among equals (order_us; a class without objectives by arrival, first come first
-- served).
-- In a GPU-gated pool with a prefill model, the scripts also know the request's own
-- prefill and the backlog admitted before it, so they know how long it may wait and
-- when it can no longer be on time.

-- One table, not a local per function: a script's main chunk has at most 200 locals.
local by_deadline = {}

-- Waiters that can no longer be on time, found by heads() (waiters.lua): id -> class.
-- A pump drops its own daemon's with STATUS_LATE; other daemons' pumps drop theirs.
by_deadline.late_waiters = {}

-- When a request is due (us of Redis time).
function by_deadline.due_us(enqueued, ttft_ms)
  if ttft_ms > 0 then
    return enqueued + ttft_ms * 1000
  end
  return enqueued
end

-- A queue entry's place among its class's: its due time plus its own prefill, once
-- the pool can predict prefill. Among equal objectives the shortest prompt goes
-- first: a burst that cannot all be on time keeps most of its requests on time by
-- serving the short ones and letting the longest go late (Moore and Hodgson's rule
-- for the most jobs on time). Without an objective or a model: the due time.
function by_deadline.order_us(due, enqueued, input)
  local own = predict.prefill_us(input)
  if due <= enqueued or not own then
    return due
  end
  return due + own
end

-- How long until the prefill backlog lets class i's prompt of `input` tokens in (us;
-- 0: now, or no backlog bound): the lead of its clock (budget.lua:
-- predict.prefill_ahead_until) beyond the bound.
function by_deadline.backlog_wait_us(i, input)
  if not pool_gated or gate.prefill_backlog_us <= 0 or not state.prefill_model then
    return 0
  end
  return math.max(0, predict.prefill_ahead_until(i, input) - now - gate.prefill_backlog_us)
end

-- The passes beside a prompt's own prefill on the way to its first token, us: decode
-- steps at the batch the request joins (budget.lua: predict.batch_for). Where
-- servers chunk prefill, a prompt's last chunk comes out only as its pass ends, and
-- that pass also decodes the batch: a step. Where they do not, its prefill pass
-- starts only once the pass in progress as it arrives has ended, a decode step at
-- worst (prefill ahead of it is the backlog's): a step. Below the top class, on
-- chunked servers, that pass in progress too: a second step (ADR 17). 0 without a
-- decode model. Left out, the requests admitted at the end of their slack were late
-- by the pass: on bursty 2x chunked (development seeds 1 to 3), 101 P1 first tokens,
-- 54 of them after a wait within 120 ms of the objective; on bursty 2x unchunked
-- (development seeds 1 to 4), all 50 of P1's late first tokens, admitted within 93 ms
-- of the objective and late by 6 ms at the median. The top class's slack is short,
-- and the pass in progress is half over on average: counted for it on chunked
-- servers, P0 lost 1.8 points of offered on bursty 2x chunked (ADR 17).
function by_deadline.first_pass_us(i)
  local d = state.decode_model
  if not d then
    return 0
  end
  local step = formula.decode_step_ms(d, predict.batch_for(i)) * 1000
  if d.chunked and i ~= 1 then
    return 2 * step
  end
  return step
end

-- A request's own time to its first token onto idle servers, us: its prefill and the
-- pass that ends it. nil while no prefill model predicts it.
function by_deadline.own_first_token_us(i, input)
  local own = predict.prefill_us(input)
  if not own then
    return nil
  end
  return own + by_deadline.first_pass_us(i)
end

-- The longest a new request of class i may wait, ms. With an objective and a prefill
-- model: its slack, the objective less its own prefill and the pass that ends it
-- (admitted later, even onto an idle GPU, it is late), up to what the caller allows;
-- otherwise the class's max wait.
function by_deadline.granted_wait_ms(i, wait_ms, ttft_ms, cap_ms, input)
  local own = by_deadline.own_first_token_us(i, input)
  if wait_ms <= 0 or ttft_ms <= 0 or not own then
    return wait_ms
  end
  return math.max(0, math.min(cap_ms, math.floor(ttft_ms - own / 1000)))
end

-- How late a request of class i, due at `due`, would be (us; <= 0: on time) if it
-- were admitted now or at any later time: its first token comes after the prefill
-- admitted before it that the servers serve first (the real clock; the top class's
-- own where they schedule by priority, as far as it delays this prompt where prompts
-- share passes), its own, and the pass that ends it, and waiting does not shorten
-- that. nil where nothing predicts it: no objective, or no
-- prefill model, or a pool that is not GPU-gated (no backlog is kept).
function by_deadline.lateness_us(i, due, input)
  if not pool_gated then
    return nil
  end
  local own = by_deadline.own_first_token_us(i, input)
  if not own then
    return nil
  end
  local ahead = state.prefill_real_until
  if i == 1 then
    ahead = predict.prefill_ahead_until(1, input)  -- its own where servers serve it first
  end
  return math.max(now, ahead) + own - due
end

-- May a waiter of class i no longer be on time? Then it is not admitted, and its
-- daemon answers it REASON_DEADLINE at once.
function by_deadline.late_if_admitted(i, due, enqueued, input)
  if due <= enqueued then
    return false  -- no objective: served whenever
  end
  local late = by_deadline.lateness_us(i, due, input)
  return late ~= nil and late > 0
end

-- A new request of class i with a TTFT objective that it cannot meet: the wait (ms)
-- predicted before it could be on time, for its retry-after; nil when it can be (or
-- nothing predicts it). `ready`: it could be admitted now. Late, now or later, if the
-- prefill admitted before it and its own outlast the objective; and if it cannot go
-- now, late if the backlog bound lets it in too late for its own first token.
function by_deadline.miss_ms(i, ttft_ms, input, ready)
  if ttft_ms <= 0 then
    return nil
  end
  local late = by_deadline.lateness_us(i, now + ttft_ms * 1000, input)
  if late == nil then
    return nil
  end
  local wait_us = late
  if not ready then
    local gate_us = by_deadline.backlog_wait_us(i, input)
    if gate_us + by_deadline.own_first_token_us(i, input) > ttft_ms * 1000 then
      wait_us = math.max(wait_us, gate_us)
    end
  end
  if wait_us <= 0 then
    return nil
  end
  return math.max(1, math.ceil(wait_us / 1000))
end
