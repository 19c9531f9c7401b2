-- Leases in flight A lease counts from its admission
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

-- End the leases whose expiry second has passed: at most SWEEP_SECONDS of them per
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
      local last = math.min(now_s - 1, from + SWEEP_SECONDS - 1)
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
