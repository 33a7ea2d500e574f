-- Take the joiners a run's end completes: every one that joined that run (even while it still
-- holds the lock: the worker's main process ends a terminated or timed-out run for it), or a
-- run other than the lock's holder now (an earlier one that died without taking them). Those
-- that joined another run holding the lock now stay for its own end.
--
-- KEYS[1]   the lock (a hash written by acquire.lua; with 'ended' an at-least window: no holder)
-- KEYS[2]   the lock's joiners (same hash slot), as join.lua writes them
-- ARGV[1]   the task id of the run that ended: its own record, left while it waited as a
--           joiner before it ran in a dead holder's place, is dropped, not returned
-- return    {id, holder, record, id, holder, record, ...} of the joiners taken (deleted), each
--           record without its serial
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
local current = held[1]
if held[2] then
  current = false
end
local all = redis.call('HGETALL', KEYS[2])
local taken = {}
for i = 1, #all, 2 do
  local id, value = all[i], all[i + 1]
  local bar = string.find(value, '|', 1, true)
  local holder = string.sub(value, 1, bar - 1)
  local record = string.sub(value, string.find(value, '|', bar + 1, true) + 1)  -- past the serial
  if id == ARGV[1] then
    redis.call('HDEL', KEYS[2], id)
  elseif holder == ARGV[1] or holder ~= current then
    redis.call('HDEL', KEYS[2], id)
    taken[#taken + 1] = id
    taken[#taken + 1] = holder
    taken[#taken + 1] = record
  end
end
return taken
