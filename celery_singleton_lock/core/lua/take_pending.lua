-- Take the pending follow-up of a key (coalesce.lua), once: only when a slot of the key (the
-- lock itself for one permit) is not held by a run, so the follow-up can take it. Whoever gets
-- the record publishes it (or, when a newer run released, ends it as that run's skip); nobody
-- else can get it.
--
-- KEYS[1]   the pending follow-up
-- KEYS[2..] the lock (a hash written by acquire.lua), or the N permit slots of the key (same
--           hash slot), in order
-- return    the record as field, value, ... (deleted), or an empty array: no record, or a run
--           holds every slot (the first of their releases takes the record; an at-least window
--           counts as free)
local free = false
for i = 2, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'ended')
  if not held[1] or held[2] then
    free = true
    break
  end
end
if not free then
  return {}
end
local record = redis.call('HGETALL', KEYS[1])
if #record > 0 then
  redis.call('DEL', KEYS[1])
end
return record
