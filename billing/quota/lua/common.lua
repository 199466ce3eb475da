-- ARGV[1]: the group's prefix, `<prefix>{<tag>}:` (an account and its keys). Every key a script
-- touches starts with it, so on Redis Cluster they all live in the hash slot of `<tag>`.
local p = ARGV[1]
local epoch = redis.call('GET', p .. 'epoch') or '0'
local function num(key) return tonumber(redis.call('GET', key) or '0') end
-- Removes the holds (of every scope a failover may touch: the `scopes` set) for which
-- `doomed(owner process, request id)` is true.
local function drop_holds(doomed)
  for _, name in ipairs(redis.call('SMEMBERS', p .. 'scopes')) do
    local k = p .. name .. ':'
    local flat = redis.call('HGETALL', k .. 'holds')
    for x = 1, #flat, 2 do
      local t, c, _, owner = string.match(flat[x + 1], '^(%d+):(%d+):(%d+):?(%w*)$')
      if t and doomed(owner, flat[x]) then
        redis.call('HDEL', k .. 'holds', flat[x])
        redis.call('ZREM', k .. 'hexp', flat[x])
        redis.call('DECRBY', k .. 'held:tok', t)
        redis.call('DECRBY', k .. 'held:nanos', c)
      end
    end
  end
end
-- Keeps one running request's hold on scope `name` of process `proc`: put back where the store lost
-- it, its expiry moved to `expiry` either way (a re-registration, a renewal).
local function keep_hold(name, rid, tok, nanos, minute, expiry, proc)
  local s = p .. name .. ':'
  if redis.call('HEXISTS', s .. 'holds', rid) == 0 then
    redis.call('SADD', p .. 'scopes', name)
    redis.call('HSET', s .. 'holds', rid, tok .. ':' .. nanos .. ':' .. minute .. ':' .. proc)
    redis.call('INCRBY', s .. 'held:tok', tok)
    redis.call('INCRBY', s .. 'held:nanos', nanos)
  end
  redis.call('ZADD', s .. 'hexp', expiry, rid)
end
-- The data set's sentinel (`alive:<prefix>`; on Redis Cluster `alive:<group prefix>`, one per
-- group): '<id>/<ms>', written at a registration that finds it missing. Redis losing its data without
-- a restart (FLUSHALL, FLUSHDB) loses it too: a process that had seen it then knows the data set is
-- gone, and <ms> (Redis's clock) is when it noticed; 0: no loss noticed (a new data set, or a restart,
-- which Redis's uptime covers). Rebuilds wait until then + the failover wait, as after a restart.
local function now_ms() local t = redis.call('TIME') return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local function uptime() return tonumber(string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')) end
local function lost_at(mark) return mark and tonumber(string.match(mark, '/(%d+)$')) or 0 end
