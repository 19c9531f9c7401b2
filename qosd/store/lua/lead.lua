-- Take or renew the fleet's controller lease: whoever holds it runs the SLO loop.
-- KEYS[1] leader key; ARGV: daemon id, lease_ms. Returns the leader's id.
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return holder
