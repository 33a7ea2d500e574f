-- Queue a call behind the runs that hold its key (singleton_on_duplicate="queue"): only while
-- every slot of the key (the lock itself for one permit) is held, so a call is never queued
-- after the release that would have handed the key to it (queue_release.lua).
--
-- KEYS[1]   the key's queue: a sorted set, member a waiting call's task id, score its place
-- KEYS[2]   the queued calls (same hash slot): a hash, task id -> '<retries>|<record>', field
--           '#' the last place given, fields 'task' (the latest call's task name) and
--           'slots' (how many slots the key has)
-- KEYS[3..] the lock (a hash written by acquire.lua), or the N permit slots of the key
-- ARGV[1]   the call's task id
-- ARGV[2]   its retries count
-- ARGV[3]   its record (opaque bytes: what publishing it again needs)
-- ARGV[4]   the most calls the queue holds
-- ARGV[5]   keep the queue this long past the longest-held slot's expiry, ms
-- ARGV[6]   the call's task name (what a CLI purge hands an orphaned queue on with)
-- return    {1, place}             queued, place in line (1: next)
--           {2, place}             already queued (a copy of its message): nothing written
--           {0, pttl_ms, finished} not queued: a slot is free (pttl -2), or an at-least window
--           {-1, length}           not queued: the queue is full
local longest = 0
for i = 3, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'ended')
  if not held[1] or held[2] then
    local finished = 0
    if held[2] then
      finished = 1
    end
    return {0, redis.call('PTTL', KEYS[i]), finished}
  end
  local pttl = redis.call('PTTL', KEYS[i])
  if pttl > longest then
    longest = pttl
  end
end
local rank = redis.call('ZRANK', KEYS[1], ARGV[1])
if rank then
  return {2, rank + 1}
end
local length = redis.call('ZCARD', KEYS[1])
if length >= tonumber(ARGV[4]) then
  return {-1, length}
end
local place = redis.call('HINCRBY', KEYS[2], '#', 1)
redis.call('ZADD', KEYS[1], place, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. ARGV[3], 'task', ARGV[6],
  'slots', #KEYS - 2)
local keep = longest + tonumber(ARGV[5])
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < keep then
    redis.call('PEXPIRE', KEYS[i], keep)
  end
end
return {1, length + 1}
