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
  if gate.top_peak_half_life_us > 0 and pool_gated then
    -- The top class's demand now: in flight, and its waiters at the mean size of
    -- what it holds (the size of each waiter is in its queue entry, not here).
    local n = state.in_n[1] + state.waiting[1]
    local c = state.in_c[1]
    if state.in_n[1] > 0 then
      c = c * n / state.in_n[1]
    end
    if n > state.top_peak_n or c > state.top_peak_c then  -- a new peak: from now
      state.top_peak_n = math.max(state.top_peak_n, n)
      state.top_peak_c = math.max(state.top_peak_c, c)
      put('Tp', num(state.top_peak_n) .. '|' .. num(state.top_peak_c) .. '|' ..
        string.format('%.0f', now))
    end
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
    if #state.prefill_others == 0 and stored.prefill_others then
      gone[#gone + 1] = 'Bs'  -- one server now: the others' clocks are no more
    elseif #state.prefill_others > 0 then
      local clocks = {}
      for k, clock in ipairs(state.prefill_others) do
        clocks[k] = string.format('%.0f', clock)
      end
      local joined = table.concat(clocks, '|')
      if joined ~= stored.prefill_others then
        put('Bs', joined)
      end
    end
    if state.prefill_top_until ~= stored.prefill_top_until then
      put('Bp', string.format('%.0f', state.prefill_top_until))
    end
    if state.top_blocked_until ~= stored.top_blocked_until then
      put('Bb', string.format('%.0f', state.top_blocked_until))
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
