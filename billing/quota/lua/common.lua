local p = ARGV[1]
local epoch = redis.call('GET', p .. 'epoch') or '0'
local function num(key) return tonumber(redis.call('GET', key) or '0') end
