-- The pool prelude, the first of its files (qosd/store/redis.py: POOL_PRELUDE): qosd
-- prepends them, in order, to acquire.lua, pump.lua, cancel.lua, release.lua,
-- status.lua and adjust.lua when it loads them (a script cannot import another),
-- after the constants of _contract.lua they use. This is the one copy of the budget
-- rules: the Redis store runs them in Redis, the embedded store in process.
--
-- args.lua: Redis time, the pool's policy, its classes and keys. allocation.lua: the
-- class rates at the admitted rate. state.lua: the pool's state, refilled to now.
-- in_flight.lua: leases in flight and their sweep. save.lua: writing the state back.
-- budget.lua: paying for an admission. tenants.lua: tenant ceilings. waiters.lua:
-- the waiting room's order. lease_writes.lua: new leases.
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

-- Temporaries live in do-blocks: the prelude and a script share 200 locals.
local now
do
  local parts = redis.call('TIME')
  now = tonumber(parts[1]) * 1000000 + tonumber(parts[2])
end

-- Floats travel as strings (Redis truncates a Lua number to an integer), with all
-- 17 significant digits; tostring() keeps only 14.
local function num(x)
  return string.format('%.17g', x)
end

-- A packed record (qosd/store/contract.py: PACKED): one argument, its fields joined by
-- FIELD_SEPARATOR (\31); a table of them, field k at r[k].
local function record(packed)
  local r, n, from = {}, 1, 1
  while true do
    local at = string.find(packed, '\31', from, true)
    if not at then
      r[n] = string.sub(packed, from)
      return r
    end
    r[n] = string.sub(packed, from, at - 1)
    n, from = n + 1, at + 1
  end
end

local capacity, pool_burst_s, stale_after_us, class_count, default_ttl_us
local max_in_flight, max_in_flight_tokens
-- What keeps a GPU-gated pool's lower classes out: the top class's reserve and the
-- servers' own load. One table: a script's chunk holds at most 200 locals.
local gate
do
  -- The pool's policy, packed, follows the number of calls.
  local r = record(ARGV[ARG_CALLS + ARG_POOL_RECORD])
  capacity = tonumber(r[ARG_POOL_CAPACITY])
  pool_burst_s = tonumber(r[ARG_POOL_BURST_S])
  stale_after_us = tonumber(r[ARG_POOL_STALE_AFTER_MS]) * 1000
  class_count = tonumber(r[ARG_POOL_CLASS_COUNT])
  default_ttl_us = tonumber(r[ARG_POOL_LEASE_TTL_MS]) * 1000
  max_in_flight = tonumber(r[ARG_POOL_MAX_IN_FLIGHT])
  max_in_flight_tokens = tonumber(r[ARG_POOL_MAX_IN_FLIGHT_TOKENS])
  gate = {
    -- The most predicted prefill ahead of an admission, us (0: no bound).
    prefill_backlog_us = tonumber(r[ARG_POOL_PREFILL_BACKLOG_US]),
    -- The configured share of the servers' time lower classes' prefill may take
    -- (budget.lua: predict.prefill_share, without a decode model).
    prefill_share = tonumber(r[ARG_POOL_PREFILL_SHARE]),
    top_reserve = tonumber(r[ARG_POOL_TOP_RESERVE]),
    top_peak_half_life_us = tonumber(r[ARG_POOL_TOP_PEAK_HALF_LIFE_US]),
    top_peak_most = TOP_PEAK_RESERVE_PCT / 100,
    max_server_waiting = tonumber(r[ARG_POOL_MAX_SERVER_WAITING]),
    max_kv_cache_usage = tonumber(r[ARG_POOL_MAX_KV_CACHE_USAGE]),
    server_load_max_age_us = tonumber(r[ARG_POOL_SERVER_LOAD_MAX_AGE_US]),
    -- The servers take the top class's prompts first: it waits behind its own alone.
    servers_by_priority = r[ARG_POOL_SERVERS_BY_PRIORITY] == '1',
    -- > 0: and the prompts in prefill share every pass, each costing a new top-class
    -- prompt this many times its own prefill (budget.lua: predict.top_wait_until).
    shared_pass_stretch = tonumber(r[ARG_POOL_SHARED_PASS_STRETCH]),
    -- A request's cost per expected output token, before its class weight
    -- (formulas.lua: formula.cost).
    output_weight = tonumber(r[ARG_POOL_OUTPUT_WEIGHT]),
    -- Oldest-first servers: the most of the time lower classes' prompts may keep the
    -- top class's next prompt past the backlog bound (budget.lua: predict.top_blocked).
    top_blocked_share = tonumber(r[ARG_POOL_TOP_BLOCKED_SHARE]),
    top_blocked_burst_us = tonumber(r[ARG_POOL_TOP_BLOCKED_BURST_US]),
    -- The servers the prompts are spread over, each taking the next from the earliest
    -- free (budget.lua: prefill_started); 1 where a caller's policy names none.
    servers = math.max(1, tonumber(r[ARG_POOL_SERVERS]) or 1),
  }
end
local pool_gated = max_in_flight > 0 or max_in_flight_tokens > 0
local classes = {}
local class_index = {}
do
  local a = ARG_CALLS + POOL_ARGS
  for i = 1, class_count do
    local r = record(ARGV[a + ARG_CLASS_RECORD])  -- the class's policy, packed
    local c = {
      name = r[ARG_CLASS_NAME], rate = tonumber(r[ARG_CLASS_RATE]),
      burst = tonumber(r[ARG_CLASS_BURST]),
      max_cost = tonumber(r[ARG_CLASS_MAX_COST]),
      can_borrow = r[ARG_CLASS_CAN_BORROW] == '1',
      max_queue = tonumber(r[ARG_CLASS_MAX_QUEUE]),
      aging_us = tonumber(r[ARG_CLASS_AGING_MS]) * 1000,
      tenant_rate = tonumber(r[ARG_CLASS_TENANT_RATE]),
      tenant_burst = tonumber(r[ARG_CLASS_TENANT_BURST]),
      floor_rate = tonumber(r[ARG_CLASS_FLOOR_RATE]),
      burst_s = tonumber(r[ARG_CLASS_BURST_S]),
      tenant_share = tonumber(r[ARG_CLASS_TENANT_SHARE]),
      -- > 0: tenants share the class by tokens, counters kept this long idle (tenants.lua)
      fair_idle_ms = tonumber(r[ARG_CLASS_FAIR_IDLE_MS]),
      rank = i - 1, queue = KEYS[i + 1],
    }
    c.nominal_rate, c.nominal_burst, c.nominal_tenant_burst = c.rate, c.burst, c.tenant_burst
    classes[i] = c
    class_index[c.name] = i
    a = a + CLASS_ARGS
  end
end
-- The arguments before the script's own: the epoch's are the last EPOCH_ARGS of them.
local ARGS_BEFORE = ARG_CALLS + POOL_ARGS + CLASS_ARGS * class_count + EPOCH_ARGS
local known_epoch = ARGV[ARGS_BEFORE - EPOCH_ARGS + ARG_EPOCH_KNOWN]
local epoch_nonce = ARGV[ARGS_BEFORE - EPOCH_ARGS + ARG_EPOCH_NONCE]
local NEXT_KEY = class_count + 4
local STATE = KEYS[1]
local WAITERS = KEYS[class_count + 2]
local DAEMONS = KEYS[class_count + 3]
