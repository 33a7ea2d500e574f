-- Join a duplicate to the run that holds a lock: its record is kept beside the lock until that
-- run (or whoever ends the key's run next) takes it and completes the duplicate with its outcome.
-- Each join names the one live watch copy of the duplicate by a serial: a copy of a watch copy
-- (the broker handed it out again) or an older one is stale, and is told so.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   the lock's joiners (same hash slot): a hash, joiner task id ->
--           '<holder>|<serial>|<record>'
-- ARGV[1]   the holder the duplicate met (its owner)
-- ARGV[2]   the duplicate's task id
-- ARGV[3]   its record (opaque bytes: what completing it needs)
-- ARGV[4]   keep the joiners this long past the lock's expiry, ms
-- ARGV[5]   the serial of the watch copy that joins again; '' for the call's own message
-- return    n >= 1  joined: n is the serial of its next watch copy, the live one
--           0       nothing written: the lock is gone, another run's, or an at-least window
--           -1      stale: its record names another live watch copy; nothing written
local serial = 0
local value = redis.call('HGET', KEYS[2], ARGV[2])
if value then
  local bar = string.find(value, '|', 1, true)
  serial = tonumber(string.sub(value, bar + 1, string.find(value, '|', bar + 1, true) - 1))
  if ARGV[5] ~= '' and tonumber(ARGV[5]) ~= serial then
    return -1
  end
elseif ARGV[5] ~= '' then
  serial = tonumber(ARGV[5])  -- its record was taken, or expired: it joins afresh
end
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
if held[1] ~= ARGV[1] or held[2] then
  return 0
end
serial = serial + 1
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1] .. '|' .. string.format('%d', serial) .. '|' .. ARGV[3])
local keep = redis.call('PTTL', KEYS[1]) + tonumber(ARGV[4])
if redis.call('PTTL', KEYS[2]) < keep then
  redis.call('PEXPIRE', KEYS[2], keep)
end
return serial
