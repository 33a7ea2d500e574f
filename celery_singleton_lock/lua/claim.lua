-- Claim one scheduled run for one beat instance, for long enough to publish it.
--
-- KEYS[1]   the run's claim key (entry name + nominal run time)
-- ARGV[1]   claimer: the beat instance id
-- ARGV[2]   publish lease, milliseconds: how long a claim may stay unconfirmed
-- return    {1}                  claimed; publish, then confirm.lua
--           {0, value, pttl_ms}  already claimed: value is "pending <id>" or "done <id> <task id>"
local value = redis.call('GET', KEYS[1])
if value then
  return {0, value, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], 'pending ' .. ARGV[1], 'PX', ARGV[2])
return {1}
