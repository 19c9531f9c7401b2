-- Tenants within a class: their ceilings (plain token buckets) and, in a class that
-- shares by tokens, their virtual token counters. Each is read once per script call
-- and written back by tenant.save(). One table, not a local per function: a script's
-- main chunk has at most 200 locals.
local tenant = {buckets = {}, counters = {}}

-- A tenant's ceiling bucket: {tokens, updated, rate, burst, changed}.
function tenant.bucket(key, rate, burst)
  local bucket = tenant.buckets[key]
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
    tenant.buckets[key] = bucket
  end
  return bucket
end

function tenant.wait_ms(bucket, cost)
  if bucket[3] <= 0 then
    return 1
  end
  return math.max(1, math.ceil((math.min(cost, bucket[4]) - bucket[1]) * 1000 / bucket[3]))
end

-- Fair shares by tokens (the Virtual Token Counter, Sheng et al., OSDI '24), kept as
-- start tags so that a class's queue stays one sorted set. A tenant's counter is the
-- service it has been charged, per unit of weight. A request of class i starts at
-- the larger of its tenant's counter and the class's virtual time (the start of the
-- last request admitted): a tenant back from idle is lifted to where the backlogged
-- ones stand, and banks no credit. Its queue entry is scored by that start, so the
-- backlogged tenant with the smallest counter goes first. Its tenant is charged at
-- once (its next request starts after this one), and the counter expires after the
-- class's idle time, so idle tenants leave no state.

-- Class i's virtual time (in the pool's state hash, 'v:<class>').
function tenant.virtual_time(i)
  local c = classes[i]
  if c.virtual_time == nil then
    c.virtual_time = tonumber(redis.call('HGET', STATE, 'v:' .. c.name)) or 0
    c.virtual_time_read = c.virtual_time
  end
  return c.virtual_time
end

-- Where a request of class i from the tenant whose counter is at `key` starts.
function tenant.start(i, key)
  local counter = tenant.counters[key]
  if counter == nil then
    counter = tonumber(redis.call('GET', key)) or 0
    tenant.counters[key] = counter
  end
  return math.max(counter, tenant.virtual_time(i))
end

-- Charges the tenant `charge` from `start`; kept for the class's idle time.
function tenant.charge(i, key, start, charge)
  tenant.counters[key] = start + charge
  redis.call('SET', key, num(start + charge), 'PX', classes[i].fair_idle_ms)
end

-- A lease of class i settled: its tenant's counter (at `key`) moves by the real
-- usage less the estimate it was charged (`input`, `output`), at `charges`
-- ("<per prompt token>|<per output token>"); `undo`: the admission is undone, and
-- the whole charge comes back. A counter that has expired is left alone: its tenant
-- was idle, and comes back where the backlogged ones stand.
function tenant.settle(i, key, charges, input, output, actual_input, actual_output, undo)
  local per_input, per_output = string.match(charges, '^([^|]*)|(.*)$')
  per_input, per_output = tonumber(per_input), tonumber(per_output)
  local delta = -(per_input * tonumber(input) + per_output * tonumber(output))
  if not undo then
    delta = 0
    if actual_input ~= '' then
      delta = delta + per_input * (tonumber(actual_input) - tonumber(input))
    end
    if actual_output ~= '' then
      delta = delta + per_output * (tonumber(actual_output) - tonumber(output))
    end
  end
  local counter = tonumber(redis.call('GET', key))
  if counter and delta ~= 0 then
    redis.call('SET', key, num(counter + delta), 'PX', classes[i].fair_idle_ms)
  end
end

-- A waiter of class i, queued to start at `start`, left the queue unserved (timed
-- out, cancelled, or late). If it was its tenant's last charge, the counter goes
-- back to its start, so a tenant whose lone request timed out is not charged for
-- it. Otherwise the tenant's later waiters were queued after it, and the counter
-- stays: taken back, it would let the tenant's next request start ahead of its own
-- queued ones, and a tenant that floods the queue (most of whose waiters time out)
-- would take a request to the front of the class with every one it sends.
function tenant.refund(i, key, charge, start)
  local counter = tonumber(redis.call('GET', key))
  if counter and start and math.abs(counter - (start + charge)) <= 1e-9 * math.max(1, counter) then
    redis.call('SET', key, num(start), 'PX', classes[i].fair_idle_ms)
  end
end

-- A request that started at `start` was admitted: the class's virtual time reaches it.
function tenant.admitted(i, start)
  if start > tenant.virtual_time(i) then
    classes[i].virtual_time = start
  end
end

function tenant.save()
  for key, b in pairs(tenant.buckets) do
    if b[5] then
      local full_in_ms = 86400000
      if b[3] > 0 then
        full_in_ms = math.ceil(math.max(0, b[4] - b[1]) * 1000 / b[3])
      end
      redis.call('SET', key, num(b[1]) .. '|' .. string.format('%.0f', b[2]),
        'PX', full_in_ms + 1000)
    end
  end
  for i = 1, class_count do
    local c = classes[i]
    if c.virtual_time ~= c.virtual_time_read then
      redis.call('HSET', STATE, 'v:' .. c.name, num(c.virtual_time))
    end
  end
end
