-- Keeps the holds of requests a live process still runs: ARGV[2] the new expiry, ARGV[3] the
-- process, ARGV[4] how many holds; each: request id, tokens, nanos, minute, scope count, scope names.
-- A hold the store still has gets the new expiry; one it lost meanwhile (it expired while the
-- process could not reach Redis) comes back, unless the request was settled since.
local expiry = ARGV[2]; local proc = ARGV[3]; local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  local rid = ARGV[i]; local tok = ARGV[i + 1]; local nanos = ARGV[i + 2]; local minute = ARGV[i + 3]
  local k = tonumber(ARGV[i + 4])
  if redis.call('EXISTS', p .. 'settled:' .. rid) == 0 then
    for j = 1, k do keep_hold(ARGV[i + 4 + j], rid, tok, nanos, minute, expiry, proc) end
  end
  i = i + 5 + k
end
return n
