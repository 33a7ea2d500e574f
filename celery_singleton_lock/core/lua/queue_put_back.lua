-- Put a call handed the key back at the head of its queue, when publishing it failed: the lock
-- waiting in its name is freed (so the key's next run, or a purge, hands it over again).
--
-- KEYS[1]   the lock, or the permit slot, handed to the call
-- KEYS[2]   the key's queue (a sorted set, as enqueue.lua writes it)
-- KEYS[3]   the queued calls (a hash, as enqueue.lua writes it)
-- ARGV[1]   the call's task id
-- ARGV[2]   its retries count
-- ARGV[3]   its record
-- ARGV[4]   keep the queue this long, ms
-- return    1 put back; 0 the lock no longer waits in its name (its message came after all)
local held = redis.call('HMGET', KEYS[1], 'owner', 'queued')
if held[1] ~= ARGV[1] or not held[2] then
  return 0
end
redis.call('DEL', KEYS[1])
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local place = 0
if #first > 0 then
  place = tonumber(first[2]) - 1
end
redis.call('ZADD', KEYS[2], place, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2] .. '|' .. ARGV[3])
for i = 2, 3 do
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[i], ARGV[4])
  end
end
return 1
