-- Take, renew or hand back the fleet's controller lease: whoever holds it runs the
-- SLO loop. KEYS[1] leader key; ARGV: daemon id, lease_ms (0: hand it back if held).
-- Returns the leader's id ('' when none).
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  if holder == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return ''
  end
  return holder or ''
end
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return holder
