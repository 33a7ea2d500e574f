-- Renew many locks of one ttl in one call, each only if the run that took it still holds it.
-- A renewal never shortens a lock: one handed over to a retry was stretched past the ttl, and a
-- renewal sent before that (already on the wire) must not undo it.
--
-- KEYS[i]       lock i (a hash written by acquire.lua)
-- ARGV[1]       new ttl of every lock, milliseconds: the expiry is raised to it, never lowered
-- ARGV[3i-1]    owner of lock i
-- ARGV[3i]      generation of lock i
-- ARGV[3i+1]    the fencing token of the run holding lock i, or '' to match any token (a
--               redelivered copy of the message, same owner and generation, is another run)
-- return        {i, status, ...} for the locks NOT renewed only (an empty list when all were):
--               status 0 gone (or an at-least window: its run released it), -1 held by
--               another run; and 2 for a lock renewed whose holder a newer call asked to stop
--               (field 'cancel', singleton_on_duplicate="cancel"). A window (field 'ended') is
--               never written to
local result = {}
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen', 'token', 'ended', 'cancel')
  local token = ARGV[3 * i + 1]
  if not held[1] or held[4] then
    result[#result + 1] = i
    result[#result + 1] = 0
  elseif held[1] == ARGV[3 * i - 1] and held[2] == ARGV[3 * i]
      and (token == '' or held[3] == token) then
    if redis.call('PTTL', KEYS[i]) < ttl then
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
    if held[5] then
      result[#result + 1] = i
      result[#result + 1] = 2
    end
  else
    result[#result + 1] = i
    result[#result + 1] = -1
  end
end
return result
