-- Tenants within a class: their ceilings (plain token buckets) and, in a class that
-- shares by tokens, their virtual token counters. Each is read once per script call
-- and written back by tenant.save(). One table, not a local per function: a script's
-- main chunk has at most 200 locals.
local tenant = {buckets = {}, records = {}}

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
-- finish tags so that a class's queue stays one sorted set. A tenant's counter is the
-- service it has been charged, per unit of weight. A request of class i starts at
-- the larger of its tenant's counter and the class's virtual time (the start of the
-- last request admitted, as in start-time fair queueing): a tenant back from idle is
-- lifted to where the backlogged ones stand, and banks no credit. It finishes at its
-- start plus its charge, and its queue entry is scored by that finish: the request
-- that leaves its tenant's service least goes first. So a request is weighed with its own size: an idle tenant's 32K-token prompt
-- does not go ahead of the backlogged tenants' short ones as soon as it arrives (by
-- start tags it would, whatever its size), and the service of two backlogged tenants
-- still differs by at most one largest charge of each. Its tenant is charged at once
-- (its next request starts at this one's finish), and the counter expires after the
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

-- A tenant's record in class i, from its key: {counter, served, idle_ms, live,
-- changed}. The key holds "<counter>|<tokens served>" while the tenant is live (charged
-- within the class's idle time), and nothing once it was idle; `served` counts the
-- prompt and output tokens of its admitted requests, estimated at admission and
-- settled at Release: what status shows of it (tenant_status.lua).
function tenant.record(i, key)
  local record = tenant.records[key]
  if record == nil then
    record = {counter = 0, served = 0, idle_ms = classes[i].fair_idle_ms, live = false,
      changed = false}
    local value = redis.call('GET', key)
    if value then
      local counter, served = string.match(value, '^([^|]*)|(.*)$')
      record.counter, record.served, record.live = tonumber(counter), tonumber(served), true
    end
    tenant.records[key] = record
  end
  return record
end

-- Where a request of class i charged `charge`, from the tenant whose counter is at
-- `key`, finishes: its queue score.
function tenant.finish(i, key, charge)
  return math.max(tenant.record(i, key).counter, tenant.virtual_time(i)) + charge
end

-- Charges the tenant up to `finish`; kept for the class's idle time.
function tenant.charge(i, key, finish)
  local record = tenant.record(i, key)
  record.counter, record.live, record.changed = finish, true, true
end

-- The tenant's request of `tokens` (prompt plus expected output) was admitted.
function tenant.served(i, key, tokens)
  local record = tenant.record(i, key)
  record.served, record.live, record.changed = record.served + tokens, true, true
end

-- A lease of class i settled: its tenant's counter (at `key`) moves by the real
-- usage less the estimate it was charged (`input`, `output`), at `charges`
-- ("<per prompt token>|<per output token>"), and its tokens served likewise; `undo`:
-- the admission is undone, and the whole charge comes back. A counter that has
-- expired is left alone: its tenant was idle, and comes back where the backlogged
-- ones stand.
function tenant.settle(i, key, charges, input, output, actual_input, actual_output, undo)
  local per_input, per_output = string.match(charges, '^([^|]*)|(.*)$')
  per_input, per_output = tonumber(per_input), tonumber(per_output)
  input, output = tonumber(input), tonumber(output)
  local input_delta, output_delta = -input, -output
  if not undo then
    input_delta, output_delta = 0, 0
    if actual_input ~= '' then
      input_delta = tonumber(actual_input) - input
    end
    if actual_output ~= '' then
      output_delta = tonumber(actual_output) - output
    end
  end
  local record = tenant.record(i, key)
  if record.live and (input_delta ~= 0 or output_delta ~= 0) then
    record.counter = record.counter + per_input * input_delta + per_output * output_delta
    record.served = math.max(0, record.served + input_delta + output_delta)
    record.changed = true
  end
end

-- A waiter of class i, queued to finish at `finish`, left the queue unserved (timed
-- out, cancelled, or late). If it was its tenant's last charge, the counter goes
-- back to its start, so a tenant whose lone request timed out is not charged for
-- it. Otherwise the tenant's later waiters were queued after it, and the counter
-- stays: taken back, it would let the tenant's next request start ahead of its own
-- queued ones, and a tenant that floods the queue (most of whose waiters time out)
-- would take a request to the front of the class with every one it sends.
function tenant.refund(i, key, charge, finish)
  local record = tenant.record(i, key)
  local counter = record.counter
  if record.live and finish and math.abs(counter - finish) <= 1e-9 * math.max(1, counter) then
    record.counter, record.changed = finish - charge, true
  end
end

-- A request that started at `start` was admitted: the class's virtual time reaches
-- it.
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
  for key, record in pairs(tenant.records) do
    if record.changed then
      redis.call('SET', key, num(record.counter) .. '|' .. num(record.served),
        'PX', record.idle_ms)
    end
  end
  for i = 1, class_count do
    local c = classes[i]
    if c.virtual_time ~= c.virtual_time_read then
      redis.call('HSET', STATE, 'v:' .. c.name, num(c.virtual_time))
    end
  end
end
