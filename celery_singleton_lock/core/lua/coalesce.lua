-- Leave a coalesced duplicate's call as the pending follow-up of a key: only while every slot of
-- the key (the lock itself for one permit) is held by a run, the one the duplicate met among
-- them. Each of those runs' releases looks for the record (take_pending.lua) after it let go, so
-- a record is never written after the release that would have taken it.
--
-- KEYS[1]   the pending follow-up (same hash slot as the lock): a hash with field id (the
--           follow-up's task id, kept from the first duplicate of a burst), count (duplicates
--           coalesced), holders (the owners of the slots at the latest write, a JSON array: a
--           release by a run not among them is by a newer run, which took its slot after every
--           call the record carries) and the latest duplicate's call (overwritten by each later
--           duplicate)
-- KEYS[2]   the completion record of the duplicate (same hash slot, as release.lua writes it):
--           once its call is left, the follow-up carries it, so a copy of the duplicate's
--           message (a broker redelivery) is dropped by acquire.lua, not run with stale args
-- KEYS[3..] the lock (a hash written by acquire.lua), or the N permit slots of the key
--           (singleton_permits = N > 1, written by acquire_permit.lua), in order
-- ARGV[1]   the holder the duplicate met (its owner)
-- ARGV[2]   a task id for the follow-up, used if there is no pending record yet
-- ARGV[3]   keep the pending record this long past the met holder's lock expiry, ms
-- ARGV[4]   the duplicate's generation (its retries count)
-- ARGV[5]   keep its completion record this long, ms; 0: record nothing
-- ARGV[6..] the call: field, value, field, value, ...
-- return    {1, follow-up id, count}   written
--           {0, pttl_ms, finished}     nothing written: a slot is free (pttl -2) or an at-least
--                                      window (finished 1, pttl its end), or ARGV[1] holds
--                                      none of them any more (pttl of KEYS[3])
local holders = {}
local met = nil
for i = 3, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'ended')
  if not held[1] or held[2] then
    local finished = 0
    if held[2] then
      finished = 1
    end
    return {0, redis.call('PTTL', KEYS[i]), finished}
  end
  holders[#holders + 1] = held[1]
  if held[1] == ARGV[1] then
    met = KEYS[i]
  end
end
if not met then
  return {0, redis.call('PTTL', KEYS[3]), 0}
end
redis.call('HSETNX', KEYS[1], 'id', ARGV[2])
local count = redis.call('HINCRBY', KEYS[1], 'count', 1)
redis.call('HSET', KEYS[1], 'holders', cjson.encode(holders), unpack(ARGV, 6))
local keep = tonumber(ARGV[5])
if keep and keep > 0 then
  local gen = tonumber(ARGV[4])
  local recorded = tonumber(redis.call('GET', KEYS[2]))
  if recorded and recorded > gen then
    gen = recorded
  end
  redis.call('SET', KEYS[2], string.format('%d', gen), 'PX', keep)
end
local pttl = redis.call('PTTL', met)
if pttl < 0 then
  pttl = 0
end
redis.call('PEXPIRE', KEYS[1], pttl + tonumber(ARGV[3]))
return {1, redis.call('HGET', KEYS[1], 'id'), count}
