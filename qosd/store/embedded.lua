-- The embedded store's keyspace: the Redis commands qosd's scripts use, on Lua tables,
-- with Redis 7's replies and errors. qosd/store/lua_host.py loads it into the Lua
-- state that runs the scripts, so that redis.call never leaves Lua. Not a Redis
-- script: Redis never sees this file.
--
-- Values: a string; or a hash {kind = 'hash', fields = {}, n = count}; a sorted set
-- {kind = 'zset', scores = {member = score}, order = {{score, member}, ...}, n};
-- a list {kind = 'list', items = {...}} (items[1] is the head). Expiry in ms of the
-- host's clock, which the host sets before every call (NOW_US); a heap of expiry
-- times lets expire_due() drop every key whose time has come, so that keys that
-- expired leave nothing behind whether or not anything reads them again.

local data = {}
local expires = {}        -- key -> expiry, ms
local heap = {}           -- binary heap of {ms, key}, possibly stale
NOW_US = 0

local WRONGTYPE = 'WRONGTYPE Operation against a key holding the wrong kind of value'

local function fail(message)
  error(message, 0)
end

local function now_ms()
  return math.floor(NOW_US / 1000)
end

local function heap_push(at, key)
  local i = #heap + 1
  heap[i] = {at, key}
  while i > 1 do
    local parent = math.floor(i / 2)
    if heap[parent][1] <= heap[i][1] then
      break
    end
    heap[parent], heap[i] = heap[i], heap[parent]
    i = parent
  end
end

local function heap_pop()
  local top = heap[1]
  local last = heap[#heap]
  heap[#heap] = nil
  if #heap > 0 then
    heap[1] = last
    local i = 1
    while true do
      local left, right, least = 2 * i, 2 * i + 1, i
      if left <= #heap and heap[left][1] < heap[least][1] then
        least = left
      end
      if right <= #heap and heap[right][1] < heap[least][1] then
        least = right
      end
      if least == i then
        break
      end
      heap[i], heap[least] = heap[least], heap[i]
      i = least
    end
  end
  return top
end

-- Drops every key whose expiry has come (Redis's active expiry, done whole).
function expire_due()
  local ms = now_ms()
  while #heap > 0 and heap[1][1] <= ms do
    local entry = heap_pop()
    if expires[entry[2]] == entry[1] then
      expires[entry[2]] = nil
      data[entry[2]] = nil
    end
  end
end

local function live(key)
  local at = expires[key]
  if at and at <= now_ms() then
    expires[key] = nil
    data[key] = nil
    return nil
  end
  return data[key]
end

local function typed(key, kind)
  local value = live(key)
  if value == nil then
    return nil
  end
  if kind == 'string' then
    if type(value) ~= 'string' then
      fail(WRONGTYPE)
    end
  elseif type(value) ~= 'table' or value.kind ~= kind then
    fail(WRONGTYPE)
  end
  return value
end

local function created(key, kind)
  local value = typed(key, kind)
  if value == nil then
    if kind == 'hash' then
      value = {kind = 'hash', fields = {}, n = 0}
    elseif kind == 'zset' then
      value = {kind = 'zset', scores = {}, order = {}, n = 0}
    else
      value = {kind = 'list', items = {}}
    end
    data[key] = value
  end
  return value
end

local function drop_if_empty(key, value)
  local empty
  if value.kind == 'list' then
    empty = #value.items == 0
  else
    empty = value.n == 0
  end
  if empty then
    data[key] = nil
    expires[key] = nil
  end
end

local function set_expiry(key, at)
  expires[key] = at
  heap_push(at, key)
end

-- An argument as Redis stores it: text; a number as an integer when whole.
local function str(value)
  local kind = type(value)
  if kind == 'string' then
    return value
  end
  if kind == 'number' then
    if value == math.floor(value) and value > -2 ^ 53 and value < 2 ^ 53 then
      return string.format('%d', value)
    end
    return string.format('%.17g', value)
  end
  fail('ERR Lua redis lib command arguments must be strings or integers')
end

local function integer(text)
  local value = tonumber(text)
  if value == nil or value ~= math.floor(value) then
    fail('ERR value is not an integer or out of range')
  end
  return value
end

local function arity(count, least, name, pairs_after)
  if count < least or (pairs_after and (count - pairs_after) % 2 ~= 0) then
    fail("ERR wrong number of arguments for '" .. string.lower(name) .. "' command")
  end
end

-- Redis's inclusive index range, negative from the end.
local function range(length, start, stop)
  if start < 0 then
    start = math.max(0, length + start)
  end
  if stop < 0 then
    stop = length + stop
  end
  stop = math.min(stop, length - 1)
  return start, stop
end

local OK = {ok = 'OK'}
local commands = {}

function commands.GET(key)
  return typed(str(key), 'string') or false
end

function commands.SET(key, value, option, milliseconds, ...)
  key, value = str(key), str(value)
  local expire
  if option ~= nil then
    if string.upper(str(option)) ~= 'PX' or milliseconds == nil or select('#', ...) > 0 then
      fail('ERR syntax error')
    end
    expire = integer(str(milliseconds))
    if expire <= 0 then
      fail("ERR invalid expire time in 'set' command")
    end
  end
  live(key)
  data[key] = value
  expires[key] = nil
  if expire then
    set_expiry(key, now_ms() + expire)
  end
  return OK
end

function commands.DEL(...)
  local removed = 0
  for i = 1, select('#', ...) do
    local key = str((select(i, ...)))
    if live(key) ~= nil then
      data[key] = nil
      expires[key] = nil
      removed = removed + 1
    end
  end
  return removed
end

function commands.PEXPIRE(key, milliseconds)
  key = str(key)
  local ms = integer(str(milliseconds))
  if live(key) == nil then
    return 0
  end
  if ms <= 0 then
    data[key] = nil
    expires[key] = nil
  else
    set_expiry(key, now_ms() + ms)
  end
  return 1
end

function commands.TIME()
  local seconds = math.floor(NOW_US / 1000000)
  return {string.format('%d', seconds), string.format('%d', NOW_US - seconds * 1000000)}
end

function commands.PING()
  return {ok = 'PONG'}
end

function commands.HSET(key, ...)
  local count = select('#', ...)
  arity(count + 1, 3, 'HSET', 1)
  local hash = created(str(key), 'hash')
  local fields = hash.fields
  local added = 0
  local args = {...}
  for i = 1, count, 2 do
    local name = str(args[i])
    if fields[name] == nil then
      added = added + 1
    end
    fields[name] = str(args[i + 1])
  end
  hash.n = hash.n + added
  return added
end

function commands.HGET(key, name)
  local hash = typed(str(key), 'hash')
  return hash and hash.fields[str(name)] or false
end

function commands.HMGET(key, ...)
  local hash = typed(str(key), 'hash')
  local fields = hash and hash.fields or {}
  local reply = {}
  for i = 1, select('#', ...) do
    reply[i] = fields[str((select(i, ...)))] or false
  end
  return reply
end

function commands.HDEL(key, ...)
  key = str(key)
  local hash = typed(key, 'hash')
  if hash == nil then
    return 0
  end
  local removed = 0
  for i = 1, select('#', ...) do
    local name = str((select(i, ...)))
    if hash.fields[name] ~= nil then
      hash.fields[name] = nil
      removed = removed + 1
    end
  end
  hash.n = hash.n - removed
  drop_if_empty(key, hash)
  return removed
end

function commands.HGETALL(key)
  local hash = typed(str(key), 'hash')
  local reply = {}
  if hash then
    for name, value in pairs(hash.fields) do
      reply[#reply + 1] = name
      reply[#reply + 1] = value
    end
  end
  return reply
end

function commands.HLEN(key)
  local hash = typed(str(key), 'hash')
  return hash and hash.n or 0
end

function commands.HKEYS(key)
  local hash = typed(str(key), 'hash')
  local reply = {}
  if hash then
    for name in pairs(hash.fields) do
      reply[#reply + 1] = name
    end
  end
  return reply
end

function commands.HEXISTS(key, name)
  local hash = typed(str(key), 'hash')
  return (hash and hash.fields[str(name)] ~= nil) and 1 or 0
end

-- Sorted sets: order holds {score, member} sorted by score, then member.
local function before(a, b)
  if a[1] ~= b[1] then
    return a[1] < b[1]
  end
  return a[2] < b[2]
end

local function position(order, entry)
  local low, high = 1, #order + 1
  while low < high do
    local middle = math.floor((low + high) / 2)
    if before(order[middle], entry) then
      low = middle + 1
    else
      high = middle
    end
  end
  return low
end

function commands.ZADD(key, ...)
  local count = select('#', ...)
  arity(count + 1, 3, 'ZADD', 1)
  local args = {...}
  local pairs_ = {}
  for i = 1, count, 2 do
    local score = tonumber(str(args[i]))
    if score == nil or score ~= score then
      fail('ERR value is not a valid float')
    end
    pairs_[#pairs_ + 1] = {score, str(args[i + 1])}
  end
  local zset = created(str(key), 'zset')
  local added = 0
  for _, entry in ipairs(pairs_) do
    local old = zset.scores[entry[2]]
    if old == nil then
      added = added + 1
      zset.n = zset.n + 1
    elseif old ~= entry[1] then
      table.remove(zset.order, position(zset.order, {old, entry[2]}))
    end
    if old ~= entry[1] then
      zset.scores[entry[2]] = entry[1]
      table.insert(zset.order, position(zset.order, entry), entry)
    end
  end
  return added
end

function commands.ZREM(key, ...)
  key = str(key)
  local zset = typed(key, 'zset')
  if zset == nil then
    return 0
  end
  local removed = 0
  for i = 1, select('#', ...) do
    local member = str((select(i, ...)))
    local score = zset.scores[member]
    if score ~= nil then
      table.remove(zset.order, position(zset.order, {score, member}))
      zset.scores[member] = nil
      zset.n = zset.n - 1
      removed = removed + 1
    end
  end
  drop_if_empty(key, zset)
  return removed
end

-- A score as ZRANGE WITHSCORES gives it.
local function score_text(score)
  if score == math.floor(score) and score > -2 ^ 53 and score < 2 ^ 53 then
    return string.format('%d', score)
  end
  return string.format('%.17g', score)
end

function commands.ZRANGE(key, start, stop, option, ...)
  if stop == nil then
    arity(2, 3, 'ZRANGE')
  end
  local withscores = false
  if option ~= nil then
    if string.upper(str(option)) ~= 'WITHSCORES' or select('#', ...) > 0 then
      fail('ERR syntax error')
    end
    withscores = true
  end
  local zset = typed(str(key), 'zset')
  local reply = {}
  if zset == nil then
    return reply
  end
  local first, last = range(#zset.order, integer(str(start)), integer(str(stop)))
  for i = first + 1, last + 1 do
    reply[#reply + 1] = zset.order[i][2]
    if withscores then
      reply[#reply + 1] = score_text(zset.order[i][1])
    end
  end
  return reply
end

function commands.ZSCORE(key, member)
  if member == nil then
    arity(1, 2, 'ZSCORE')
  end
  local zset = typed(str(key), 'zset')
  local score = zset and zset.scores[str(member)]
  if score == nil then
    return false  -- a nil bulk reply, as redis.call gives it
  end
  return score_text(score)
end

function commands.ZCARD(key)
  local zset = typed(str(key), 'zset')
  return zset and zset.n or 0
end

function commands.LPUSH(key, ...)
  arity(select('#', ...) + 1, 2, 'LPUSH')
  local list = created(str(key), 'list')
  for i = 1, select('#', ...) do
    table.insert(list.items, 1, str((select(i, ...))))
  end
  return #list.items
end

function commands.LTRIM(key, start, stop)
  key = str(key)
  local list = typed(key, 'list')
  if list then
    local first, last = range(#list.items, integer(str(start)), integer(str(stop)))
    local kept = {}
    for i = first + 1, last + 1 do
      kept[#kept + 1] = list.items[i]
    end
    list.items = kept
    drop_if_empty(key, list)
  end
  return OK
end

function commands.LRANGE(key, start, stop)
  local list = typed(str(key), 'list')
  local reply = {}
  if list then
    local first, last = range(#list.items, integer(str(start)), integer(str(stop)))
    for i = first + 1, last + 1 do
      reply[#reply + 1] = list.items[i]
    end
  end
  return reply
end

-- redis.call: runs one command; an error ends the script, as in Redis.
redis = {
  call = function(name, ...)
    local command = type(name) == 'string' and commands[string.upper(name)]
    if not command then
      if type(name) ~= 'string' then
        fail('ERR Please specify at least one argument for this redis lib call')
      end
      fail("ERR unknown command '" .. name .. "'")
    end
    return command(...)
  end,
}

-- The live keys, for tests (Redis's KEYS, without a pattern).
function keys()
  expire_due()
  local reply = {}
  for key in pairs(data) do
    if live(key) ~= nil then
      reply[#reply + 1] = key
    end
  end
  return reply
end
