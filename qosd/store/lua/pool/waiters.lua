-- Waiters. A record: "enqueued|deadline|daemon|cost|tenant_blocked_until|input|kv|due"
-- (us; input: prompt tokens, kv: prompt plus expected output, due: when its first
-- token is due; the last three absent in the records of older daemons, whose queue
-- score is the due time). Its queue score orders it (deadline.lua: order_us).
local function parse_waiter(value)
  local enqueued, deadline, daemon, cost, blocked, rest =
    string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  local input, kv, due = string.match(rest, '^|([^|]*)|([^|]*)|?([^|]*)$')
  return {
    enqueued = tonumber(enqueued), deadline = tonumber(deadline), daemon = daemon,
    cost = tonumber(cost), blocked = tonumber(blocked), input = tonumber(input) or 0,
    kv = tonumber(kv) or 0, due = tonumber(due),
  }
end

local function waiter_value(w)
  return string.format('%.0f', w.enqueued) .. '|' .. string.format('%.0f', w.deadline) .. '|' ..
    w.daemon .. '|' .. num(w.cost) .. '|' .. string.format('%.0f', w.blocked) .. '|' ..
    string.format('%.0f', w.input) .. '|' .. string.format('%.0f', w.kv) .. '|' ..
    string.format('%.0f', w.due)
end

-- A prompt longer than the learned threshold stalls the servers for longer than the
-- top class's requests can absorb: one of another class i waits while the top class
-- has anything in flight or waiting, or while its recent peak is a whole request or
-- more (budget.lua: predict.top_active) (a held waiter). A gap between bursts is no
-- gap: the next burst arrives while the long prompt still prefills. On servers that
-- prefill oldest first, a prompt that would block the top class past the backlog
-- bound also waits while the bucket of blocked time cannot pay for its block
-- (budget.lua: predict.top_blocked). In a GPU-gated pool neither holds while no
-- prefill is admitted ahead (the real clock, budget.lua, at now) for a prompt within
-- the idle threshold (prefill.lua): its stall on the next top-class prompt is then
-- its own prefill alone, which the top class's objectives absorb. Held at an idle
-- server, such prompts left the GPU idle while they waited out their max wait
-- (ADR 14).
local function held_for_gap(i, input)
  if pool_gated and input <= state.long_prefill_idle and state.prefill_real_until <= now then
    return false
  end
  return (i ~= 1 and state.long_prefill > 0 and input > state.long_prefill
    and predict.top_active()) or predict.top_blocked(i, input)
end

local daemon_seen = {}
local function daemon_alive(daemon)
  local seen = daemon_seen[daemon]
  if seen == nil then
    seen = tonumber(redis.call('HGET', DAEMONS, daemon)) or 0
    daemon_seen[daemon] = seen
  end
  return seen >= now - stale_after_us
end

local function remove_waiter(i, id)
  local removed = redis.call('ZREM', classes[i].queue, id)
  if removed == 1 then
    state.waiting[i] = math.max(0, state.waiting[i] - 1)
    state_changed = true
  end
  redis.call('HDEL', WAITERS, id)
  return removed
end

-- The first live waiter of each class that has any, in the order of its queue
-- (earliest due first), looking past waiters blocked by their tenant's ceiling (they
-- must not hold up other tenants; up to WAITER_LOOKAHEAD of them), waiters whose
-- max wait has passed (their daemons answer them QUEUE_TIMEOUT and cancel them) and
-- waiters that would be late if admitted now, and removing the entries of dead
-- daemons, long-expired waits, or entries whose record is missing, on the way.
local function heads()
  local found = {}
  for i = 1, class_count do
    if state.waiting[i] > 0 then
      local removed = false
      local start = 0
      local head = nil
      while head == nil and start < WAITER_LOOKAHEAD do
        local page = redis.call('ZRANGE', classes[i].queue, start, start + WAITER_PAGE - 1,
          'WITHSCORES')
        for j = 1, #page, 2 do
          local id = page[j]
          local value = redis.call('HGET', WAITERS, id)
          local w = value and parse_waiter(value)
          if not w or not daemon_alive(w.daemon) or w.deadline + stale_after_us < now then
            redis.call('ZREM', classes[i].queue, id)
            redis.call('HDEL', WAITERS, id)
            removed = true
          else
            w.order = tonumber(page[j + 1])
            w.due = w.due or w.order
            local late = by_deadline.late_if_admitted(i, w.due, w.enqueued, w.input)
            if late then
              by_deadline.late_waiters[id] = i
            end
            if w.blocked <= now and now <= w.deadline and not late
                and not held_for_gap(i, w.input) then
              w.id = id
              w.class = i
              w.rank = effective_rank(i, now - w.enqueued)
              head = w
              break
            end
            start = start + 1  -- blocked, past its max wait, late, or held: look past it
          end
        end
        if #page < 2 * WAITER_PAGE then
          break
        end
      end
      if removed or head == nil then  -- keep the count in step with the queue itself
        state.waiting[i] = redis.call('ZCARD', classes[i].queue)
        state_changed = true
      end
      if head then
        found[#found + 1] = head
      end
    end
  end
  table.sort(found, function(x, y)
    if x.rank ~= y.rank then
      return x.rank < y.rank
    end
    return x.order < y.order
  end)
  return found
end

-- Has class i a live waiter placed before `order` (order_us), that is not stepping
-- aside (for its tenant's ceiling, or late)? A new request of the class must not
-- overtake one (first come first served among equal objectives and prompts); the
-- others it may.
local function has_live_waiter(i, order)
  if state.waiting[i] == 0 then
    return false
  end
  for _, w in ipairs(heads()) do
    if w.class == i then
      return w.order <= order
    end
  end
  return false
end

-- A GPU-gated pool's order: within its share first (0), then by rank (gated_rank of
-- the effective rank), then the higher class; a head standing as well is earlier.
local function stands_before(x_within, x_rank, x_class, y_within, y_rank, y_class)
  if x_within ~= y_within then
    return x_within < y_within
  end
  if x_rank ~= y_rank then
    return x_rank < y_rank
  end
  return x_class <= y_class
end

local function standing(w)
  return within_share(w.class, w.cost) and 0 or 1
end

-- Aging promotes a waiter of another class at most to the rank below the top class
-- (a gated rank).
local function gated_rank(i, rank)
  if i == 1 then
    return rank
  end
  return math.max(rank, 1)
end

-- A GPU-gated pool's answer for a new request of class i: how it pays, or 0 to wait.
-- It needs room, no waiter of its class placed before it, and nobody of another class
-- standing better than it, or as well and earlier.
local function gated_how_for_new(i, cost, kv, order, input)
  if has_live_waiter(i, order) or not has_room(i, kv, input) then
    return 0
  end
  local mine = within_share(i, cost) and 0 or 1
  for _, w in ipairs(heads()) do
    if w.class ~= i and stands_before(standing(w), gated_rank(w.class, w.rank), w.class,
        mine, gated_rank(i, classes[i].rank), i)
        and not passes_reserve(i, w.class, has_room(w.class, w.kv, w.input)) then
      return 0
    end
  end
  return gated_how(i, cost)
end

-- May class i take shared tokens now? Not while a waiter of another class with the
-- same or a better effective rank waits for them (a class's own waiters hold it up
-- anyway, FIFO).
local function shared_open_for(i)
  local anyone = false
  for j = 1, class_count do
    if j ~= i and state.waiting[j] > 0 then
      anyone = true
    end
  end
  if not anyone then
    return true
  end
  for _, w in ipairs(heads()) do
    if w.class ~= i and w.rank <= classes[i].rank and classes[w.class].can_borrow then
      return false
    end
  end
  return true
end
