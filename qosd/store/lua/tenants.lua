-- Named tenants of classes that share by tokens, read-only: an admin query.
-- Script arguments: TENANT per tenant asked (qosd/store/contract.py: its digest).
-- Keys per tenant asked: its class's queue, then its counter.
-- Returns TENANT_STATUS per tenant asked: its counter ('' while it is idle), the
-- tokens it was served while live, and its waiters in the class's queue.
-- Costs one read of each queue asked about (O(its waiters), bounded by the class's
-- max_queue), so the status scrape, which asks about no tenant, stays O(classes).
local waiting_in = {}  -- queue key -> waiters per tenant digest
local reply = {}
local n = 0
for t = 1, #ARGV / TENANT_ARGS do
  local queue = KEYS[2 * t - 1]
  local waiting = waiting_in[queue]
  if waiting == nil then
    waiting = {}
    for _, field in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
      local digest = string.match(field, '%-(%x+)$')  -- a fair class's lease token ends in it
      if digest then
        waiting[digest] = (waiting[digest] or 0) + 1
      end
    end
    waiting_in[queue] = waiting
  end
  local counter, served = '', '0'
  local value = redis.call('GET', KEYS[2 * t])
  if value then
    counter, served = string.match(value, '^([^|]*)|(.*)$')
  end
  reply[n + REPLY_TENANT_STATUS_COUNTER] = counter
  reply[n + REPLY_TENANT_STATUS_SERVED] = served
  local digest = ARGV[(t - 1) * TENANT_ARGS + ARG_TENANT_DIGEST]
  reply[n + REPLY_TENANT_STATUS_WAITING] = waiting[digest] or 0
  n = n + TENANT_STATUS_FIELDS
end
return reply
