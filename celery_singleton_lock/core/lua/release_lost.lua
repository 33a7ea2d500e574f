-- Release, for the worker's main process, the lock of a run whose process is gone: only if that
-- run (owner and generation) still holds it, and not once it was handed over to a retry.
--
-- KEYS[1]   the lock (a hash written by acquire.lua); its fencing counter is left alone
-- ARGV[1]   owner: the Celery task id of the lost run
-- ARGV[2]   generation: the lost run's retries count
-- ARGV[3]   at-least window, ms after the lock's 'since' (as release.lua); 0 or absent: none
-- return    1 released (or turned into a window), 0 not held by any run (gone, or a window),
--           -1 held by another owner or generation (left alone), 2 handed over to a retry
--           (left alone)
--
-- SingletonTask.retry() hands the lock over by stretching its expiry over the retry's countdown,
-- past the ttl it was taken with (renewals never set it above that): a PTTL larger than the
-- hash's ttl field marks a lock the retried message (the next generation) is coming to take
-- over. It then expires by itself, countdown + ttl after the hand-over.
local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'ttl', 'ended', 'since')
if not held[1] or held[4] then
  return 0
end
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then
  return -1
end
local ttl = tonumber(held[3])
if ttl and redis.call('PTTL', KEYS[1]) > ttl then
  return 2
end
local at_least = tonumber(ARGV[3])
if at_least and at_least > 0 and held[5] then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local left = tonumber(held[5]) + at_least - now_ms
  if left > 0 then
    redis.call('HSET', KEYS[1], 'ended', string.format('%d', now_ms))
    redis.call('PEXPIRE', KEYS[1], left)
    return 1
  end
end
redis.call('DEL', KEYS[1])
return 1
