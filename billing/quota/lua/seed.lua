local month = ARGV[2]; local minute = ARGV[3]; local n = tonumber(ARGV[4])
local ttl = 40 * 86400
for i = 0, n - 1 do
  local b = 5 + i * 5
  local k = p .. ARGV[b] .. ':'
  local synced = k .. 'synced:' .. month .. ':' .. epoch
  if redis.call('EXISTS', synced) == 0 then
    redis.call('SET', k .. 'mtok:' .. month, ARGV[b + 1], 'EX', ttl)
    redis.call('SET', k .. 'mspend:' .. month, ARGV[b + 2], 'EX', ttl)
    if redis.call('EXISTS', k .. 'rpm:' .. minute) == 0 then
      redis.call('SET', k .. 'rpm:' .. minute, ARGV[b + 3], 'EX', 180)
      redis.call('SET', k .. 'tpm:' .. minute, ARGV[b + 4], 'EX', 180)
    end
    redis.call('SET', synced, '1', 'EX', ttl)
  end
end
-- Prepaid balances: each credit row once (HSETNX keeps rows credited meanwhile), spent from the ledger.
local i = 5 + n * 5
for _ = 1, tonumber(ARGV[i] or '0') do
  local k = p .. ARGV[i + 1] .. ':'
  local rows = tonumber(ARGV[i + 3])
  if redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 0 then
    for j = 0, rows - 1 do redis.call('HSETNX', k .. 'cred', ARGV[i + 4 + j * 2], ARGV[i + 5 + j * 2]) end
    local sum = 0
    for _, v in ipairs(redis.call('HVALS', k .. 'cred')) do sum = sum + tonumber(v) end
    redis.call('SET', k .. 'cred:sum', sum)
    redis.call('SET', k .. 'spent', ARGV[i + 2])
    redis.call('SET', k .. 'bsynced:' .. epoch, '1')
  end
  i = i + 4 + rows * 2
end
return 1
