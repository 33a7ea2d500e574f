-- Redlock, last step of an acquire: carry the final fencing token to one master.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   its fencing counter (same hash slot)
-- ARGV[1]   the final token: the largest token the masters issued for this acquire
-- ARGV[2]   fencing counter ttl, milliseconds (set only when the counter is raised)
-- ARGV[3]   owner
-- ARGV[4]   generation
-- return    1  the lock is still this owner's and generation's: its token field is now ARGV[1]
--           0  it is not (gone, or someone else's): only the counter was raised
--
-- The counter never goes down: it becomes max(counter, token). Every later acquire on this
-- master therefore issues a token above ARGV[1], and a later Redlock acquire, whose majority
-- meets the majority that confirmed this one, does too.
local token = tonumber(ARGV[1])
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < token then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end

local held = redis.call('HMGET', KEYS[1], 'owner', 'gen')
if held[1] == ARGV[3] and held[2] == ARGV[4] then
  redis.call('HSET', KEYS[1], 'token', ARGV[1])
  return 1
end
return 0
