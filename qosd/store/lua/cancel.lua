-- Take waiters out of their queues: their caller timed out or went away. A waiter
-- holds no tokens, so nothing else changes. Pool state and helpers from the pool prelude.
-- Script arguments: CANCEL per waiter (qosd/store/contract.py: its lease field, the
-- waiter id, and class).
-- Returns CANCELLED per waiter: 1 if it was still waiting, 0 if it was not there.
local reply = {}
local a = ARGS_BEFORE
for r = 1, tonumber(ARGV[ARG_CALLS]) do
  -- The queue entry goes even when its record is missing (it must not linger).
  reply[(r - 1) * CANCELLED_FIELDS + REPLY_CANCELLED_REMOVED] =
    remove_waiter(class_index[ARGV[a + ARG_CANCEL_QOS_CLASS]], ARGV[a + ARG_CANCEL_FIELD])
  a = a + CANCEL_ARGS
end
save_state()
return reply
