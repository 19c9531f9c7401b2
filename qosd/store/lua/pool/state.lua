-- The pool's state, refilled to now (a new pool starts full).
local now_s = math.floor(now / 1000000)
local state = {tokens = {}, waiting = {}, in_n = {}, in_c = {}}
-- What the pool's learned models predict (formulas.lua states each model): one
-- table, not a local per function (a script's main chunk has at most 200 locals).
-- Its rules are in budget.lua and deadline.lua; the servers' clocks, which the state
-- is read with, here.
local predict = {}
-- A prompt whose prefill, on the earliest free server, ends at `ends` (us): that
-- server's clock becomes `ends`, and the earliest free is then the first of the
-- servers' clocks to run out (Bt; the others in `state.prefill_others`).
function predict.onto_earliest_server(ends)
  local others = state.prefill_others
  local earliest = 0
  for k = 1, #others do
    if others[k] < ends and (earliest == 0 or others[k] < others[earliest]) then
      earliest = k
    end
  end
  if earliest == 0 then
    return ends
  end
  ends, others[earliest] = others[earliest], ends
  return ends
end

-- Expiry buckets of leases in flight, by second: read
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
    'Sw', 'Sk', 'St', 'Bt', 'E', 'Tp', 'Bp', 'D', 'Bb', 'Pi', 'Bs'}
  local header = #fields  -- fields read before the per-class ones
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
  state.long_prefill_idle = tonumber(values[21]) or 0  -- prefill.lua: the idle threshold
  if values[10] then
    local c, a, b = string.match(values[10], '^([^|]*)|([^|]*)|([^|]*)$')
    state.prefill_model = {tonumber(c), tonumber(a), tonumber(b)}
  end
  -- The decode model (formulas.lua: decode_step_ms), whether a prefill pass also
  -- decodes (chunked prefill), and each class's TPOT target.
  if values[19] then
    local parts = {}
    for part in string.gmatch(values[19], '[^|]+') do
      parts[#parts + 1] = tonumber(part)
    end
    if #parts == 3 + class_count then
      local targets = {}
      for i = 1, class_count do
        if parts[3 + i] > 0 then
          targets[i] = parts[3 + i]
        end
      end
      state.decode_model = {parts[1], parts[2], chunked = parts[3] == 1, targets = targets}
    end
  end
  stored.prefill_until = tonumber(values[11])
  stored.prefill_real_until = tonumber(values[15])
  state.prefill_until = stored.prefill_until or 0
  state.prefill_real_until = stored.prefill_real_until or 0
  stored.prefill_top_until = tonumber(values[18])
  state.prefill_top_until = stored.prefill_top_until or 0
  stored.top_blocked_until = tonumber(values[20])
  state.top_blocked_until = stored.top_blocked_until or 0
  -- The other servers' real prefill clocks (pools of more than one server): Bt is
  -- the earliest free, these the rest, as many as the policy's servers less one.
  -- A policy of fewer servers than the clocks stored keeps the earliest (the
  -- servers still there are not known); of more, adds idle ones; either way Bt is
  -- then made the earliest again (predict.onto_earliest_server keeps it so).
  stored.prefill_others = values[22]
  state.prefill_others = {}
  if gate.servers > 1 then
    for clock in string.gmatch(values[22] or '', '[^|]+') do
      state.prefill_others[#state.prefill_others + 1] = tonumber(clock) or 0
    end
    if #state.prefill_others >= gate.servers then
      table.sort(state.prefill_others)
      for k = #state.prefill_others, gate.servers, -1 do
        state.prefill_others[k] = nil
      end
    end
    for k = #state.prefill_others + 1, gate.servers - 1 do
      state.prefill_others[k] = 0
    end
    state.prefill_real_until = predict.onto_earliest_server(state.prefill_real_until)
  end
  -- The servers' own load (load.lua), while fresh; nil: not known.
  if now - (tonumber(values[14]) or 0) <= gate.server_load_max_age_us then
    state.server_waiting = tonumber(values[12])
    state.server_kv = tonumber(values[13])
  end
  allocate(state.capacity)
  state.epoch = values[16]
  stored.epoch = state.epoch
  -- The top class's peak demand (budget.lua: has_room), decayed from when it was set
  -- to now; written again only when a new peak passes it (save.lua).
  state.top_peak_n, state.top_peak_c = 0, 0
  if values[17] and gate.top_peak_half_life_us > 0 then
    local n, c, at = string.match(values[17], '^([^|]*)|([^|]*)|([^|]*)$')
    local decay = 0.5 ^ (math.max(0, now - (tonumber(at) or now)) / gate.top_peak_half_life_us)
    state.top_peak_n, state.top_peak_c = (tonumber(n) or 0) * decay, (tonumber(c) or 0) * decay
  end
  if values[1] then
    stored.updated = tonumber(values[1])
    stored.shared = tonumber(values[2])
    state.updated = stored.updated
    state.shared = stored.shared
    for i = 1, class_count do
      local at = header + 4 * (i - 1)
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
    -- A new pool starts full; one whose state the caller
    -- saw before (known_epoch) was lost with its store, and starts empty.
    values_fresh = true
    local lost = known_epoch ~= nil and known_epoch ~= ''
    state.updated = now
    -- The bucket of the top class's blocked time starts empty, not full as the
    -- class buckets do: its share is earned while the top class has traffic, and a
    -- new pool has earned none. Full, it let the first 32K prompt of a run block P0
    -- for 3 s before any threshold was learned (Azure 1.5x chunked, development
    -- seed 10: 10 of P0's 18 misses; ADR 16).
    state.top_blocked_until = now
    state.shared = lost and 0 or shared_burst
    for i = 1, class_count do
      state.tokens[i] = lost and 0 or classes[i].burst
      state.waiting[i] = 0
      state.in_n[i] = 0
      state.in_c[i] = 0
    end
  end
  -- No lease in flight: the servers hold no prompt qosd admitted, so the prefill
  -- clocks' lead (budget.lua: prefill_started) is spent. The share clock's lead is a
  -- debt the streams in flight repay by decoding slower; with none left, nobody
  -- owes it. Kept, it grew by every prompt let into the empty pool, and lower
  -- classes went in one at a time as the pool drained (Mooncake: 5 to 19 s ahead).
  local leases = 0
  for i = 1, class_count do
    leases = leases + state.in_n[i]
  end
  if leases == 0 then
    state.prefill_until = math.min(state.prefill_until, now)
    state.prefill_real_until = math.min(state.prefill_real_until, now)
    state.prefill_top_until = math.min(state.prefill_top_until, now)
    for k, clock in ipairs(state.prefill_others) do
      state.prefill_others[k] = math.min(clock, now)
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
