-- Admit, queue or reject a batch of requests of one pool, in order, atomically.
-- One request is a batch of one. Mirrors qosd/store/embedded.py (acquire).
-- The pool state, policy, budget functions and waiter helpers come from _pool.lua.
--
-- Script arguments: deadline in us of Redis time (0: none; a batch that runs later
-- was given up by its callers and changes nothing), the daemon's id, then per
-- request (12): class, cost, lease_id, lease field ("<class>:<token>", also the
-- waiter id), ttl_ms, keep_ms (how long the lease hash must live), weight,
-- input_tokens, output_tokens, wait_ms (0: answer now), has_request_id,
-- has_tenant_key.
-- Keys per request: lease hash, then the request-id key and the tenant bucket if any.
-- Request-id string: "lease_id|charged|expiry_us".
--
-- Returns Redis time (us, string), the pool's epoch ('' while its state was never
-- written; _pool.lua), then 8 values per request: status (0 rejected,
-- 1 admitted, 2 queued), reason, lease_id, charged, remaining, retry_after_ms
-- (when queued: none), lease_ttl_ms, replayed.
local reply = {string.format('%.0f', now), state.epoch or ''}
local n = 2
local function answer(status, reason, lease_id, charged, remaining, retry_ms, ttl_ms, replayed)
  reply[n + 1] = status
  reply[n + 2] = reason
  reply[n + 3] = lease_id
  reply[n + 4] = charged
  reply[n + 5] = remaining
  reply[n + 6] = retry_ms
  reply[n + 7] = ttl_ms
  reply[n + 8] = replayed
  n = n + 8
end

local count = tonumber(ARGV[1])
local deadline = tonumber(ARGV[NEXT_ARG])
local daemon = ARGV[NEXT_ARG + 1]
if deadline > 0 and now > deadline then
  for _ = 1, count do
    answer(0, 4, '', '0', '0', 0, 0, 0)
  end
  return reply
end

local k = NEXT_KEY
local a = NEXT_ARG + 2
local enqueued_at = now
for _ = 1, count do
  local i = class_index[ARGV[a]]
  local c = classes[i]
  local cost = tonumber(ARGV[a + 1])
  local lease_id = ARGV[a + 2]
  local field = ARGV[a + 3]
  local ttl_ms = tonumber(ARGV[a + 4])
  local wait_ms = tonumber(ARGV[a + 9])
  local lease_key = KEYS[k]
  k = k + 1
  local request_key = nil
  if ARGV[a + 10] == '1' then
    request_key = KEYS[k]
    k = k + 1
  end
  local tenant_key = nil
  if ARGV[a + 11] == '1' then
    tenant_key = KEYS[k]
    k = k + 1
  end

  local replayed = false
  if request_key then
    local prior = redis.call('GET', request_key)
    if prior then
      local prior_id, prior_charged, prior_expiry = string.match(prior, '^(.*)|([^|]*)|([^|]*)$')
      local left_ms = math.floor((tonumber(prior_expiry) - now) / 1000)
      if left_ms > 0 then
        answer(1, 0, prior_id, prior_charged, num(state.tokens[i]), 0, left_ms, 1)
        replayed = true
      end
    end
  end

  if not replayed then
    if cost > c.max_cost then
      answer(0, 2, '', ARGV[a + 1], num(state.tokens[i]), 0, 0, 0)
    else
      local how = 0
      local input = tonumber(ARGV[a + 7])
      local kv = input + tonumber(ARGV[a + 8])
      local held = held_for_gap(i, input)
      if held then
        how = 0  -- waits for a gap in the top class's traffic
      elseif pool_gated then
        how = gated_how_for_new(i, cost, kv)
      elseif not has_live_waiter(i) then  -- FIFO: no overtaking this class's waiters
        local shared_open = c.can_borrow and state.tokens[i] < cost and shared_open_for(i)
        how = how_to_take(i, cost, shared_open)
      end
      local tenant = nil
      local tenant_wait = 0
      if how ~= 0 and tenant_key then
        tenant = tenant_load(tenant_key, c.tenant_rate, c.tenant_burst)
        if tenant[1] < math.min(cost, tenant[4]) then
          tenant_wait = tenant_wait_ms(tenant, cost)
          how = 0
        end
      end
      if how ~= 0 then
        take(i, cost, how)
        if tenant then
          tenant[1] = tenant[1] - cost
          tenant[5] = true
        end
        local expiry = add_lease(i, lease_key, field, cost, ttl_ms, ARGV[a + 5], ARGV[a + 6],
          ARGV[a + 7], ARGV[a + 8])
        if request_key then
          redis.call('SET', request_key, lease_id .. '|' .. ARGV[a + 1] .. '|' .. expiry,
            'PX', ttl_ms)
        end
        answer(1, 0, lease_id, ARGV[a + 1], num(state.tokens[i]), 0, ttl_ms, 0)
      else
        -- Queue only a request whose wait could cover the refill it needs if nobody
        -- else took tokens meanwhile; any other is told at once.
        -- A GPU-gated pool's request waits for room and its turn, which no refill
        -- predicts: it is queued whenever it may wait.
        local retry
        if pool_gated or held then
          retry = math.max(ROOM_RETRY_MS, tenant_wait)
        else
          retry = math.max(retry_after_ms(i, cost), tenant_wait)
        end
        if held and wait_ms <= 0 then
          answer(0, 8, '', ARGV[a + 1], num(state.tokens[i]), LONG_PREFILL_RETRY_MS, 0, 0)
        elseif wait_ms <= 0 or (not pool_gated and not held and retry > wait_ms) then
          answer(0, 1, '', ARGV[a + 1], num(state.tokens[i]), retry, 0, 0)
        elseif state.waiting[i] >= c.max_queue then
          answer(0, 5, '', ARGV[a + 1], num(state.tokens[i]), retry, 0, 0)
        else
          -- Enqueue; a distinct score per request keeps a batch's order.
          local blocked = 0
          if tenant_wait > 0 then
            blocked = now + tenant_wait * 1000
          end
          redis.call('ZADD', c.queue, enqueued_at, field)
          redis.call('HSET', WAITERS, field, waiter_value({
            enqueued = enqueued_at, deadline = now + wait_ms * 1000, daemon = daemon,
            cost = cost, blocked = blocked, input = input, kv = kv,
          }))
          daemon_seen[daemon] = now
          enqueued_at = enqueued_at + 1
          state.waiting[i] = state.waiting[i] + 1
          state_changed = true
          answer(2, 0, lease_id, ARGV[a + 1], num(state.tokens[i]), 0, 0, 0)
        end
      end
    end
  end
  a = a + 12
end

if enqueued_at > now then  -- its waiters' daemon is alive: say so before anyone checks
  redis.call('HSET', DAEMONS, daemon, now)
end
save_leases()
save_tenants()
save_state()
reply[2] = state.epoch or ''  -- written by save_state() if the state was new
return reply
