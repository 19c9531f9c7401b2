-- A pool's budget and queues now, read-only: an admin query. From _pool.lua.
-- Returns Redis time (us), shared tokens, admitted rate (R), tokens admitted so far,
-- then per class: tokens, waiters, the enqueue time (us) of the oldest waiter or ''
-- when none waits, rate and burst at R.
local reply = {string.format('%.0f', now), num(state.shared), num(state.capacity),
  num(state.admitted)}
for i = 1, class_count do
  reply[#reply + 1] = num(state.tokens[i])
  reply[#reply + 1] = state.waiting[i]
  local oldest = redis.call('ZRANGE', classes[i].queue, 0, 0, 'WITHSCORES')
  reply[#reply + 1] = oldest[2] or ''
  reply[#reply + 1] = num(classes[i].rate)
  reply[#reply + 1] = num(classes[i].burst)
end
return reply
