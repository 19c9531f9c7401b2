-- The pool's policy at the admitted rate R : floors
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
