local k = p .. ARGV[2] .. ':'
if redis.call('HSETNX', k .. 'cred', ARGV[3], ARGV[4]) == 1 then redis.call('INCRBY', k .. 'cred:sum', ARGV[4]) end
return 1
