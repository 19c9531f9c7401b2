-- Let a daemon's waiters in, in fleet-wide order, and report on the rest.
-- Pool state, policy, budget functions and waiter helpers come from the pool
-- prelude (lua/pool/). A GPU-gated pool is pumped by pump_gated()
-- below; the walk that follows describes the other pools.
--
-- A daemon calls this every few milliseconds while it has waiters in the pool. It
-- walks the heads of all class queues in effective-rank order (aging included):
-- - a head that can be covered now and belongs to this daemon is admitted (a lease
--   is written, its waiter removed);
-- - a head that can be covered now but belongs to another daemon keeps what it
--   needs: if it would borrow, nothing after it may take shared tokens (that daemon
--   admits it on its own next call);
-- - a head that cannot be covered yet, if it may borrow, also closes the shared
--   tokens to everything after it: a lower class must not take what it waits for.
-- A class's own tokens are its own: its head may use them whatever waits elsewhere.
-- Every call also proves this daemon alive, so its waiters are not taken for stale.
--
-- Script arguments (qosd/store/contract.py): PUMP (daemon id, deadline in us of
-- Redis time, 0: none; a pump that runs later was given up by its daemon, which told
-- its callers nothing of it: it admits nobody, and only records the daemon as
-- alive), then WAITER per waiter of this daemon (its field is the waiter id).
-- Keys per waiter: lease hash, then its request-id key and tenant bucket if any.
-- Returns a DECISION per waiter: status (STATUS_ADMITTED; STATUS_WAITING; STATUS_GONE:
-- its entry was dropped as stale; STATUS_HELD: still waiting, held for a gap in the
-- top class's traffic; STATUS_LATE: dropped, as it would now miss its TTFT
-- objective), REASON_NONE, lease_id, charged, remaining, 0, ttl_ms.
local daemon = ARGV[ARGS_BEFORE + ARG_PUMP_DAEMON]
local deadline = tonumber(ARGV[ARGS_BEFORE + ARG_PUMP_DEADLINE_US])
-- Even a late pump proves its daemon alive: it still holds its waiters (it retries a
-- failed pump before it gives them up), so their entries must not go stale.
redis.call('HSET', DAEMONS, daemon, now)
daemon_seen[daemon] = now
if deadline > 0 and now > deadline then
  local late = {}
  for j = 1, tonumber(ARGV[ARG_CALLS]) do
    local n = (j - 1) * DECISION_FIELDS
    for f = 1, DECISION_FIELDS do
      late[n + f] = 0
    end
    late[n + REPLY_DECISION_STATUS] = STATUS_WAITING
  end
  return late
end
-- Every restart brings a new daemon id: forget those silent for long.
if redis.call('HLEN', DAEMONS) > 32 then
  local seen = redis.call('HGETALL', DAEMONS)
  for j = 1, #seen, 2 do
    if tonumber(seen[j + 1]) < now - 10 * stale_after_us then
      redis.call('HDEL', DAEMONS, seen[j])
    end
  end
end

local mine = {}
local order = {}
do
  local k = NEXT_KEY
  local a = ARGS_BEFORE + PUMP_ARGS  -- arguments before this waiter's
  for _ = 1, tonumber(ARGV[ARG_CALLS]) do
    local m = {
      field = ARGV[a + ARG_WAITER_FIELD], class = class_index[ARGV[a + ARG_WAITER_QOS_CLASS]],
      lease_id = ARGV[a + ARG_WAITER_LEASE_ID],
      ttl_ms = tonumber(ARGV[a + ARG_WAITER_TTL_MS]), keep_ms = ARGV[a + ARG_WAITER_KEEP_MS],
      weight = ARGV[a + ARG_WAITER_WEIGHT], input = ARGV[a + ARG_WAITER_INPUT_TOKENS],
      output = ARGV[a + ARG_WAITER_OUTPUT_TOKENS], lease_key = KEYS[k],
    }
    k = k + 1
    if ARGV[a + ARG_WAITER_HAS_REQUEST] == '1' then
      m.request_key = KEYS[k]
      k = k + 1
    end
    if ARGV[a + ARG_WAITER_HAS_TENANT] == '1' then
      m.tenant_key = KEYS[k]
      k = k + 1
    end
    if ARGV[a + ARG_WAITER_FAIR_REFUND] ~= '0' then
      m.fair_key, m.fair_refund = KEYS[k], tonumber(ARGV[a + ARG_WAITER_FAIR_REFUND])
      k = k + 1
    end
    mine[m.field] = m
    order[#order + 1] = m
    a = a + WAITER_ARGS
  end
end

local admitted = 0

-- Over its tenant's ceiling, a waiter steps aside (not holding up other tenants).
-- Returns the tenant bucket to charge (nil without a ceiling), or false if blocked.
local function tenant_for(w, m)
  if not m.tenant_key then
    return nil
  end
  local i = w.class
  local bucket = tenant.bucket(m.tenant_key, classes[i].tenant_rate, classes[i].tenant_burst)
  if bucket[1] < math.min(w.cost, bucket[4]) then
    w.blocked = now + tenant.wait_ms(bucket, w.cost) * 1000
    redis.call('HSET', WAITERS, w.id, waiter_value(w))
    return false
  end
  return bucket
end

local function admit(w, m, how, bucket)
  local i = w.class
  take(i, w.cost, how)
  if bucket then
    bucket[1] = bucket[1] - w.cost
    bucket[5] = true
  end
  if m.fair_key then
    tenant.admitted(i, w.order - m.fair_refund)  -- scored by its finish (tenants.lua)
    tenant.served(i, m.fair_key, tonumber(m.input) + tonumber(m.output))
  end
  local expiry = add_lease(i, m.lease_key, m.field, w.cost, m.ttl_ms, m.keep_ms, m.weight,
    m.input, m.output)
  if m.request_key then
    redis.call('SET', m.request_key, m.lease_id .. '|' .. num(w.cost) .. '|' .. expiry,
      'PX', m.ttl_ms)
  end
  remove_waiter(i, w.id)
  m.cost = w.cost  -- as acquire.lua priced it when it queued the waiter
  m.admitted = true
  admitted = admitted + 1
  m.granted = admitted  -- its daemon answers in this order (contract.Decision.granted)
end

-- A GPU-gated pool: the best-standing head goes when the pool has room for it, if it
-- is this daemon's; another daemon's head holds the room for that daemon's next
-- pump, and a head without room holds it too, except the top class's reserve: past
-- it only top-class heads may go. Returns
-- whether it admitted one.
local function pump_gated()
  local order_heads = heads()
  for _, w in ipairs(order_heads) do
    w.within = standing(w)
    w.gated = gated_rank(w.class, w.rank)
  end
  table.sort(order_heads, function(x, y)
    if x.within ~= y.within then
      return x.within < y.within
    end
    if x.gated ~= y.gated then
      return x.gated < y.gated
    end
    if x.class ~= y.class then
      return x.class < y.class
    end
    return x.order < y.order
  end)
  local blocked = nil  -- the class of the better-standing head without room
  for _, w in ipairs(order_heads) do
    local m = mine[w.id]
    if blocked and not passes_reserve(w.class, blocked, false) then
      -- past a head without room, only the top class, into its reserve
    elseif not has_room(w.class, w.kv, w.input) then
      if blocked or not passes_reserve(1, w.class, false) then
        return false
      end
      blocked = w.class
    elseif not m then
      return false
    else
      local how = gated_how(w.class, w.cost)
      if how ~= 0 then  -- 0: may not go over its share yet; the next may be within its own
        local bucket = tenant_for(w, m)
        if bucket ~= false then
          admit(w, m, how, bucket)
          return true
        end
      end
    end
  end
  return false
end

local progress = true
while progress and admitted < MAX_ADMITTED_PER_PUMP do
  progress = false
  if pool_gated then
    progress = pump_gated()
  else
    local shared_open = true
    for _, w in ipairs(heads()) do
      local i = w.class
      local how = how_to_take(i, w.cost, shared_open)
      local m = mine[w.id]
      if how ~= 0 and m then
        local bucket = tenant_for(w, m)
        if bucket ~= false then
          admit(w, m, how, bucket)
          progress = true
          break  -- the heads changed: walk again
        end
      elseif how ~= 0 then
        if how == TAKE_BORROW then
          shared_open = false  -- kept for another daemon's waiter
        end
      elseif classes[i].can_borrow then
        shared_open = false  -- nothing after it may take what it waits for
      end
    end
  end
end

local reply = {}
local n = 0
for _, m in ipairs(order) do
  local status = STATUS_ADMITTED
  if not m.admitted then
    if by_deadline.late_waiters[m.field] then
      if m.fair_key then
        m.finish = tonumber(redis.call('ZSCORE', classes[m.class].queue, m.field))
      end
      remove_waiter(by_deadline.late_waiters[m.field], m.field)  -- answered REASON_DEADLINE
      status = STATUS_LATE
    elseif redis.call('HEXISTS', WAITERS, m.field) == 0 then
      status = STATUS_GONE
    elseif held_for_gap(m.class, tonumber(m.input)) then
      status = STATUS_HELD
    else
      status = STATUS_WAITING
    end
  end
  if m.fair_key and status == STATUS_LATE then
    tenant.refund(m.class, m.fair_key, m.fair_refund, m.finish)  -- dropped unserved
  end
  reply[n + REPLY_DECISION_STATUS] = status
  reply[n + REPLY_DECISION_REASON] = REASON_NONE
  reply[n + REPLY_DECISION_LEASE_ID] = m.lease_id
  reply[n + REPLY_DECISION_CHARGED] = num(m.cost or 0)
  reply[n + REPLY_DECISION_REMAINING] = num(state.tokens[m.class])
  reply[n + REPLY_DECISION_RETRY_AFTER_MS] = 0
  reply[n + REPLY_DECISION_LEASE_TTL_MS] = m.ttl_ms
  reply[n + REPLY_DECISION_BURST] = num(classes[m.class].burst)
  reply[n + REPLY_DECISION_RATE] = num(classes[m.class].rate)
  reply[n + REPLY_DECISION_REQUESTS] = ''  -- not kept for waiters: they ask no headers
  reply[n + REPLY_DECISION_GRANTED] = m.granted or 0
  n = n + DECISION_FIELDS
end
save_leases()
tenant.save()
save_state()
return reply
