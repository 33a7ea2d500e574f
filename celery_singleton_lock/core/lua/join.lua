-- Join a duplicate to the run that holds a lock: its record is kept beside the lock until that
-- run (or whoever ends the key's run next) takes it and completes the duplicate with its outcome.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   the lock's joiners (same hash slot): a hash, joiner task id -> '<holder>|<record>'
-- ARGV[1]   the holder the duplicate met (its owner)
-- ARGV[2]   the duplicate's task id
-- ARGV[3]   its record (opaque bytes: what completing it needs)
-- ARGV[4]   keep the joiners this long past the lock's expiry, ms
-- return    1 joined; 0 nothing written: the lock is gone, another run's, or an at-least window
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
if held[1] ~= ARGV[1] or held[2] then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1] .. '|' .. ARGV[3])
local keep = redis.call('PTTL', KEYS[1]) + tonumber(ARGV[4])
if redis.call('PTTL', KEYS[2]) < keep then
  redis.call('PEXPIRE', KEYS[2], keep)
end
return 1
