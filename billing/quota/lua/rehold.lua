local proc = ARGV[2]; local now = tonumber(ARGV[3]); local ttl = tonumber(ARGV[4]); local n = tonumber(ARGV[5])
local live = {}
local i = 6
for _ = 1, n do
  live[ARGV[i]] = true
  i = i + 6 + tonumber(ARGV[i + 5])
end
local rows = tonumber(ARGV[i] or '0')
i = i + 1
for _ = 1, rows do i = i + 4 + tonumber(ARGV[i + 3]) end
local reserving = tonumber(ARGV[i] or '0')
for j = 1, reserving do live[ARGV[i + j]] = true end  -- reservations awaiting their answer
local tail = i + reserving + 1  -- the epoch bump's flag; then the sentinel's key, the id this process knows, the wait
-- A rebuild this process asks for (usage that Redis did not record): the new epoch and, below, this
-- process's rows not yet in the ledger in `pend`, in one script, so the rebuild cannot miss them.
if ARGV[i + reserving + 1] == '1' then epoch = tostring(redis.call('INCR', p .. 'epoch')) end
-- Back after a recovery (a failover, a restart elsewhere): this process's holds it no longer runs
-- are dropped: settled, the settlement lost with the old master (its usage is in the ledger or in
-- `pend`), or reservations whose answer never came. Only the first time: until this process is
-- registered again no reservation of its can succeed, and later calls may race with new ones.
if redis.call('ZSCORE', p .. 'procs:stale', proc) then
  drop_holds(function(owner, rid) return owner == proc and not live[rid] end)
end
i = 6
for _ = 1, n do
  local rid = ARGV[i]; local tok = ARGV[i + 1]; local nanos = ARGV[i + 2]; local minute = ARGV[i + 3]
  local expiry = ARGV[i + 4]; local k = tonumber(ARGV[i + 5])
  if redis.call('EXISTS', p .. 'settled:' .. rid) == 0 then
    for j = 1, k do keep_hold(ARGV[i + 5 + j], rid, tok, nanos, minute, expiry, proc) end  -- re-registered: renewed from now
  end
  i = i + 6 + k
end
-- This process's rows that may not be in the ledger yet (written through its journal while the
-- database was out, replayed at a restart), each settled already: where the counters are still
-- to be rebuilt, the rebuild counts each once (seed.lua); where they were rebuilt, it is too late.
local rows = tonumber(ARGV[i] or '0'); i = i + 1
for _ = 1, rows do
  local rid = ARGV[i]; local usage = ARGV[i + 1]; local month = ARGV[i + 2]; local k = tonumber(ARGV[i + 3])
  for j = 1, k do
    local s = p .. ARGV[i + 3 + j] .. ':'
    if redis.call('EXISTS', s .. 'synced:' .. month .. ':' .. epoch) == 0 then
      redis.call('HSET', s .. 'pend', rid, usage)
      redis.call('EXPIRE', s .. 'pend', 40 * 86400)
    end
  end
  i = i + 4 + k
end
redis.call('ZREMRANGEBYSCORE', p .. 'procs', '-inf', now)  -- processes not seen for a day
redis.call('ZADD', p .. 'procs', now + ttl, proc)
redis.call('ZREM', p .. 'procs:stale', proc)
-- The data set's sentinel (common.lua). Missing, or another one than this process saw with no loss
-- noted: Redis lost the data set this process registered in. The loss is noted now (rebuilds wait,
-- as after a restart, for every process's hold watch to put its running holds back), or at Redis's
-- start if that was moments ago (a restart: the same wait as its uptime's). A process that saw none
-- (its first registration) cannot tell a new data set from a lost one: it notes no loss.
local alive = ARGV[tail + 1]; local known = ARGV[tail + 2]
local mark = redis.call('GET', alive)
if not mark or (known ~= '' and lost_at(mark) == 0 and string.match(mark, '^(.*)/') ~= known) then
  local ms = now_ms()
  local up = uptime() * 1000
  local lost = 0
  -- a restart: its start, a second early (uptime is whole seconds), so the wait ends no later than
  -- the uptime's (reserve.lua): a restart waits as it did
  if up < tonumber(ARGV[tail + 3]) then lost = ms - up - 1000 elseif known ~= '' then lost = ms end
  mark = (mark and string.match(mark, '^(.*)/') or (proc .. '.' .. ms)) .. '/' .. lost
  redis.call('SET', alive, mark)
end
return mark
