local proc = ARGV[2]; local now = tonumber(ARGV[3]); local ttl = tonumber(ARGV[4]); local n = tonumber(ARGV[5])
local i = 6
for _ = 1, n do
  local rid = ARGV[i]; local tok = ARGV[i + 1]; local nanos = ARGV[i + 2]; local minute = ARGV[i + 3]
  local expiry = ARGV[i + 4]; local k = tonumber(ARGV[i + 5])
  if redis.call('EXISTS', p .. 'settled:' .. rid) == 0 then
    for j = 1, k do
      local s = p .. ARGV[i + 5 + j] .. ':'
      if redis.call('HEXISTS', s .. 'holds', rid) == 0 then
        redis.call('SADD', p .. 'scopes', ARGV[i + 5 + j])
        redis.call('HSET', s .. 'holds', rid, tok .. ':' .. nanos .. ':' .. minute)
        redis.call('ZADD', s .. 'hexp', expiry, rid)
        redis.call('INCRBY', s .. 'held:tok', tok)
        redis.call('INCRBY', s .. 'held:nanos', nanos)
      end
    end
  end
  i = i + 6 + k
end
redis.call('ZREMRANGEBYSCORE', p .. 'procs', '-inf', now)  -- processes not seen for a day
redis.call('ZADD', p .. 'procs', now + ttl, proc)
redis.call('ZREM', p .. 'procs:stale', proc)
return 1
