local now = tonumber(ARGV[2]); local rid = ARGV[3]; local minute = ARGV[4]; local month = ARGV[5]
local expiry = tonumber(ARGV[6]); local tok = tonumber(ARGV[7]); local nanos = tonumber(ARGV[8])
local n = tonumber(ARGV[9])
local proc = ARGV[10 + n * 7]
-- Replicated Redis (Cluster, Sentinel): a master other than the one that last wrote this group took
-- over (a failover), and may lack the old one's latest writes. Every process registered here must
-- re-register its live holds (its registration moves to procs:stale) and the counters are rebuilt
-- from the ledger; admissions wait (up to ARGV[12 + n * 7] ms) until every such process has. A plain
-- restart leaves no registry to wait for: admissions that need a rebuild wait that long after
-- Redis started (below).
if ARGV[11 + n * 7] == '1' then
  local id = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)')
  local seen = redis.call('GET', p .. 'node')
  if seen ~= id then
    redis.call('SET', p .. 'node', id)
    if seen then
      -- Holds stay (a dead process's running requests still count); each process that re-registers
      -- drops its own holds it no longer runs (their settlement was lost) and puts back those lost.
      redis.call('ZUNIONSTORE', p .. 'procs:stale', 2, p .. 'procs:stale', p .. 'procs')
      redis.call('DEL', p .. 'procs')
      redis.call('SET', p .. 'recovering', '1', 'PX', ARGV[12 + n * 7])
      redis.call('INCR', p .. 'epoch')
      return {'lost', 1}
    end
  end
end
-- This process not registered in the group (Redis lost its state, a failover, or a first call
-- here): it re-registers its live holds before anything else (after a failover, its ledger rows first).
local registered = redis.call('ZSCORE', p .. 'procs', proc)
if not registered or tonumber(registered) < now then return {'lost', redis.call('EXISTS', p .. 'recovering')} end
if redis.call('EXISTS', p .. 'recovering') == 1 then
  redis.call('ZREMRANGEBYSCORE', p .. 'procs:stale', '-inf', now)
  if redis.call('ZCARD', p .. 'procs:stale') > 0 then return {'recovering'} end
  redis.call('DEL', p .. 'recovering')
end
local scopes = {}
local missing = {}
for i = 0, n - 1 do
  local b = 10 + i * 7
  local s = {name = ARGV[b], rpm = tonumber(ARGV[b + 1]), tpm = tonumber(ARGV[b + 2]), conc = tonumber(ARGV[b + 3]),
             mtok = tonumber(ARGV[b + 4]), mspend = tonumber(ARGV[b + 5]), prepaid = ARGV[b + 6] == '1'}
  s.k = p .. s.name .. ':'
  scopes[#scopes + 1] = s
  if redis.call('EXISTS', s.k .. 'synced:' .. month .. ':' .. epoch) == 0
     or (s.prepaid and redis.call('EXISTS', s.k .. 'bsynced:' .. epoch) == 0) then missing[#missing + 1] = s.name end
end
if #missing > 0 then
  -- Redis started moments ago (a restart without persistence keeps nothing): the holds of requests
  -- still running on other processes are not back yet; each process's hold watch puts them back
  -- within about two seconds of Redis answering. The counters are rebuilt, and admissions here
  -- resume, only once that time has passed (the caller waits and asks again).
  -- The same after Redis lost its data without a restart (a FLUSHALL: its uptime goes on): from
  -- when the first process that had seen the data set noticed it gone (the sentinel, common.lua).
  local wait_ms = tonumber(ARGV[12 + n * 7])
  local left = wait_ms - uptime() * 1000
  local lost = lost_at(redis.call('GET', ARGV[13 + n * 7]))
  if lost > 0 then left = math.max(left, lost + wait_ms - now_ms()) end
  if left > 0 then return {'starting', left} end
  return {'sync', missing}
end
-- A retried call for a request already reserved changes nothing.
if redis.call('HEXISTS', scopes[1].k .. 'holds', rid) == 1 then
  local again = {}
  for i, s in ipairs(scopes) do
    again[i] = {s.rpm - num(s.k .. 'rpm:' .. minute), s.tpm - num(s.k .. 'tpm:' .. minute)}
  end
  return {'ok', again}
end
for _, s in ipairs(scopes) do
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', s.k .. 'hexp', '-inf', now)) do
    local v = redis.call('HGET', s.k .. 'holds', h)
    if v then
      local t, c = string.match(v, '^(%d+):(%d+)')
      redis.call('DECRBY', s.k .. 'held:tok', t)
      redis.call('DECRBY', s.k .. 'held:nanos', c)
      redis.call('HDEL', s.k .. 'holds', h)
    end
    redis.call('ZREM', s.k .. 'hexp', h)
  end
end
local remaining = {}
local denied = nil
local available = 0
for _, s in ipairs(scopes) do
  local requests = num(s.k .. 'rpm:' .. minute)
  local tokens = num(s.k .. 'tpm:' .. minute)
  if not denied then
    if s.rpm >= 0 and requests + 1 > s.rpm then denied = {s.name, 'rpm'}
    elseif s.tpm >= 0 and tokens + tok > s.tpm then denied = {s.name, 'tpm'}
    elseif s.conc >= 0 and redis.call('ZCARD', s.k .. 'hexp') + 1 > s.conc then denied = {s.name, 'max_concurrent'}
    elseif s.mtok >= 0 and num(s.k .. 'mtok:' .. month) + num(s.k .. 'held:tok') + tok > s.mtok then denied = {s.name, 'monthly_tokens'}
    elseif s.mspend >= 0 and num(s.k .. 'mspend:' .. month) + num(s.k .. 'held:nanos') + nanos > s.mspend then denied = {s.name, 'monthly_spend'}
    elseif s.prepaid then
      available = num(s.k .. 'cred:sum') - num(s.k .. 'spent') - num(s.k .. 'held:nanos')
      -- A grant past its expiry whose end is not told yet (its expiry row waits for the usage admitted
      -- before it to be posted): none of it is available, so none is spent after it expired.
      for _, g in ipairs(redis.call('ZRANGEBYSCORE', s.k .. 'cred:exp', '-inf', now)) do
        available = available - tonumber(redis.call('HGET', s.k .. 'cred', g) or '0')
      end
      if nanos > available then denied = {s.name, 'insufficient_quota'} end
    end
  end
  remaining[#remaining + 1] = {s.rpm - requests, s.tpm - tokens}
end
-- `available` as it is, below zero too (a refund took more than was left): the refusal says so.
if denied then return {'deny', denied[1], denied[2], remaining, available} end
for i, s in ipairs(scopes) do
  redis.call('INCR', s.k .. 'rpm:' .. minute)
  redis.call('EXPIRE', s.k .. 'rpm:' .. minute, 180)
  redis.call('INCRBY', s.k .. 'tpm:' .. minute, tok)
  redis.call('EXPIRE', s.k .. 'tpm:' .. minute, 180)
  -- The scopes holding here: what a failover clears, and where a restart finds the holds of the run
  -- it follows (recover.lua), on one Redis as on a replicated one.
  redis.call('SADD', p .. 'scopes', s.name)
  redis.call('HSET', s.k .. 'holds', rid, tok .. ':' .. nanos .. ':' .. minute .. ':' .. proc)
  redis.call('ZADD', s.k .. 'hexp', expiry, rid)
  redis.call('INCRBY', s.k .. 'held:tok', tok)
  redis.call('INCRBY', s.k .. 'held:nanos', nanos)
  remaining[i] = {remaining[i][1] - 1, remaining[i][2] - tok}
end
return {'ok', remaining}
