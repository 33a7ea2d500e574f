-- Renew many locks in one round trip, each only if its owner and generation still hold it.
--
-- KEYS[i]      lock i (a hash written by acquire.lua)
-- ARGV[3i-2]   owner of lock i
-- ARGV[3i-1]   generation of lock i
-- ARGV[3i]     new ttl of lock i, milliseconds
-- return       {status_1, ..., status_n}: 1 renewed, 0 gone, -1 held by another owner or generation
local result = {}
for i = 1, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen')
  if not held[1] then
    result[i] = 0
  elseif held[1] == ARGV[3 * i - 2] and held[2] == ARGV[3 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[3 * i])
    redis.call('HINCRBY', KEYS[i], 'renewals', 1)
    result[i] = 1
  else
    result[i] = -1
  end
end
return result
