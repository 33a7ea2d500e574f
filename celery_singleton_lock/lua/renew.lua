-- Renew many locks of one ttl in one call, each only if its owner and generation still hold it.
-- A renewal never shortens a lock: one handed over to a retry was stretched past the ttl, and a
-- renewal sent before that (already on the wire) must not undo it.
--
-- KEYS[i]       lock i (a hash written by acquire.lua)
-- ARGV[1]       new ttl of every lock, milliseconds: the expiry is raised to it, never lowered
-- ARGV[2i]      owner of lock i
-- ARGV[2i+1]    generation of lock i
-- return        {i, status, ...} for the locks NOT renewed only (an empty list when all were):
--               status 0 gone, -1 held by another owner or generation
local result = {}
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen')
  if not held[1] then
    result[#result + 1] = i
    result[#result + 1] = 0
  elseif held[1] == ARGV[2 * i] and held[2] == ARGV[2 * i + 1] then
    if redis.call('PTTL', KEYS[i]) < ttl then
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
  else
    result[#result + 1] = i
    result[#result + 1] = -1
  end
end
return result
