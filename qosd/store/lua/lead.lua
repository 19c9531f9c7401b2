-- Take, renew or hand back the fleet's controller lease: whoever holds it runs the
-- SLO loop. KEYS[1] leader key; ARGV: LEAD (qosd/store/contract.py): daemon id,
-- lease_ms (0: hand it back if held). Returns the leader's id ('' when none).
local daemon = ARGV[ARG_LEAD_DAEMON]
local lease_ms = ARGV[ARG_LEAD_LEASE_MS]
local holder = redis.call('GET', KEYS[1])
if lease_ms == '0' then
  if holder == daemon then
    redis.call('DEL', KEYS[1])
    return ''
  end
  return holder or ''
end
if not holder or holder == daemon then
  redis.call('SET', KEYS[1], daemon, 'PX', lease_ms)
  return daemon
end
return holder
