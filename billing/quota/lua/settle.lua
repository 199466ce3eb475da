local rid = ARGV[2]; local month = ARGV[3]; local tok = tonumber(ARGV[4]); local nanos = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local keep = tonumber(ARGV[7 + n]) or 86400
-- Rows the caller's ledger has written since its last settlement here: struck off `unc`, where
-- each settlement files its usage until then (below).
local struck = tonumber(ARGV[9 + n] or '0')
if struck > 0 then redis.call('HDEL', p .. 'unc', unpack(ARGV, 10 + n, 9 + n + struck)) end
-- The ledger row's request id (a batch line's run holds under an id of its own): `unc` and `pend`
-- are looked up by it when a rebuild reads the ledger (seed.lua).
local row = ARGV[10 + n + struck] or rid
-- Per scope, '1' where the hold was taken against a prepaid balance (a postpaid key's hold spent
-- none: its row is invoiced); none given: every scope (a caller from before).
local spends = ARGV[11 + n + struck] or ''
local function spending(i) return spends == '' or string.sub(spends, i + 1, i + 1) == '1' end
if not redis.call('SET', p .. 'settled:' .. rid, '1', 'NX', 'EX', keep) then return 0 end
-- Usage settled whose row the ledger may not hold yet (ARGV[8 + n] = 1): a rebuild counts it unless
-- its ledger read holds the row (seed.lua), even if the process that settled it is gone by then.
if ARGV[8 + n] == '1' and (tok > 0 or nanos > 0) then
  local names = {}
  for i = 0, n - 1 do names[#names + 1] = ARGV[7 + i] .. (spending(i) and '' or '!') end  -- '!': spends no balance
  redis.call('HSET', p .. 'unc', row, tok .. ':' .. nanos .. ':' .. month .. ':' .. table.concat(names, ','))
  redis.call('EXPIRE', p .. 'unc', 40 * 86400)
end
for i = 0, n - 1 do
  local k = p .. ARGV[7 + i] .. ':'
  local v = redis.call('HGET', k .. 'holds', rid)
  if v then
    local t, c, m = string.match(v, '^(%d+):(%d+):(%d+)')
    redis.call('HDEL', k .. 'holds', rid)
    redis.call('ZREM', k .. 'hexp', rid)
    redis.call('DECRBY', k .. 'held:tok', t)
    redis.call('DECRBY', k .. 'held:nanos', c)
    if tonumber(t) > tok and redis.call('EXISTS', k .. 'tpm:' .. m) == 1 then
      redis.call('DECRBY', k .. 'tpm:' .. m, tonumber(t) - tok)
    end
  end
  if redis.call('EXISTS', k .. 'synced:' .. month .. ':' .. epoch) == 1 then
    redis.call('INCRBY', k .. 'mtok:' .. month, tok)
    redis.call('INCRBY', k .. 'mspend:' .. month, nanos)
  elseif tok > 0 or nanos > 0 then
    -- Counters not rebuilt since they were lost (a failover, limits changed): the rebuild counts
    -- this usage once, from the ledger if its read holds the row, else from here (seed.lua). A
    -- release with nothing used (a hold whose settlement failed) must not overwrite what a
    -- re-registration put here for the same request.
    redis.call('HSET', k .. 'pend', row, tok .. ':' .. nanos .. ':' .. month .. (spending(i) and '' or ':0'))
    redis.call('EXPIRE', k .. 'pend', 40 * 86400)
  end
  if spending(i) and redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 1 then redis.call('INCRBY', k .. 'spent', nanos) end
end
return 1
