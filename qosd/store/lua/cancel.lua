-- Take waiters out of their queues: their caller timed out or went away. A waiter
-- holds no tokens, so nothing else changes. Pool state and helpers from _pool.lua.
-- Script arguments per waiter (2): lease field (the waiter id), class.
-- Returns per waiter: 1 if it was still waiting, 0 if it was not there.
local reply = {}
local a = NEXT_ARG
for r = 1, tonumber(ARGV[1]) do
  -- The queue entry goes even when its record is missing (it must not linger).
  reply[r] = remove_waiter(class_index[ARGV[a + 1]], ARGV[a])
  a = a + 2
end
save_state()
return reply
