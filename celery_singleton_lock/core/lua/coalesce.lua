-- Leave a coalesced duplicate's call as the pending follow-up of a lock: only while the run it
-- met still holds the lock, so it can never race that run's release (take_pending.lua).
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   the pending follow-up (same hash slot): a hash with field id (the follow-up's task
--           id, kept from the first duplicate of a burst), count (duplicates coalesced) and the
--           latest duplicate's call (overwritten by each later duplicate)
-- KEYS[3]   the completion record of the duplicate (same hash slot, as release.lua writes it):
--           once its call is left, the follow-up carries it, so a copy of the duplicate's
--           message (a broker redelivery) is dropped by acquire.lua, not run with stale args
-- ARGV[1]   the holder the duplicate met (its owner)
-- ARGV[2]   a task id for the follow-up, used if there is no pending record yet
-- ARGV[3]   keep the pending record this long past the lock's own expiry, ms
-- ARGV[4]   the duplicate's generation (its retries count)
-- ARGV[5]   keep its completion record this long, ms; 0: record nothing
-- ARGV[6..] the call: field, value, field, value, ...
-- return    {1, follow-up id, count}   written
--           {0, pttl_ms, finished}     the lock is not held by ARGV[1] any more (nothing written):
--                                      gone (pttl -2), another run, or an at-least window
--                                      (finished 1)
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
if not held[1] or held[1] ~= ARGV[1] or held[2] then
  local finished = 0
  if held[2] then
    finished = 1
  end
  return {0, redis.call('PTTL', KEYS[1]), finished}
end
redis.call('HSETNX', KEYS[2], 'id', ARGV[2])
local count = redis.call('HINCRBY', KEYS[2], 'count', 1)
redis.call('HSET', KEYS[2], unpack(ARGV, 6))
local keep = tonumber(ARGV[5])
if keep and keep > 0 then
  local gen = tonumber(ARGV[4])
  local recorded = tonumber(redis.call('GET', KEYS[3]))
  if recorded and recorded > gen then
    gen = recorded
  end
  redis.call('SET', KEYS[3], string.format('%d', gen), 'PX', keep)
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 0 then
  pttl = 0
end
redis.call('PEXPIRE', KEYS[2], pttl + tonumber(ARGV[3]))
return {1, redis.call('HGET', KEYS[2], 'id'), count}
