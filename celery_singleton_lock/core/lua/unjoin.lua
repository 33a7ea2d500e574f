-- Withdraw a joiner: its own message could not be kept (its watch copy was not published: it is
-- requeued instead), or its watch copy runs the call in a dead holder's place. Either way it
-- must not be completed as well. Only the joiner's live watch copy withdraws it (join.lua).
--
-- KEYS[1]   the lock's joiners (as join.lua writes them)
-- ARGV[1]   the joiner's task id
-- ARGV[2]   the serial of the watch copy that withdraws it ('': whichever is live)
-- return    1 withdrawn; 0 already taken (a run's end completes it); -1 stale: the record names
--           another live watch copy, nothing withdrawn
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then
  return 0
end
if ARGV[2] ~= '' then
  local bar = string.find(value, '|', 1, true)
  local serial = tonumber(string.sub(value, bar + 1, string.find(value, '|', bar + 1, true) - 1))
  if serial ~= tonumber(ARGV[2]) then
    return -1
  end
end
return redis.call('HDEL', KEYS[1], ARGV[1])
