-- Redlock, last step of an acquire: carry the final fencing token to one master.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   its fencing counter (same hash slot)
-- ARGV[1]   the final token: the largest token the masters issued for this acquire
-- ARGV[2]   fencing counter lifetime, ms (the lock's ttl + the fence margin, as acquire.lua):
--           set only when the counter is raised, to expire that long after the later of this
--           master's clock and the token (masters' clocks differ)
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
  local now = redis.call('TIME')
  local ahead = token - (tonumber(now[1]) * 1000000 + tonumber(now[2]))
  if ahead < 0 then
    ahead = 0
  end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]) + math.floor(ahead / 1000))
end

local held = redis.call('HMGET', KEYS[1], 'owner', 'gen')
if held[1] == ARGV[3] and held[2] == ARGV[4] then
  redis.call('HSET', KEYS[1], 'token', ARGV[1])
  return 1
end
return 0
