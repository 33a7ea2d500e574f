-- Claim one scheduled run for one beat instance, for long enough to publish it.
--
-- KEYS[1]   the run's claim key (entry name + nominal run time)
-- KEYS[2]   the run's witness key: set by the first worker that received one of its messages
-- ARGV[1]   claimer: the beat instance id
-- ARGV[2]   publish lease, milliseconds: how long a claim may stay unconfirmed
-- ARGV[3]   how long to keep the claim once it is known published, milliseconds
-- return    {1}                  claimed; publish, then confirm.lua
--           {0, value, pttl_ms}  already claimed: value is "pending <id>" or "done <id> <task id>"
--                                (a run a worker received, whose claim expired unconfirmed,
--                                is marked "done witness <task id>" here)
--
-- A claim pending under the claimer's own id is its own (an earlier claim ran here but its reply
-- was lost): it is claimed again, with a fresh lease, instead of being waited out.
local value = redis.call('GET', KEYS[1])
if value == 'pending ' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1}
end
if value then
  return {0, value, redis.call('PTTL', KEYS[1])}
end
local received = redis.call('GET', KEYS[2])
if received then
  value = 'done witness ' .. received
  redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
  return {0, value, tonumber(ARGV[3])}
end
redis.call('SET', KEYS[1], 'pending ' .. ARGV[1], 'PX', ARGV[2])
return {1}
