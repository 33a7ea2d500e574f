-- Force-release a lock an operator looked at: delete it only if it still has the owner and
-- fencing token that were shown, so a lock taken again in between is left alone.
--
-- KEYS[1]   the lock (a hash written by acquire.lua); its fencing counter is left alone
-- ARGV[1]   owner that was shown ('' for a hash without an owner)
-- ARGV[2]   fencing token that was shown ('' for a hash without a token)
-- return    1 released, 0 gone already, -1 held by another owner or token now (left alone)
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local held = redis.call('HMGET', KEYS[1], 'owner', 'token')
if (held[1] or '') ~= ARGV[1] or (held[2] or '') ~= ARGV[2] then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
