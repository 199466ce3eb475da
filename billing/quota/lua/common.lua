-- ARGV[1]: the group's prefix, `<prefix>{<tag>}:` (an account and its keys). Every key a script
-- touches starts with it, so on Redis Cluster they all live in the hash slot of `<tag>`.
local p = ARGV[1]
local epoch = redis.call('GET', p .. 'epoch') or '0'
local function num(key) return tonumber(redis.call('GET', key) or '0') end
