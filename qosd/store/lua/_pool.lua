-- Shared by every pool script: qosd prepends this file to acquire.lua, pump.lua,
-- cancel.lua, release.lua, status.lua and adjust.lua when it loads them (a script
-- cannot import another), after the constants of _contract.lua they use. It restates
-- qosd/budget.py; the conformance suite holds them equal.
--
-- What the arguments and replies hold, in order, and the state hash's fields, are
-- declared once in qosd/store/contract.py; _contract.lua (generated from it) names
-- their positions and codes, and docs/design.md ("Redis layout") shows them.
--
-- KEYS[1]        pool state hash (contract.py: STATE_HASH)
-- KEYS[2..n+1]   one FIFO per class, in priority order: sorted set of waiter ids
--                (lease fields "<class>:<token>") scored by enqueue time, us
-- KEYS[n+2]      waiters hash: waiter id -> "enqueued|deadline|daemon|cost|
--                tenant_blocked_until|input_tokens|kv_tokens" (times in us; kv:
--                prompt plus expected output)
-- KEYS[n+3]      daemons hash: daemon id -> last heard from, us
-- ARGV[ARG_CALLS] number of calls in the batch, then the pool's policy as
--                configured (POOL_ARGS), then per class in priority order
--                (CLASS_ARGS), then the pool's epoch as the calling daemon last saw
--                it and that daemon's nonce (EPOCH_ARGS; see E below)
-- Then the script's own arguments, after ARGS_BEFORE; its keys from KEYS[NEXT_KEY].
--
-- E, the pool's epoch: "<Redis time, us>-<nonce>", written by save_state() when the
-- state is first created and never changed. A store that comes back empty (restart
-- without persistence, FLUSHALL, a failover to an empty replica) loses it with the
-- rest: the next state written gets a new one. Daemons compare the epoch replies
-- carry with the one they knew (qosd/store/redis.py), and the SLO loop's leader then
-- restores the rates and pins it knew (qosd/control.py).

local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])

-- Floats travel as strings (Redis truncates a Lua number to an integer), with all
-- 17 significant digits; tostring() keeps only 14.
local function num(x)
  return string.format('%.17g', x)
end

local p = ARG_CALLS  -- the pool's policy follows the number of calls
local capacity = tonumber(ARGV[p + ARG_POOL_CAPACITY])
local pool_burst_s = tonumber(ARGV[p + ARG_POOL_BURST_S])
local stale_after_us = tonumber(ARGV[p + ARG_POOL_STALE_AFTER_MS]) * 1000
local class_count = tonumber(ARGV[p + ARG_POOL_CLASS_COUNT])
local default_ttl_us = tonumber(ARGV[p + ARG_POOL_LEASE_TTL_MS]) * 1000
local max_in_flight = tonumber(ARGV[p + ARG_POOL_MAX_IN_FLIGHT])
local max_in_flight_tokens = tonumber(ARGV[p + ARG_POOL_MAX_IN_FLIGHT_TOKENS])
local top_reserve = tonumber(ARGV[p + ARG_POOL_TOP_RESERVE])
local prefill_backlog_us = tonumber(ARGV[p + ARG_POOL_PREFILL_BACKLOG_US])
local prefill_share = tonumber(ARGV[p + ARG_POOL_PREFILL_SHARE])
local max_server_waiting = tonumber(ARGV[p + ARG_POOL_MAX_SERVER_WAITING])
local max_kv_cache_usage = tonumber(ARGV[p + ARG_POOL_MAX_KV_CACHE_USAGE])
local server_load_max_age_us = tonumber(ARGV[p + ARG_POOL_SERVER_LOAD_MAX_AGE_US])
local pool_gated = max_in_flight > 0 or max_in_flight_tokens > 0
local classes = {}
local class_index = {}
do
  local a = p + POOL_ARGS
  for i = 1, class_count do
    local c = {
      name = ARGV[a + ARG_CLASS_NAME], rate = tonumber(ARGV[a + ARG_CLASS_RATE]),
      burst = tonumber(ARGV[a + ARG_CLASS_BURST]),
      max_cost = tonumber(ARGV[a + ARG_CLASS_MAX_COST]),
      can_borrow = ARGV[a + ARG_CLASS_CAN_BORROW] == '1',
      max_queue = tonumber(ARGV[a + ARG_CLASS_MAX_QUEUE]),
      aging_us = tonumber(ARGV[a + ARG_CLASS_AGING_MS]) * 1000,
      tenant_rate = tonumber(ARGV[a + ARG_CLASS_TENANT_RATE]),
      tenant_burst = tonumber(ARGV[a + ARG_CLASS_TENANT_BURST]),
      floor_rate = tonumber(ARGV[a + ARG_CLASS_FLOOR_RATE]),
      burst_s = tonumber(ARGV[a + ARG_CLASS_BURST_S]),
      tenant_share = tonumber(ARGV[a + ARG_CLASS_TENANT_SHARE]),
      rank = i - 1, queue = KEYS[i + 1],
    }
    c.nominal_rate, c.nominal_burst, c.nominal_tenant_burst = c.rate, c.burst, c.tenant_burst
    classes[i] = c
    class_index[c.name] = i
    a = a + CLASS_ARGS
  end
end
local e = p + POOL_ARGS + CLASS_ARGS * class_count  -- arguments before the epoch's
local known_epoch = ARGV[e + ARG_EPOCH_KNOWN]
local epoch_nonce = ARGV[e + ARG_EPOCH_NONCE]
local ARGS_BEFORE = e + EPOCH_ARGS  -- the arguments before the script's own
local NEXT_KEY = class_count + 4
local STATE = KEYS[1]
local WAITERS = KEYS[class_count + 2]
local DAEMONS = KEYS[class_count + 3]

-- The pool's policy at the admitted rate R (qosd/budget.py: effective_pool): floors
-- first, then the configured rates in priority order, and what is above them shared.
local free_rate = 0
local shared_burst = 0
local bound_count = 0   -- the in-flight bound at R (configured, shrunk by cuts)
local bound_tokens = 0
local function allocate(rate_total)
  local assigned = 0
  for i = 1, class_count do
    assigned = assigned + classes[i].nominal_rate
  end
  local rates = {}
  if rate_total >= assigned then
    for i = 1, class_count do
      rates[i] = classes[i].nominal_rate
    end
    free_rate = rate_total - assigned
  else
    local left = rate_total
    for i = 1, class_count do
      left = left - classes[i].floor_rate
    end
    left = math.max(0, left)
    for i = 1, class_count do
      local extra = math.min(classes[i].nominal_rate - classes[i].floor_rate, left)
      rates[i] = classes[i].floor_rate + extra
      left = left - extra
    end
    free_rate = 0
  end
  local scale = rate_total / capacity
  for i = 1, class_count do
    local c = classes[i]
    c.rate = rates[i]
    if c.burst_s > 0 then
      c.burst = c.burst_s * rates[i]
    else
      c.burst = c.nominal_burst
    end
    c.tenant_rate = c.tenant_share * rate_total
    c.tenant_burst = c.nominal_tenant_burst * scale
  end
  shared_burst = pool_burst_s * rate_total
  local shrink = math.min(1, scale)  -- follows cuts, never above the servers'
  bound_count = max_in_flight * shrink
  bound_tokens = max_in_flight_tokens * shrink
end

-- The pool's state, refilled to now (qosd/budget.py: fresh_state, refill).
local now_s = math.floor(now / 1000000)
local state = {tokens = {}, waiting = {}, in_n = {}, in_c = {}}
-- Expiry buckets of leases in flight, by second (qosd/budget.py: InFlight): read
-- lazily, each at most once per call, and written back by save_state().
local expiring = {}      -- second -> {class index -> {count, tokens}}
local expiring_dirty = {} -- second -> true when changed
local expiring_gone = {}  -- 'x:<second>' fields to delete
-- Classes this caller's config does not have (a replica on another config, mid-way
-- through a rollout that adds a class): their "name|count|tokens" parts of a second,
-- kept as they are and written back with it, and ended by the sweep by name.
local expiring_other = {}  -- second -> {part, ...}
local function parse_expiring(value, second)
  local entry = {}
  local other = {}
  if value then
    for name, count, tokens in string.gmatch(value, '([^|]+)|([^|]+)|([^|]+)') do
      local i = class_index[name]
      if i then
        entry[i] = {tonumber(count), tonumber(tokens)}
      else
        other[#other + 1] = {name, tonumber(count), tonumber(tokens)}
      end
    end
  end
  if second then
    expiring_other[second] = other
  end
  return entry, other
end
-- A class of another config: its leases in flight, ended without its policy.
local function end_other(name, count, tokens)
  local n, c = unpack(redis.call('HMGET', STATE, 'n:' .. name, 'c:' .. name))
  if n then
    redis.call('HSET', STATE, 'n:' .. name, math.max(0, tonumber(n) - count),
      'c:' .. name, num(math.max(0, (tonumber(c) or 0) - tokens)))
  end
end
local HEADER = 16  -- fields read before the per-class ones
local values_fresh = false  -- no state was found: it is made now
-- Each class's state fields ('t:', 'w:', 'n:', 'c:' and its name), named once a call.
local class_fields = {}
-- The state's fields as read (numbers; nil where absent): save_state() writes only
-- the fields whose value changed. Writing all of them, floats formatted to 17
-- digits, was a fifth of the acquire script's time (docs/performance.md).
local stored = {tokens = {}, waiting = {}, in_n = {}, in_c = {}}
do
  local default_second = math.floor((now + default_ttl_us) / 1000000)
  local fields = {'u', 's', 'R', 'a', 'K', 'xo', 'xn', 'x:' .. default_second, 'P', 'M', 'B',
    'Sw', 'Sk', 'St', 'Bt', 'E'}
  for i = 1, class_count do
    local name = classes[i].name
    local names = {'t:' .. name, 'w:' .. name, 'n:' .. name, 'c:' .. name}
    class_fields[i] = names
    fields[#fields + 1] = names[1]
    fields[#fields + 1] = names[2]
    fields[#fields + 1] = names[3]
    fields[#fields + 1] = names[4]
  end
  local values = redis.call('HMGET', STATE, unpack(fields))
  stored.capacity = tonumber(values[3])
  stored.admitted = tonumber(values[4])
  state.capacity = stored.capacity or capacity
  state.admitted = stored.admitted or 0
  -- R is kept relative to the configured capacity: a pool re-configured (or a fleet
  -- mid-way through a rolling deploy) runs at the same fraction of its capacity.
  local written_under = tonumber(values[5])
  stored.written_under = written_under
  if written_under and written_under > 0 and written_under ~= capacity then
    state.capacity = state.capacity * capacity / written_under
  end
  state.expiry_from = tonumber(values[6])
  state.expiry_to = tonumber(values[7])
  stored.expiry_from = state.expiry_from
  stored.expiry_to = state.expiry_to
  expiring[default_second] = parse_expiring(values[8], default_second)
  state.long_prefill = tonumber(values[9]) or 0
  if values[10] then
    local c, a, b = string.match(values[10], '^([^|]*)|([^|]*)|([^|]*)$')
    state.prefill_model = {tonumber(c), tonumber(a), tonumber(b)}
  end
  stored.prefill_until = tonumber(values[11])
  stored.prefill_real_until = tonumber(values[15])
  state.prefill_until = stored.prefill_until or 0
  state.prefill_real_until = stored.prefill_real_until or 0
  -- The servers' own load (load.lua), while fresh; nil: not known.
  if now - (tonumber(values[14]) or 0) <= server_load_max_age_us then
    state.server_waiting = tonumber(values[12])
    state.server_kv = tonumber(values[13])
  end
  allocate(state.capacity)
  state.epoch = values[16]
  stored.epoch = state.epoch
  if values[1] then
    stored.updated = tonumber(values[1])
    stored.shared = tonumber(values[2])
    state.updated = stored.updated
    state.shared = stored.shared
    for i = 1, class_count do
      local at = HEADER + 4 * (i - 1)
      stored.tokens[i] = tonumber(values[at + 1])
      stored.waiting[i] = tonumber(values[at + 2])
      stored.in_n[i] = tonumber(values[at + 3])
      stored.in_c[i] = tonumber(values[at + 4])
      state.tokens[i] = stored.tokens[i] or classes[i].burst
      state.waiting[i] = stored.waiting[i] or 0
      state.in_n[i] = stored.in_n[i] or 0
      state.in_c[i] = stored.in_c[i] or 0
    end
  else
    -- qosd/budget.py: fresh_state. A new pool starts full; one whose state the caller
    -- saw before (known_epoch) was lost with its store, and starts empty.
    values_fresh = true
    local lost = known_epoch ~= nil and known_epoch ~= ''
    state.updated = now
    state.shared = lost and 0 or shared_burst
    for i = 1, class_count do
      state.tokens[i] = lost and 0 or classes[i].burst
      state.waiting[i] = 0
      state.in_n[i] = 0
      state.in_c[i] = 0
    end
  end
  if now > state.updated then
    local elapsed = now - state.updated
    local shared = state.shared
    for i = 1, class_count do
      local tokens = state.tokens[i] + classes[i].rate * elapsed / 1000000
      if tokens > classes[i].burst then
        shared = shared + tokens - classes[i].burst
        tokens = classes[i].burst
      end
      state.tokens[i] = tokens
    end
    state.shared = math.min(shared_burst, shared + free_rate * elapsed / 1000000)
    state.updated = now
  end
end
-- A state made just now is written even by a call that changes nothing else: it
-- holds the epoch, and a lost pool's empty buckets must refill from now, not start
-- empty again at every call that finds nothing.
local state_changed = values_fresh

-- Leases in flight (qosd/budget.py: InFlight). A lease counts from its admission
-- until it is released or the second of Redis time its expiry falls in has passed.
local function expiring_at(second)
  local entry = expiring[second]
  if entry == nil then
    entry = parse_expiring(redis.call('HGET', STATE, 'x:' .. second), second)
    expiring[second] = entry
  end
  return entry
end

local function lease_started(i, tokens, expiry_us)
  state_changed = true
  state.in_n[i] = state.in_n[i] + 1
  state.in_c[i] = state.in_c[i] + tokens
  local second = math.floor(expiry_us / 1000000)
  local entry = expiring_at(second)
  local counts = entry[i] or {0, 0}
  entry[i] = {counts[1] + 1, counts[2] + tokens}
  expiring_dirty[second] = true
  if state.expiry_from == nil or second < state.expiry_from then
    state.expiry_from = second
  end
  if state.expiry_to == nil or second > state.expiry_to then
    state.expiry_to = second
  end
end

-- A lease released before its expiry second has passed stops counting now; one
-- released later was ended by the sweep already.
local function lease_ended(i, tokens, expiry_us)
  local second = math.floor(expiry_us / 1000000)
  if second < now_s then
    return
  end
  local entry = expiring_at(second)
  local counts = entry[i]
  if counts == nil or counts[1] <= 0 then
    return  -- not counted (admitted before this accounting existed)
  end
  state_changed = true
  entry[i] = {counts[1] - 1, math.max(0, counts[2] - tokens)}
  expiring_dirty[second] = true
  state.in_n[i] = math.max(0, state.in_n[i] - 1)
  state.in_c[i] = math.max(0, state.in_c[i] - tokens)
end

-- End the leases whose expiry second has passed: at most 64 seconds of them per
-- call, so a pool idle for long catches up over its next calls; once the newest
-- second has passed, everything left in flight has expired.
do
  local from = state.expiry_from
  if from and from < now_s then
    if state.expiry_to < now_s then
      for i = 1, class_count do
        state.in_n[i] = 0
        state.in_c[i] = 0
      end
      local fields = redis.call('HKEYS', STATE)
      for _, name in ipairs(fields) do
        local kind = string.sub(name, 1, 2)
        if kind == 'x:' then
          expiring_gone[#expiring_gone + 1] = name
        elseif (kind == 'n:' or kind == 'c:') and not class_index[string.sub(name, 3)] then
          redis.call('HSET', STATE, name, 0)  -- another config's class: none left either
        end
      end
      expiring = {}
      expiring_other = {}
      state.expiry_from = nil
      state.expiry_to = nil
    else
      local last = math.min(now_s - 1, from + 63)
      local names = {}
      for second = from, last do
        names[#names + 1] = 'x:' .. second
      end
      local due = redis.call('HMGET', STATE, unpack(names))
      for j = 1, #names do
        local entry, other = parse_expiring(due[j])
        for i, counts in pairs(entry) do
          state.in_n[i] = math.max(0, state.in_n[i] - counts[1])
          state.in_c[i] = math.max(0, state.in_c[i] - counts[2])
        end
        for _, part in ipairs(other) do
          end_other(part[1], part[2], part[3])
        end
        if due[j] then
          expiring_gone[#expiring_gone + 1] = names[j]
        end
        expiring[from + j - 1] = nil
        expiring_other[from + j - 1] = nil
      end
      state.expiry_from = last + 1
    end
    state_changed = true
  end
end

local function save_state()
  if not state_changed then
    return
  end
  if not state.epoch then  -- created now (or by a version before epochs)
    state.epoch = string.format('%.0f', now) .. '-' .. (epoch_nonce or '')
  end
  local fields = {}
  local n = 0
  local function put(name, value)
    fields[n + 1] = name
    fields[n + 2] = value
    n = n + 2
  end
  if state.updated ~= stored.updated then
    put('u', string.format('%.0f', state.updated))
  end
  if state.shared ~= stored.shared then
    put('s', num(state.shared))
  end
  if state.admitted ~= stored.admitted then
    put('a', num(state.admitted))
  end
  -- R under K, the configured capacity it is relative to: both when either moved.
  if state.capacity ~= stored.capacity or capacity ~= stored.written_under then
    put('R', num(state.capacity))
    put('K', num(capacity))
  end
  if state.epoch ~= stored.epoch then
    put('E', state.epoch)
  end
  for i = 1, class_count do
    local names = class_fields[i]
    if state.tokens[i] ~= stored.tokens[i] then
      put(names[1], num(state.tokens[i]))
    end
    if state.waiting[i] ~= stored.waiting[i] then
      put(names[2], state.waiting[i])
    end
    if state.in_n[i] ~= stored.in_n[i] then
      put(names[3], state.in_n[i])
    end
    if state.in_c[i] ~= stored.in_c[i] then
      put(names[4], num(state.in_c[i]))
    end
  end
  local gone = {}
  for _, name in ipairs(expiring_gone) do
    if not expiring_dirty[tonumber(string.sub(name, 3))] then
      gone[#gone + 1] = name
    end
  end
  for second in pairs(expiring_dirty) do
    local parts = {}
    for i, counts in pairs(expiring[second]) do
      if counts[1] > 0 then
        parts[#parts + 1] = classes[i].name .. '|' .. counts[1] .. '|' .. num(counts[2])
      end
    end
    for _, part in ipairs(expiring_other[second] or {}) do
      parts[#parts + 1] = part[1] .. '|' .. part[2] .. '|' .. num(part[3])
    end
    if #parts > 0 then
      put('x:' .. second, table.concat(parts, '|'))
    else
      gone[#gone + 1] = 'x:' .. second  -- every lease of that second has ended
    end
  end
  if state.prefill_model then
    if state.prefill_until ~= stored.prefill_until then
      put('B', string.format('%.0f', state.prefill_until))
    end
    if state.prefill_real_until ~= stored.prefill_real_until then
      put('Bt', string.format('%.0f', state.prefill_real_until))
    end
  end
  if state.expiry_from then
    if state.expiry_from ~= stored.expiry_from or state.expiry_to ~= stored.expiry_to then
      put('xo', string.format('%.0f', state.expiry_from))
      put('xn', string.format('%.0f', state.expiry_to))
    end
  elseif stored.expiry_from or stored.expiry_to then
    gone[#gone + 1] = 'xo'
    gone[#gone + 1] = 'xn'
  end
  if n > 0 then
    redis.call('HSET', STATE, unpack(fields))
  end
  if #gone > 0 then
    redis.call('HDEL', STATE, unpack(gone))
  end
end

local OWN = 1
local BORROW = 2
local OVER = 3  -- a GPU-gated pool's admission over the class's share, into bounded debt
local ROOM_RETRY_MS = 50  -- a GPU-gated refusal's retry-after: room comes with no refill
local LONG_PREFILL_RETRY_MS = 1000  -- a long prompt's: a hint, gaps are unpredictable

-- qosd/budget.py: how_to_take, take, settle, retry_after_ms, effective_rank.
local function how_to_take(i, cost, shared_open)
  local c = classes[i]
  local own = state.tokens[i]
  if own >= cost then
    return OWN
  end
  if shared_open and c.can_borrow and math.max(own, 0) + state.shared >= cost then
    return BORROW
  end
  if own >= math.min(cost, c.burst) then
    return OWN  -- above the burst, from a full bucket, into debt
  end
  return 0
end

-- GPU-gated pools (qosd/budget.py: has_room, within_share, gated_how).
-- The prefill backlog (qosd/budget.py: prefill_started): an admitted prompt is
-- prefilled after those admitted before it, on the share clock and the real one.
local function prefill_started(input)
  local m = state.prefill_model
  if m then
    local n = tonumber(input)
    local work_us = (m[1] + n * (m[2] + m[3] * n)) * 1000
    state.prefill_until = math.max(now, state.prefill_until) + work_us / prefill_share
    state.prefill_real_until = math.max(now, state.prefill_real_until) + work_us
    state_changed = true
  end
end

local function has_room(i, tokens)
  local count, held = 0, 0
  for j = 1, class_count do
    count = count + state.in_n[j]
    held = held + state.in_c[j]
  end
  if count == 0 then
    return true  -- alone in an idle pool: always, whatever its size
  end
  if state.prefill_model and prefill_backlog_us > 0 then
    -- budget.prefill_lead_us: the top class by the real clock, the others by the share's
    local backlog_end = state.prefill_until
    if i == 1 then
      backlog_end = state.prefill_real_until
    end
    if backlog_end - now > prefill_backlog_us then
      return false  -- the servers' prefill backlog is full: wait here, in priority order
    end
  end
  -- budget.servers_full: below the top class, the servers' own load
  if i ~= 1 and ((max_server_waiting >= 0 and state.server_waiting
      and state.server_waiting > max_server_waiting)
    or (max_kv_cache_usage > 0 and state.server_kv and state.server_kv >= max_kv_cache_usage)) then
    return false
  end
  local share = 1
  if i ~= 1 then
    share = 1 - top_reserve  -- the rest is the top class's alone
  end
  if bound_count > 0 and count + 1 > bound_count * share then
    return false
  end
  return not (bound_tokens > 0 and held + tokens > bound_tokens * share)
end

-- budget.passes_reserve: the top class goes past a better-standing waiter of a lower
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
    return OWN
  end
  if classes[i].can_borrow and math.max(own, 0) + state.shared >= cost then
    return BORROW
  end
  if prefill_backlog_us > 0 and not state.prefill_model then
    return 0  -- room is known only once the prefill backlog can be predicted
  end
  return OVER
end

local function take(i, cost, how)
  state_changed = true
  state.admitted = state.admitted + cost
  if how == OWN then
    state.tokens[i] = state.tokens[i] - cost
    return
  end
  if how == OVER then
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

-- Plain token buckets for tenant ceilings (qosd/budget.py: TenantBucket), read once
-- per script call and written back by save_tenants().
local tenants = {}  -- key -> {tokens, updated, rate, burst, changed}

local function tenant_load(key, rate, burst)
  local bucket = tenants[key]
  if bucket == nil then
    bucket = {burst, now, rate, burst, false}
    local value = redis.call('GET', key)
    if value then
      local stored, stamp = string.match(value, '^([^|]*)|(.*)$')
      bucket[1], bucket[2] = tonumber(stored), tonumber(stamp)
      if now > bucket[2] then
        bucket[1] = math.min(burst, bucket[1] + (now - bucket[2]) * rate / 1000000)
        bucket[2] = now
      end
    end
    tenants[key] = bucket
  end
  return bucket
end

local function tenant_wait_ms(bucket, cost)
  if bucket[3] <= 0 then
    return 1
  end
  return math.max(1, math.ceil((math.min(cost, bucket[4]) - bucket[1]) * 1000 / bucket[3]))
end

local function save_tenants()
  for key, b in pairs(tenants) do
    if b[5] then
      local full_in_ms = 86400000
      if b[3] > 0 then
        full_in_ms = math.ceil(math.max(0, b[4] - b[1]) * 1000 / b[3])
      end
      redis.call('SET', key, num(b[1]) .. '|' .. string.format('%.0f', b[2]),
        'PX', full_in_ms + 1000)
    end
  end
end

-- Waiters. A record: "enqueued|deadline|daemon|cost|tenant_blocked_until|input|kv"
-- (us; input: prompt tokens, kv: prompt plus expected output; both absent in the
-- records of older daemons).
local function parse_waiter(value)
  local enqueued, deadline, daemon, cost, blocked, rest =
    string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  local input, kv = string.match(rest, '^|([^|]*)|([^|]*)$')
  return {
    enqueued = tonumber(enqueued), deadline = tonumber(deadline), daemon = daemon,
    cost = tonumber(cost), blocked = tonumber(blocked), input = tonumber(input) or 0,
    kv = tonumber(kv) or 0,
  }
end

local function waiter_value(w)
  return string.format('%.0f', w.enqueued) .. '|' .. string.format('%.0f', w.deadline) .. '|' ..
    w.daemon .. '|' .. num(w.cost) .. '|' .. string.format('%.0f', w.blocked) .. '|' ..
    string.format('%.0f', w.input) .. '|' .. string.format('%.0f', w.kv)
end

-- A prompt longer than the learned threshold stalls an unchunked server for longer
-- than the top class's requests can absorb: one of another class i waits while the
-- top class has anything in flight or waiting (qosd/budget.py: held_for_gap).
local function held_for_gap(i, input)
  return i ~= 1 and state.long_prefill > 0 and input > state.long_prefill
    and (state.in_n[1] > 0 or state.waiting[1] > 0)
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

-- The first live waiter of each class that has any, looking past waiters blocked by
-- their tenant's ceiling (they must not hold up other tenants; up to LOOKAHEAD of
-- them) and removing the entries of dead daemons, long-expired waits, or entries
-- whose record is missing, on the way.
local PAGE = 8
local LOOKAHEAD = 64
local function heads()
  local found = {}
  for i = 1, class_count do
    if state.waiting[i] > 0 then
      local removed = false
      local start = 0
      local head = nil
      while head == nil and start < LOOKAHEAD do
        local ids = redis.call('ZRANGE', classes[i].queue, start, start + PAGE - 1)
        for _, id in ipairs(ids) do
          local value = redis.call('HGET', WAITERS, id)
          local w = value and parse_waiter(value)
          if not w or not daemon_alive(w.daemon) or w.deadline + stale_after_us < now then
            redis.call('ZREM', classes[i].queue, id)
            redis.call('HDEL', WAITERS, id)
            removed = true
          elseif w.blocked <= now and not held_for_gap(i, w.input) then
            w.id = id
            w.class = i
            w.rank = effective_rank(i, now - w.enqueued)
            head = w
            break
          else
            start = start + 1  -- blocked, or held for a gap: stays, look past it
          end
        end
        if #ids < PAGE then
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
    return x.enqueued < y.enqueued
  end)
  return found
end

-- Has class i a live waiter that is not stepping aside for its tenant's ceiling? A
-- new request of the class must not overtake one (FIFO); blocked ones it may.
local function has_live_waiter(i)
  if state.waiting[i] == 0 then
    return false
  end
  for _, w in ipairs(heads()) do
    if w.class == i then
      return true
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
-- (qosd/budget.py: gated_rank).
local function gated_rank(i, rank)
  if i == 1 then
    return rank
  end
  return math.max(rank, 1)
end

-- A GPU-gated pool's answer for a new request of class i: how it pays, or 0 to wait.
-- It needs room, no waiter of its class (FIFO), and nobody of another class standing
-- better than it, or as well and earlier (qosd/store/embedded.py: _gated_how).
local function gated_how_for_new(i, cost, kv)
  if has_live_waiter(i) or not has_room(i, kv) then
    return 0
  end
  local mine = within_share(i, cost) and 0 or 1
  for _, w in ipairs(heads()) do
    if w.class ~= i and stands_before(standing(w), gated_rank(w.class, w.rank), w.class,
        mine, gated_rank(i, classes[i].rank), i)
        and not passes_reserve(i, w.class, has_room(w.class, w.kv)) then
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

-- Leases (release.lua settles them). A batch writes all its leases with one HSET and
-- one PEXPIRE per lease hash: commands are the expensive part of a script.
local lease_writes = {}  -- lease hash key -> {field, value, ...}
local lease_keep = {}    -- lease hash key -> ms it must live

local function add_lease(i, lease_key, field, cost, ttl_ms, keep_ms, weight, input, output)
  local expiry_us = now + ttl_ms * 1000
  local expiry = string.format('%.0f', expiry_us)
  local writes = lease_writes[lease_key]
  if writes == nil then
    writes = {}
    lease_writes[lease_key] = writes
  end
  writes[#writes + 1] = field
  writes[#writes + 1] = expiry .. '|' .. num(cost) .. '|' .. weight .. '|' .. input .. '|' .. output
  lease_keep[lease_key] = math.max(lease_keep[lease_key] or 0, tonumber(keep_ms))
  lease_started(i, tonumber(input) + tonumber(output), expiry_us)
  if pool_gated then
    prefill_started(input)
  end
  return expiry
end

local function save_leases()
  for key, writes in pairs(lease_writes) do
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIRE', key, lease_keep[key])
  end
end
