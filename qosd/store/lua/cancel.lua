-- Take waiters out of their queues: their caller timed out or went away. A waiter
-- holds no tokens, so nothing else changes, but in a class that shares by tokens its
-- tenant gets back what queueing it charged. Pool state and helpers from the pool
-- prelude.
-- Script arguments: CANCEL per waiter (qosd/store/contract.py: its lease field, the
-- waiter id, its class, the charge to refund, has_request). Keys per waiter: its
-- request-id key where has_request (freed if it still names the waiter: the retry
-- its refusal invites is a new request, not a reuse), then its tenant's counter, for
-- a waiter with a refund.
-- Returns CANCELLED per waiter: 1 if it was still waiting, 0 if it was not there.
local reply = {}
local a = ARGS_BEFORE
local k = NEXT_KEY
for r = 1, tonumber(ARGV[ARG_CALLS]) do
  local i = class_index[ARGV[a + ARG_CANCEL_QOS_CLASS]]
  local fair = ARGV[a + ARG_CANCEL_FAIR_REFUND] ~= '0'
  if ARGV[a + ARG_CANCEL_HAS_REQUEST] == '1' then
    free_request_id(KEYS[k], ARGV[a + ARG_CANCEL_FIELD])
    k = k + 1
  end
  local finish = nil
  if fair then
    finish = tonumber(redis.call('ZSCORE', classes[i].queue, ARGV[a + ARG_CANCEL_FIELD]))
  end
  -- The queue entry goes even when its record is missing (it must not linger).
  local removed = remove_waiter(i, ARGV[a + ARG_CANCEL_FIELD])
  reply[(r - 1) * CANCELLED_FIELDS + REPLY_CANCELLED_REMOVED] = removed
  if fair then
    if removed == 1 then
      tenant.refund(i, KEYS[k], tonumber(ARGV[a + ARG_CANCEL_FAIR_REFUND]), finish)
    end
    k = k + 1
  end
  a = a + CANCEL_ARGS
end
tenant.save()
save_state()
return reply
