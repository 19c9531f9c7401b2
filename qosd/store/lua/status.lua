-- A pool's budget and queues now, read-only: an admin query. From _pool.lua.
-- Returns Redis time (us), shared tokens, admitted rate (R), tokens admitted so far,
-- the long-prefill threshold (0: none), then per class: tokens, waiters, the enqueue time (us) of the oldest waiter or ''
-- when none waits, rate and burst at R, leases in flight and their prompt plus expected output tokens;
-- then the servers' waiting requests and KV cache usage ('' when not known). Costs
-- O(classes), never O(leases): the counts are kept by the scripts that change them.
local reply = {string.format('%.0f', now), num(state.shared), num(state.capacity),
  num(state.admitted), num(state.long_prefill)}
for i = 1, class_count do
  reply[#reply + 1] = num(state.tokens[i])
  reply[#reply + 1] = state.waiting[i]
  local oldest = redis.call('ZRANGE', classes[i].queue, 0, 0, 'WITHSCORES')
  reply[#reply + 1] = oldest[2] or ''
  reply[#reply + 1] = num(classes[i].rate)
  reply[#reply + 1] = num(classes[i].burst)
  reply[#reply + 1] = state.in_n[i]
  reply[#reply + 1] = num(state.in_c[i])
end
-- The servers' load while fresh ('' unknown)
reply[#reply + 1] = state.server_waiting and string.format('%.0f', state.server_waiting) or ''
reply[#reply + 1] = state.server_kv and num(state.server_kv) or ''
return reply
