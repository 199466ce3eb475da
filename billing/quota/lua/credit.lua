-- A credit-ledger row of a prepaid account: ARGV[3] its id, ARGV[4] its nano-USD (applied once per
-- id); ARGV[5] a grant's expiry (epoch seconds, '' for none): from then on reserve.lua counts the
-- grant as gone until its end is told (ARGV[6], a grant id: its expiry row, or nothing was left of it).
local k = p .. ARGV[2] .. ':'
if ARGV[3] ~= '' and redis.call('HSETNX', k .. 'cred', ARGV[3], ARGV[4]) == 1 then redis.call('INCRBY', k .. 'cred:sum', ARGV[4]) end
if ARGV[5] ~= '' and redis.call('SISMEMBER', k .. 'cred:ended', ARGV[3]) == 0 then redis.call('ZADD', k .. 'cred:exp', ARGV[5], ARGV[3]) end
if ARGV[6] ~= '' then
  redis.call('ZREM', k .. 'cred:exp', ARGV[6])
  redis.call('SADD', k .. 'cred:ended', ARGV[6])
end
return 1
