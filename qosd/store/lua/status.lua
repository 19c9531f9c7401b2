-- A pool's budget and queues now, read-only: an admin query. From the pool prelude.
-- Returns (qosd/store/contract.py) STATUS: Redis time (us), shared tokens, admitted
-- rate (R), tokens admitted so far, the long-prefill threshold (0: none), the prefill
-- backlog (us of predicted prefill admitted and not yet done, on the real clock), the
-- most the shared tokens hold at R (allocation.lua); then a
-- STATUS_CLASS per class: tokens, waiters, the enqueue time (us) of the waiter at the
-- head of its queue (the earliest due; in a class without objectives the oldest) or
-- '' when none waits, rate and burst at R, leases in flight and their prompt plus
-- expected output tokens; then STATUS_SERVERS: the servers' waiting requests and KV
-- cache usage ('' when not known). Costs O(classes), never O(leases): the counts are
-- kept by the scripts that change them.
local reply = {}
reply[REPLY_STATUS_NOW_US] = string.format('%.0f', now)
reply[REPLY_STATUS_SHARED] = num(state.shared)
reply[REPLY_STATUS_CAPACITY] = num(state.capacity)
reply[REPLY_STATUS_ADMITTED] = num(state.admitted)
reply[REPLY_STATUS_LONG_PREFILL] = num(state.long_prefill)
reply[REPLY_STATUS_PREFILL_BACKLOG_US] =
  string.format('%.0f', math.max(0, state.prefill_real_until - now))
reply[REPLY_STATUS_SHARED_BURST] = num(shared_burst)
local n = STATUS_FIELDS
for i = 1, class_count do
  local head = redis.call('ZRANGE', classes[i].queue, 0, 0)[1]
  local record = head and redis.call('HGET', WAITERS, head)
  local oldest = record and string.format('%.0f', parse_waiter(record).enqueued)
  reply[n + REPLY_STATUS_CLASS_TOKENS] = num(state.tokens[i])
  reply[n + REPLY_STATUS_CLASS_WAITING] = state.waiting[i]
  reply[n + REPLY_STATUS_CLASS_OLDEST_US] = oldest or ''
  reply[n + REPLY_STATUS_CLASS_RATE] = num(classes[i].rate)
  reply[n + REPLY_STATUS_CLASS_BURST] = num(classes[i].burst)
  reply[n + REPLY_STATUS_CLASS_IN_FLIGHT] = state.in_n[i]
  reply[n + REPLY_STATUS_CLASS_IN_FLIGHT_TOKENS] = num(state.in_c[i])
  n = n + STATUS_CLASS_FIELDS
end
-- The servers' load while fresh ('' unknown)
reply[n + REPLY_STATUS_SERVERS_WAITING] =
  state.server_waiting and string.format('%.0f', state.server_waiting) or ''
reply[n + REPLY_STATUS_SERVERS_KV_USAGE] = state.server_kv and num(state.server_kv) or ''
return reply
