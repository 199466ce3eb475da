local month = ARGV[2]; local minute = ARGV[3]; local n = tonumber(ARGV[4])
local ttl = 40 * 86400
-- ARGV: n scopes (name, month tokens, month nanos, minute requests, minute tokens); then the prepaid
-- scopes (a count; each: name, spent, credit rows, rows x (id, nanos, a pending grant's expiry or '')); then the request ids the
-- caller's ledger read holds (a count, ids) and those it does not hold (a count, ids).
local i = 5 + n * 5
local balances = {}
local count = tonumber(ARGV[i] or '0'); i = i + 1
for _ = 1, count do
  balances[#balances + 1] = i
  i = i + 3 + tonumber(ARGV[i + 2]) * 3
end
local checked = {}
count = tonumber(ARGV[i] or '0'); i = i + 1
for _ = 1, count do checked[ARGV[i]] = true; i = i + 1 end
count = tonumber(ARGV[i] or '0'); i = i + 1
for _ = 1, count do checked[ARGV[i]] = false; i = i + 1 end
-- Usage settled that a rebuild must count unless the ledger read holds its row: `pend` (settled
-- while these counters were not rebuilt: a failover, a restart; per scope, rid -> tokens:nanos:month)
-- and `unc` (every settlement whose row the settling process had not seen written yet; per group,
-- rid -> tokens:nanos:month:scope,scope). A request counts once per scope, whichever holds it. Rows
-- the caller has not looked up yet go back to it (in the same read); nothing is written until every
-- one is known.
local rebuilt = {}
for s = 0, n - 1 do
  local k = p .. ARGV[5 + s * 5] .. ':'
  if redis.call('EXISTS', k .. 'synced:' .. month .. ':' .. epoch) == 0 then rebuilt[k] = true end
end
for _, b in ipairs(balances) do
  local k = p .. ARGV[b] .. ':'
  if redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 0 then rebuilt[k] = true end
end
local unknown = {}
local asked = {}
local extra = {}
local counted = {}
-- `spends`: whether its nanos spent a prepaid balance (a postpaid key's did not: marked ':0' in
-- `pend`, '!' after the scope's name in `unc`).
local function tally(k, rid, t, c, m, spends)
  if counted[k][rid] then return end
  counted[k][rid] = true
  local seen = checked[rid]
  if seen == nil then
    if not asked[rid] then asked[rid] = true; unknown[#unknown + 1] = rid end
  elseif seen == false then
    local e = extra[k]
    if m == month then e[1] = e[1] + tonumber(t); e[2] = e[2] + tonumber(c) end
    if spends then e[3] = e[3] + tonumber(c) end
  end
end
for k in pairs(rebuilt) do
  extra[k] = {0, 0, 0}
  counted[k] = {}
  local flat = redis.call('HGETALL', k .. 'pend')
  for x = 1, #flat, 2 do
    local t, c, m, none = string.match(flat[x + 1], '^(%d+):(%d+):(%d+)(:?0?)$')
    if t then tally(k, flat[x], t, c, m, none == '') end
  end
end
local unc = redis.call('HGETALL', p .. 'unc')
for x = 1, #unc, 2 do
  local t, c, m, names = string.match(unc[x + 1], '^(%d+):(%d+):(%d+):(.*)$')
  if t then
    for name in string.gmatch(names, '[^,]+') do
      local spends = string.sub(name, -1) ~= '!'
      local k = p .. (spends and name or string.sub(name, 1, -2)) .. ':'
      if rebuilt[k] then tally(k, unc[x], t, c, m, spends) end
    end
  end
end
if #unknown > 0 then return {'check', unknown} end
-- What a counter is rebuilt to: the ledger's total plus `add`, or what the counter already holds where
-- that is more. Both are usage that happened (a counter only ever adds settled usage), so the larger
-- misses less: after a failover the new master still has what was replicated before it, including
-- the usage of a gateway that is dead now with its rows in its journal, which no ledger read can see.
local function rebuilt_value(key, value, add)
  local total = tonumber(value) + add
  local kept = tonumber(redis.call('GET', key) or '0')
  if kept > total then total = kept end
  return string.format('%d', total)
end
for s = 0, n - 1 do
  local b = 5 + s * 5
  local k = p .. ARGV[b] .. ':'
  local synced = k .. 'synced:' .. month .. ':' .. epoch
  if redis.call('EXISTS', synced) == 0 then
    redis.call('SET', k .. 'mtok:' .. month, rebuilt_value(k .. 'mtok:' .. month, ARGV[b + 1], extra[k][1]), 'EX', ttl)
    redis.call('SET', k .. 'mspend:' .. month, rebuilt_value(k .. 'mspend:' .. month, ARGV[b + 2], extra[k][2]), 'EX', ttl)
    -- This minute: the larger of what is kept (it counts requests still running, which the ledger
    -- lacks) and the ledger's (it counts those that ran while the scope had no limits, which took no
    -- holds and so are not in what is kept); requests finished with a limit are in both.
    for i, name in ipairs({'rpm:', 'tpm:'}) do
      local kept = tonumber(redis.call('GET', k .. name .. minute) or '0')
      redis.call('SET', k .. name .. minute, math.max(kept, tonumber(ARGV[b + 2 + i])), 'EX', 180)
    end
    redis.call('SET', synced, '1', 'EX', ttl)
  end
end
-- Prepaid balances: each credit row once (HSETNX keeps rows credited meanwhile), spent from the ledger.
for _, b in ipairs(balances) do
  local k = p .. ARGV[b] .. ':'
  if redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 0 then
    local rows = tonumber(ARGV[b + 2])
    for j = 0, rows - 1 do
      local id, expiry = ARGV[b + 3 + j * 3], ARGV[b + 5 + j * 3]
      redis.call('HSETNX', k .. 'cred', id, ARGV[b + 4 + j * 3])
      -- A grant still to end, as the ledger says, unless its end was told meanwhile (credit.lua); a row
      -- the ledger says is no such grant is none here either (an end this Redis never heard of).
      if expiry ~= '' and redis.call('SISMEMBER', k .. 'cred:ended', id) == 0 then
        redis.call('ZADD', k .. 'cred:exp', expiry, id)
      else
        redis.call('ZREM', k .. 'cred:exp', id)
      end
    end
    local sum = 0
    for _, v in ipairs(redis.call('HVALS', k .. 'cred')) do sum = sum + tonumber(v) end
    redis.call('SET', k .. 'cred:sum', sum)
    redis.call('SET', k .. 'spent', rebuilt_value(k .. 'spent', ARGV[b + 1], extra[k][3]))
    redis.call('SET', k .. 'bsynced:' .. epoch, '1')
  end
end
for k in pairs(rebuilt) do redis.call('DEL', k .. 'pend') end
-- `unc` entries the ledger read holds are counted there from now on: struck off.
for x = 1, #unc, 2 do
  if checked[unc[x]] == true then redis.call('HDEL', p .. 'unc', unc[x]) end
end
return 1
