-- Admit, queue or reject a batch of requests of one pool, in order, atomically.
-- One request is a batch of one. The pool state, policy, budget functions and
-- waiter helpers come from the pool prelude (lua/pool/).
--
-- Script arguments (qosd/store/contract.py): ACQUIRE (the deadline in us of Redis
-- time, 0: none, a batch that runs later was given up by its callers and changes
-- nothing; the daemon's id), then REQUEST per request, packed in one argument (the lease field
-- "<class>:<token>" is also the waiter id; keep_ms is how long the lease hash must
-- live; wait_ms 0: answer now; ttft_ms, the request's TTFT objective, makes its queue
-- entry due at arrival plus that, and with a prefill model sets its wait: deadline.lua).
-- Keys per request: lease hash, then the request-id key and the tenant bucket if any.
-- Request-id string: "lease_id|charged|expiry_us" for an admission, "lease_id|Q|
-- deadline_us" for a request queued: while it lives, the id names that one request,
-- and another request under it gets STATUS_DUPLICATE (run on the first one's lease,
-- it would go past admission; a released id admits nothing until the key expires).
--
-- Returns HEADER (Redis time, us, string; the pool's epoch, '' while its state was
-- never written: pool/state.lua), then a DECISION per request: status (STATUS_REJECTED,
-- STATUS_ADMITTED or STATUS_QUEUED), reason, lease_id, charged, remaining,
-- retry_after_ms (when queued: the wait granted), lease_ttl_ms, and the class's
-- bucket and the pool's room (answer(), below).
local reply = {}
reply[REPLY_HEADER_NOW_US] = string.format('%.0f', now)
reply[REPLY_HEADER_EPOCH] = state.epoch or ''
local n = HEADER_FIELDS
-- An answer for class i's request (i nil: the batch ran too late; nothing known):
-- with the class's bucket after it (level, burst and rate at R) and the requests the
-- in-flight bound has left and the bound ("left|bound"; '': no such bound), for the
-- caller's rate-limit headers.
local function answer(status, reason, lease_id, cost, i, retry_ms, ttl_ms)
  reply[n + REPLY_DECISION_STATUS] = status
  reply[n + REPLY_DECISION_REASON] = reason
  reply[n + REPLY_DECISION_LEASE_ID] = lease_id
  reply[n + REPLY_DECISION_CHARGED] = num(cost)
  reply[n + REPLY_DECISION_RETRY_AFTER_MS] = retry_ms
  reply[n + REPLY_DECISION_LEASE_TTL_MS] = ttl_ms
  local room = ''
  if i and bound_count > 0 then
    local left = bound_count
    for j = 1, class_count do
      left = left - state.in_n[j]
    end
    room = string.format('%.0f|%.0f', math.max(0, math.floor(left)), math.floor(bound_count))
  end
  reply[n + REPLY_DECISION_REQUESTS] = room
  reply[n + REPLY_DECISION_REMAINING] = i and num(state.tokens[i]) or '0'
  reply[n + REPLY_DECISION_BURST] = i and num(classes[i].burst) or '0'
  reply[n + REPLY_DECISION_RATE] = i and num(classes[i].rate) or '0'
  reply[n + REPLY_DECISION_GRANTED] = 0
  n = n + DECISION_FIELDS
end

local daemon = ARGV[ARGS_BEFORE + ARG_ACQUIRE_DAEMON]
do  -- a block: the chunk holds at most 200 locals
  local deadline = tonumber(ARGV[ARGS_BEFORE + ARG_ACQUIRE_DEADLINE_US])
  if deadline > 0 and now > deadline then
    for _ = 1, tonumber(ARGV[ARG_CALLS]) do
      answer(STATUS_REJECTED, REASON_BACKEND_UNAVAILABLE, '', 0, nil, 0, 0)
    end
    return reply
  end
end

local k = NEXT_KEY
local a = ARGS_BEFORE + ACQUIRE_ARGS  -- arguments before this request's
local enqueued_at = now
for _ = 1, tonumber(ARGV[ARG_CALLS]) do
  local r = record(ARGV[a + ARG_REQUEST_RECORD])  -- its RequestArgs, packed
  local i = class_index[r[ARG_REQUEST_QOS_CLASS]]
  local c = classes[i]
  local input = tonumber(r[ARG_REQUEST_INPUT_TOKENS])
  local cost = formula.cost(input, r[ARG_REQUEST_OUTPUT_TOKENS],
    r[ARG_REQUEST_WEIGHT], gate.output_weight)
  if r[ARG_REQUEST_ESTIMATED] == '1' then  -- settled from the real usage
    cost = math.min(cost, c.max_cost)
  end
  -- Read from the record where used (the chunk holds at most 200 locals).
  r[ARG_REQUEST_TTL_MS] = tonumber(r[ARG_REQUEST_TTL_MS])
  r[ARG_REQUEST_TTFT_MS] = tonumber(r[ARG_REQUEST_TTFT_MS])
  local wait_ms = tonumber(r[ARG_REQUEST_WAIT_MS])
  -- Its keys, kept on the record too (the chunk holds at most 200 locals).
  r.lease_key = KEYS[k]
  k = k + 1
  if r[ARG_REQUEST_HAS_REQUEST] == '1' then
    r.request_key = KEYS[k]
    k = k + 1
  end
  if r[ARG_REQUEST_HAS_TENANT] == '1' then
    r.tenant_key = KEYS[k]
    k = k + 1
  end
  -- A class that shares by tokens: the tenant's counter key, and what it is charged.
  local fair = nil
  if r[ARG_REQUEST_FAIR_CHARGE] ~= '0' then
    fair = {key = KEYS[k], charge = tonumber(r[ARG_REQUEST_FAIR_CHARGE])}
    k = k + 1
  end

  if r.request_key and redis.call('GET', r.request_key) then
    answer(STATUS_DUPLICATE, REASON_NONE, '', cost, i, 0, 0)
  else
    if cost > c.max_cost then
      answer(STATUS_REJECTED, REASON_COST_EXCEEDS_BURST, '', cost, i, 0, 0)
    else
      local how = 0
      local kv = input + tonumber(r[ARG_REQUEST_OUTPUT_TOKENS])
      local due = by_deadline.due_us(enqueued_at, r[ARG_REQUEST_TTFT_MS])
      local order = by_deadline.order_us(due, enqueued_at, input)
      if fair then
        order = tenant.finish(i, fair.key, fair.charge)  -- by tenants' service, not due time
      end
      local wait_cap_ms = tonumber(r[ARG_REQUEST_WAIT_CAP_MS])
      wait_ms = by_deadline.granted_wait_ms(i, wait_ms, r[ARG_REQUEST_TTFT_MS], wait_cap_ms, input)
      local held = held_for_gap(i, input)
      if held then
        how = 0  -- waits for a gap in the top class's traffic
      elseif pool_gated then
        how = gated_how_for_new(i, cost, kv, order, input)
      elseif not has_live_waiter(i, order) then  -- no overtaking a waiter placed before
        local shared_open = c.can_borrow and state.tokens[i] < cost and shared_open_for(i)
        how = how_to_take(i, cost, shared_open)
      end
      local miss_ms = nil
      if not held then
        miss_ms = by_deadline.miss_ms(i, r[ARG_REQUEST_TTFT_MS], input, how ~= 0)
      end
      local bucket = nil
      local tenant_wait = 0
      if miss_ms then
        how = 0  -- refused below: late whenever it went
      elseif how ~= 0 and r.tenant_key then
        bucket = tenant.bucket(r.tenant_key, c.tenant_rate, c.tenant_burst)
        if bucket[1] < math.min(cost, bucket[4]) then
          tenant_wait = tenant.wait_ms(bucket, cost)
          how = 0
        end
      end
      if how ~= 0 then
        take(i, cost, how)
        if bucket then
          bucket[1] = bucket[1] - cost
          bucket[5] = true
        end
        if fair then
          tenant.charge(i, fair.key, order)
          tenant.served(i, fair.key, kv)
          tenant.admitted(i, order - fair.charge)
        end
        local expiry = add_lease(i, r.lease_key, r[ARG_REQUEST_FIELD], cost,
          r[ARG_REQUEST_TTL_MS],
          r[ARG_REQUEST_KEEP_MS], r[ARG_REQUEST_WEIGHT],
          r[ARG_REQUEST_INPUT_TOKENS], r[ARG_REQUEST_OUTPUT_TOKENS])
        if r.request_key then
          redis.call('SET', r.request_key,
            r[ARG_REQUEST_LEASE_ID] .. '|' .. num(cost) .. '|' .. expiry,
            'PX', r[ARG_REQUEST_TTL_MS])
        end
        answer(STATUS_ADMITTED, REASON_NONE, r[ARG_REQUEST_LEASE_ID], cost, i, 0,
          r[ARG_REQUEST_TTL_MS])
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
        if miss_ms then
          answer(STATUS_REJECTED, REASON_DEADLINE, '', cost, i, miss_ms, 0)
        elseif held and wait_ms <= 0 then
          answer(STATUS_REJECTED, REASON_LONG_PREFILL, '', cost, i,
            math.max(LONG_PREFILL_RETRY_MS, predict.top_blocked_wait_ms(i, input)), 0)
        elseif wait_ms <= 0 or (not pool_gated and not held and retry > wait_ms) then
          answer(STATUS_REJECTED, REASON_RATE_LIMITED, '', cost, i, retry, 0)
        elseif state.waiting[i] >= c.max_queue then
          answer(STATUS_REJECTED, REASON_QUEUE_FULL, '', cost, i, retry, 0)
        else
          -- Enqueue; a distinct score per request keeps a batch's order.
          local blocked = 0
          if tenant_wait > 0 then
            blocked = now + tenant_wait * 1000
          end
          redis.call('ZADD', c.queue, order, r[ARG_REQUEST_FIELD])
          if fair then
            tenant.charge(i, fair.key, order)  -- its next request starts after
          end
          redis.call('HSET', WAITERS, r[ARG_REQUEST_FIELD], waiter_value({
            enqueued = enqueued_at, deadline = now + wait_ms * 1000, daemon = daemon,
            cost = cost, blocked = blocked, input = input, kv = kv, due = due,
          }))
          if r.request_key then  -- the id is this waiter's while it may wait
            redis.call('SET', r.request_key,
              r[ARG_REQUEST_LEASE_ID] .. '|Q|' .. string.format('%.0f', now + wait_ms * 1000),
              'PX', wait_ms)
          end
          daemon_seen[daemon] = now
          enqueued_at = enqueued_at + 1
          state.waiting[i] = state.waiting[i] + 1
          state_changed = true
          answer(STATUS_QUEUED, REASON_NONE, r[ARG_REQUEST_LEASE_ID], cost, i, wait_ms, 0)
        end
      end
    end
  end
  a = a + REQUEST_ARGS
end

if enqueued_at > now then  -- its waiters' daemon is alive: say so before anyone checks
  redis.call('HSET', DAEMONS, daemon, now)
end
save_leases()
tenant.save()
save_state()
reply[REPLY_HEADER_EPOCH] = state.epoch or ''  -- written by save_state() if the state was new
return reply
