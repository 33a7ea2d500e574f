-- Take the pending follow-up of a lock (coalesce.lua), once: only when no run holds the lock.
-- Whoever gets the record publishes it; nobody else can get it.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   the pending follow-up (same hash slot)
-- return    the record as field, value, ... (deleted), or an empty array: no record, or a run
--           holds the lock (its release takes the record; an at-least window counts as free)
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
if held[1] and not held[2] then
  return {}
end
local record = redis.call('HGETALL', KEYS[2])
if #record > 0 then
  redis.call('DEL', KEYS[2])
end
return record
